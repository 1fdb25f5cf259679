#!/usr/bin/env python3
"""Cost that grows with the work: 10^2 to 10^6 tracked, churn from 0 to 100 % per iteration.

Issue 25 asks for per-request memory and per-change cost from 10^2 to 10^6 tracked
requests, with churn rates from 0 to 100 % per iteration, beside the naive locked dict,
asyncio ``call_at`` and transitions' ``Timeout``. The arms are bench_core.py's
(``StallguardArm``, ``NaiveArm``, ``AsyncioArm``, ``TransitionsArm``), driven through
the same work:

* **An iteration** at churn rate *c*, N tracked: the c·N oldest requests finish (a
  terminal state, ``observe(key, "Success")``: a *departure*), c·N new ones are tracked
  (``observe(new_key, "Bootstrapping")``: an *admission*), a fixed fraction (``--changes``,
  default 25 %) of the tracked requests move to their next live state, in turn (a
  *state change*), then one deadline check with nothing due (stallguard's ``check()``;
  the naive arm's full scan; one asyncio event-loop iteration, which purges cancelled
  timer handles; transitions has none: a timer thread per request fires on its own).
* **Time moves**: each arm reads a settable clock that advances one unit per iteration,
  and every state deadline is ``--deadline`` units (default 8). Every request changes
  state at least every 1 / changes iterations (4 by default), so nothing falls due, and
  a request that lives long enough is admitted onto stallguard's deadline FIFOs (by
  the first check that may find something due at least half the shortest deadline
  after its first reading: at 4-8 iterations of age here): at churn 100 % every
  request lives one iteration and stays young; at 0-10 % most are admitted. (With
  deadlines much longer than a request's life, everything stays young: cheaper for
  stallguard, no different for the others.)
* **Arms alternate** batch by batch in one process (the first arm rotates each round);
  a batch is as many iterations as take about 2 ms (at least one).
  Each phase of an iteration is timed on its own by ``--timer`` (default ``cpu``: this
  thread's CPU time, ``time.thread_time_ns``, which leaves out the time the process
  waits for a core on a shared machine; transitions' timer threads are other threads,
  so their own CPU is not in its figures), less the timer's own cost (calibrated at the
  start and printed). Every figure is a **mean** over the timed series (its time over
  its operations: periodic work, a FIFO compaction, a bulk admission, an asyncio heap
  rebuild, is in it; the median batch's iteration is printed beside the mean, and
  every arm runs ``--min-iterations`` iterations at least, by default as many as make
  every request change state twice: 8). The garbage collector is off while batches run and
  each batch is charged the collections its own allocations cause
  (bench_engine.charged); they are in the iteration figure and printed on their own,
  not in the per-operation ones.
* **Memory** (tracemalloc; the key objects are made beforehand and not counted): per
  tracked request just after tracking N, and after a check has admitted them; per state
  change retained, young and admitted (one change of every request, then a check);
  per departure retained
  (all N finish, then a check: stallguard remembers up to ``memory`` = 65,536 concluded
  keys, so a late event never re-tracks one); and, for each churn rate, per tracked
  request after the warm-up iterations that precede the timing (warmup_iterations()).

transitions' ``Timeout`` starts an OS thread per state entry: it runs only up to
``--transitions-cap`` tracked (default 1,000); asyncio, whose iteration at 10^5 already
takes 0.4-1.4 s of CPU and whose warm-up under tracemalloc several times that, up to
``--asyncio-cap`` (default 10^5). Above ``--traced-max`` (10^5) the warm-up runs
without tracemalloc (the memory after it is not measured; the other memory figures
are). At 10^6, 3 timed iterations at churn 100 % (``--min-iterations-large``).
``--quick`` is a smoke test, not a measurement.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import bench_core as bc  # noqa: E402
import bench_engine as be  # noqa: E402

import stallguard as sg  # noqa: E402
from stallguard.instrumentation import set_on_expire_hooks  # noqa: E402

FIRST, DONE = bc.LIVE[0], bc.TERMINAL[0]
PHASES = ("departure", "admission", "state change", "check")  # (an iteration's order)
ORDER = ("state change", "admission", "departure", "check")  # (the table's)


# ---------------------------------------------------------------------------- the arms


class ChurnTransitionsArm(bc.TransitionsArm):
    """bench_core's transitions arm, which also removes a finished request's model from
    the shared machine (bench_core's never finishes one before close(): without this,
    every departed model would stay on the machine's list)."""

    def observe(self, key: int, state: str) -> None:
        model = self.models.get(key) if state in bc.TERMINAL else None
        super().observe(key, state)
        if model is not None:
            self.machine.remove_model(model)  # (a list.remove: O(N), transitions' own)


def _stallguard(clock: bc.SetClock, deadline: float) -> Any:
    spec = sg.Spec(
        name="bench_scale", deadlines=dict.fromkeys(bc.LIVE, deadline), terminal=bc.TERMINAL
    )
    return bc.StallguardArm(spec, clock=clock)


def _clocked(cls: Any) -> Callable[[bc.SetClock, float], Any]:
    def make(clock: bc.SetClock, deadline: float) -> Any:
        arm = cls(clock=clock)
        arm.deadlines = dict.fromkeys(bc.LIVE, deadline)
        return arm

    return make


@dataclass
class Kind:
    """One arm: how to make it, its check (timed), how many requests that check (or the
    arm's own timers) expired."""

    name: str
    make: Callable[[bc.SetClock, float], Any]
    check: Callable[[Any], Callable[[], Any]] | None
    expired: Callable[[Any, Any], int]
    cap: int


def kinds(transitions_cap: int, asyncio_cap: int) -> list[Kind]:
    def failed(arm: Any, _: Any) -> int:
        return len(arm.failed)

    return [
        Kind("stallguard", _stallguard, lambda a: a.wd.check, lambda _, out: len(out), 10**9),
        Kind("naive dict", _clocked(bc.NaiveArm), lambda a: a.check, failed, 10**9),
        Kind("asyncio call_at", _clocked(bc.AsyncioArm), lambda a: a.idle, failed, asyncio_cap),
        Kind(
            "transitions Timeout",
            lambda clock, deadline: ChurnTransitionsArm(),  # (real timers, LONG: never due)
            None,
            lambda a, _: len(a.fired),
            transitions_cap,
        ),
    ]


# ------------------------------------------------------------------------ the work


def new_keys(start: int, count: int) -> list[int]:
    """Keys *start* .. *start* + *count* - 1 of bench_core.make_keys' sequence."""
    return [(1 << 62) + 7919 * i for i in range(start, start + count)]


def per_iteration(n: int, fraction: float) -> int:
    """How many of *n* requests a *fraction* moves in an iteration (at least one, unless
    the fraction is 0)."""
    return 0 if fraction <= 0 else max(1, round(fraction * n))


class Churn:
    """One arm's N tracked requests, in slots, and the iterations on them: departures
    take the oldest slots (in turn), admissions refill them, state changes move the
    next slots in turn to their next live state."""

    def __init__(self, kind: Kind, n: int, churn: float, changes: float, deadline: float):
        self.kind = kind
        self.clock = bc.SetClock()
        self.arm = kind.make(self.clock, deadline)
        self.observe = self.arm.observe
        self.check = kind.check(self.arm) if kind.check else None
        self.n = n
        self.turnover = per_iteration(n, churn)
        self.moves = per_iteration(n, changes)
        self.slots: list[int] = []
        self.phase: list[int] = []
        self.out = 0  # next slot to finish
        self.move = 0  # next slot to change state
        self.made = n  # keys made so far (the next new key's index)
        self.spent = [0, 0, 0, 0]  # per phase, over the timed series: ns
        self.ops = [0, 0, 0, 0]  # per phase, over the timed series: operations
        self.iterations = 0  # timed
        self.batches: list[float] = []  # per batch: ns per iteration

    def fill(self, keys: list[int]) -> None:
        observe = self.observe
        for k in keys:
            observe(k, FIRST)
        self.slots = list(keys)
        self.phase = [0] * len(keys)

    def fresh(self, iterations: int) -> list[int]:
        """The new keys *iterations* iterations will admit (made before they run)."""
        keys = new_keys(self.made, self.turnover * iterations)
        self.made += len(keys)
        return keys

    def iterate(self, new: list[int], overhead: int) -> int:
        """One iteration admitting *new* (self.turnover keys): adds each phase's time
        (less the timer's *overhead*) and operations to self.spent and self.ops;
        returns the iteration's time."""
        pc = bc.pc
        observe, slots, phase, n = self.observe, self.slots, self.phase, self.n
        self.clock.now += 1.0
        where = [(self.out + j) % n for j in range(len(new))]
        gone = [slots[i] for i in where]
        t0 = pc()
        for k in gone:
            observe(k, DONE)
        t1 = pc()
        for k in new:
            observe(k, FIRST)
        t2 = pc()
        for i, k in zip(where, new, strict=True):
            slots[i] = k
            phase[i] = 0
        self.out = (self.out + len(new)) % n
        moves = []
        live = bc.LIVE
        for j in range(self.move, self.move + self.moves):
            i = j % n
            s = phase[i] = (phase[i] + 1) % 3
            moves.append((slots[i], live[s]))
        self.move = (self.move + self.moves) % n
        t3 = pc()
        for k, state in moves:
            observe(k, state)
        t4 = pc()
        out = self.check() if self.check is not None else None
        t5 = pc()
        if self.kind.expired(self.arm, out):
            raise RuntimeError(f"{self.kind.name}: a request expired; nothing should")
        spent = [t1 - t0, t2 - t1, t4 - t3, t5 - t4]
        done = (len(new), len(new), len(moves), int(self.check is not None))
        total = 0
        for p, (dt, count) in enumerate(zip(spent, done, strict=True)):
            if count:
                dt -= overhead
                self.spent[p] += dt
                self.ops[p] += count
                total += dt
        self.iterations += 1
        return total

    def runner(self, overhead: int) -> Callable[[int], tuple[int, int]]:
        """bench_engine's batch interface: run *b* iterations -> (ns, iterations)."""

        def run(b: int) -> tuple[int, int]:
            new = self.fresh(b)
            total = 0
            t = self.turnover
            for j in range(b):
                total += self.iterate(new[j * t : (j + 1) * t], overhead)
            self.batches.append(total / b)
            return total, b

        return run

    def calibrate(self, batch_ns: float, overhead: int) -> int:
        """Iterations per batch: as many as take about *batch_ns* (at least one), by
        the time of one iteration."""
        dt = self.iterate(self.fresh(1), overhead)
        self.spent, self.ops, self.iterations = [0, 0, 0, 0], [0, 0, 0, 0], 0
        return max(1, round(batch_ns / max(dt, 1)))

    def mean(self, phase: str) -> float | None:
        """ns per operation of *phase* over the timed series (None: it had none)."""
        p = PHASES.index(phase)
        return self.spent[p] / self.ops[p] if self.ops[p] else None

    def close(self) -> None:
        self.arm.close()


def timer_overhead() -> int:
    """The median cost of one timed interval's timer calls (ns): subtracted from each."""
    pc = bc.pc
    xs = []
    for _ in range(2001):
        t0 = pc()
        xs.append(pc() - t0)
    return int(statistics.median(xs))


# ------------------------------------------------------------------------- memory


def traced() -> int:
    gc.collect()
    return int(tracemalloc.get_traced_memory()[0])


def memory_detail(kind: Kind, n: int, deadline: float) -> dict[str, float]:
    """Bytes per request: just tracked; per state change retained, young (at half a
    deadline, before any check); admitted (a check a deadline after the first reading:
    the first that can find something due, so the first that admits); per state change
    retained, admitted (every request changes once more, then a check); per departure
    retained (every request finishes, then a check a deadline later, when whatever
    they left on a deadline clock is due and dropped)."""
    keys = bc.make_keys(n)
    clock = bc.SetClock()
    arm = kind.make(clock, deadline)
    check = kind.check(arm) if kind.check else (lambda: None)
    check()  # (an asyncio loop's first iteration allocates the loop's own state)
    threads = threading.active_count()
    gc.collect()
    gc.freeze()  # (what exists already: out of the collections traced() runs, to be quick)
    tracemalloc.start()
    try:
        m0 = traced()
        for k in keys:
            arm.observe(k, FIRST)
        m1 = traced()
        clock.now = deadline / 2
        for k in keys:
            arm.observe(k, bc.LIVE[1])
        m2 = traced()
        clock.now = deadline
        if kind.expired(arm, check()):
            raise RuntimeError(f"{kind.name}: a request expired; nothing should")
        m3 = traced()
        for k in keys:
            arm.observe(k, bc.LIVE[2])
        check()
        m4 = traced()
        for k in keys:
            arm.observe(k, DONE)
        clock.now += deadline  # (every entry left behind is due: a check drops them)
        check()
        bc.wait_threads(threads)
        m5 = traced()
    finally:
        tracemalloc.stop()
        gc.unfreeze()
        arm.close()
    return {
        "new": (m1 - m0) / n,
        "young change": (m2 - m1) / n,
        "admitted": (m3 - m0) / n,
        "change": (m4 - m3) / n,
        "departure": (m5 - m0) / n,
    }


def warmup_iterations(churn: float, opts: Options) -> int:
    """Iterations before timing, to a steady state: a request living half a deadline or
    less is never admitted, so once every request has been replaced; otherwise until
    the first stale FIFO entries of admitted requests are due (2 deadlines and a few
    iterations), or every request has been replaced a deadline after that, if sooner."""
    if opts.warmup is not None:
        return opts.warmup
    deadline = math.ceil(opts.deadline)
    life = 10**9 if churn <= 0 else math.ceil(1 / churn)
    warmup = life + 1 if life <= deadline / 2 else min(2 * deadline + 4, life + deadline + 2)
    return min(warmup, 3) if opts.quick else warmup


def built(kind: Kind, n: int, churn: float, opts: Options) -> tuple[Churn, float | None]:
    """An arm tracking N after the warm-up iterations at *churn*, and its bytes per
    tracked request then (tracemalloc, from the empty arm; keys not counted; None
    above opts.traced_max, where the warm-up runs untraced: tracemalloc slows it
    several times)."""
    arm = Churn(kind, n, churn, opts.changes, opts.deadline)
    keys = bc.make_keys(n)
    warmup = warmup_iterations(churn, opts)
    new = arm.fresh(warmup)  # (made before tracemalloc starts: keys are not counted)
    if arm.check is not None:
        arm.check()
    t = arm.turnover
    if n > opts.traced_max:
        arm.fill(keys)
        for j in range(warmup):
            arm.iterate(new[j * t : (j + 1) * t], 0)
        return arm, None
    gc.collect()
    gc.freeze()  # (what exists already: out of the collections traced() runs, to be quick)
    tracemalloc.start()
    try:
        m0 = traced()
        arm.fill(keys)
        for j in range(warmup):
            arm.iterate(new[j * t : (j + 1) * t], 0)
        m1 = traced()
    finally:
        tracemalloc.stop()
        gc.unfreeze()
    return arm, (m1 - m0) / n


# ---------------------------------------------------------------------------- the run


class Options:
    def __init__(self, args: argparse.Namespace) -> None:
        self.quick = args.quick
        self.changes = args.changes
        self.deadline = float(args.deadline)
        self.warmup: int | None = args.warmup
        self.traced_max = args.traced_max
        self.budget_s = 0.02 if args.quick else args.budget
        cycle = 2 * math.ceil(1 / args.changes) if args.changes > 0 else 8
        self.min_iterations = 2 if args.quick else (args.min_iterations or cycle)
        self.min_iterations_large = 2 if args.quick else args.min_iterations_large
        self.max_rounds = 4 if args.quick else 200
        self.batch_ns = 5e5 if args.quick else 2e6  # a batch: iterations for about 2 ms


def alternate(arms: dict[str, Churn], least: int, opts: Options, overhead: int) -> dict[str, float]:
    """Batches of every arm in turn (the first arm rotating each round), collector off,
    each batch charged its own collections, until every arm has run *least* iterations
    and the time budget is spent; the mean iteration (ns) per arm, its collections
    included (be.GC_PER_OP then holds each arm's per iteration)."""
    batch = {name: a.calibrate(opts.batch_ns, overhead) for name, a in arms.items()}
    runs = {name: be.charged(name, a.runner(overhead)) for name, a in arms.items()}
    names = list(runs)
    samples: dict[str, list[float]] = {name: [] for name in names}
    be.measure_full_collection()
    gc.disable()
    try:
        be.SERIES_GC.clear()
        end = time.perf_counter() + opts.budget_s * len(names)
        rounds = 0
        while rounds < opts.max_rounds and (
            min(a.iterations for a in arms.values()) < least or time.perf_counter() < end
        ):
            for j in range(len(names)):
                name = names[(rounds + j) % len(names)]
                dt, done = runs[name](batch[name])
                samples[name].append(dt / done)
            rounds += 1
    finally:
        gc.enable()
    # (a name's batches all have its one size: the mean of them is total / iterations)
    return {name: statistics.fmean(xs) for name, xs in be.amortized(samples).items()}


def least_iterations(n: int, churn: float, opts: Options) -> int:
    """Timed iterations per arm, at least: enough for every request to change state
    twice (state FIFOs and their compactions come around); at 10^6, where an
    iteration takes seconds, fewer when no request lives to be admitted."""
    if n >= 10**6 and churn > 0 and 1 / churn <= opts.deadline / 2:
        return opts.min_iterations_large
    return opts.min_iterations


def fmt_ns(x: float | None) -> str:
    if x is None:
        return "—"
    if x >= 1e6:
        return f"{x / 1e6:,.2f} ms"
    if x >= 1e4:
        return f"{x / 1e3:,.1f} µs"
    return f"{x:,.0f} ns"


def fmt_b(x: float | None) -> str:
    return "—" if x is None else f"{x:,.0f} B"


def pct(c: float) -> str:
    return f"{c * 100:g} %"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test, not a measurement")
    parser.add_argument("--sizes", default=None, help="comma-separated N (default 10^2 .. 10^6)")
    parser.add_argument(
        "--churn", default="0,1,10,100", help="comma-separated churn rates, %% per iteration"
    )
    parser.add_argument(
        "--changes", type=float, default=0.25, help="fraction changing state per iteration"
    )
    parser.add_argument("--deadline", type=float, default=8, help="state deadlines, iterations")
    parser.add_argument(
        "--warmup", type=int, default=None, help="iterations before timing (default: see code)"
    )
    parser.add_argument("--budget", type=float, default=1.0, help="seconds per arm and cell")
    parser.add_argument(
        "--min-iterations",
        type=int,
        default=None,
        help="timed iterations per arm, at least (default: every request changes state twice)",
    )
    parser.add_argument(
        "--min-iterations-large",
        type=int,
        default=3,
        help="the same at 10^6 when no request lives to be admitted (churn 100 %%)",
    )
    parser.add_argument("--transitions-cap", type=int, default=None, help="default 1,000")
    parser.add_argument("--asyncio-cap", type=int, default=10**5)
    parser.add_argument(
        "--traced-max",
        type=int,
        default=10**5,
        help="largest N whose warm-up runs under tracemalloc (memory after warm-up)",
    )
    parser.add_argument(
        "--timer",
        choices=("wall", "cpu"),
        default="cpu",
        help="this thread's CPU time (default; time.thread_time_ns) or the wall clock",
    )
    args = parser.parse_args(argv)
    if args.timer == "cpu":
        bc.pc = time.thread_time_ns
    opts = Options(args)
    default_sizes = "100,200" if args.quick else "100,1000,10000,100000,1000000"
    sizes = [int(s) for s in (args.sizes or default_sizes).split(",")]
    churns = [float(c) / 100 for c in args.churn.split(",")]
    cap = args.transitions_cap or (100 if args.quick else 1000)
    arm_kinds = kinds(cap, args.asyncio_cap)
    set_on_expire_hooks([])
    overhead = timer_overhead()
    started = time.monotonic()
    print("# cost that grows with the work: N tracked x churn per iteration\n")
    print(
        f"- python {sys.version.split()[0]}, stallguard {sg.__version__}, timer {args.timer} "
        f"(overhead {overhead} ns per timed interval, subtracted), load average "
        f"{os.getloadavg()[0]:.2f} at start"
    )
    print(
        f"- an iteration: churn x N finish and as many are tracked, {pct(opts.changes)} of N "
        f"change state, one check; deadlines {opts.deadline:g} iterations; warm-up "
        + ", ".join(f"{warmup_iterations(c, opts)} at {pct(c)}" for c in churns)
        + f" iterations; transitions up to N = {cap:,}, asyncio up to "
        f"N = {args.asyncio_cap:,}\n"
    )
    print(
        "| N | churn | arm | state change | admission | departure | check | iteration "
        "| iteration, median batch, no collections | of which collections (objects left "
        "to generation 2 per iteration) "
        "| iteration / stallguard | load |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    steady: dict[tuple[int, str, float], float | None] = {}
    details: dict[tuple[int, str], dict[str, float]] = {}
    for n in sizes:
        for kind in arm_kinds:
            if n <= kind.cap:
                log(f"N={n:,} {kind.name}: memory")
                details[n, kind.name] = memory_detail(kind, n, opts.deadline)
        for churn in churns:
            arms = {}
            for kind in arm_kinds:
                if n <= kind.cap:
                    log(f"N={n:,} churn {pct(churn)} {kind.name}: build, warm-up")
                    arms[kind.name], steady[n, kind.name, churn] = built(kind, n, churn, opts)
            log(f"N={n:,} churn {pct(churn)}: timing")
            iteration = alternate(arms, least_iterations(n, churn, opts), opts, overhead)
            for kind in arm_kinds:
                print_row(n, churn, kind, arms.get(kind.name), iteration)
            for arm in arms.values():
                arm.close()
            del arms
            gc.collect()
    print_memory(sizes, churns, arm_kinds, details, steady, opts)
    print(f"\n- load average at end {os.getloadavg()[0]:.2f}; {time.monotonic() - started:,.0f} s")
    return 0


def print_row(
    n: int, churn: float, kind: Kind, arm: Churn | None, iteration: dict[str, float]
) -> None:
    head = f"| {n:,} | {pct(churn)} | {kind.name} |"
    if arm is None:
        print(f"{head} not run (N > {kind.cap:,}) |  |  |  |  |  |  |  | {load()} |")
        return
    cells = " | ".join(fmt_ns(arm.mean(phase)) for phase in ORDER)
    ratio = iteration[kind.name] / iteration["stallguard"]
    print(
        f"{head} {cells} | {fmt_ns(iteration[kind.name])} | "
        f"{fmt_ns(statistics.median(arm.batches))} | {fmt_ns(be.GC_PER_OP[kind.name])} "
        f"({be.SURVIVORS_PER_OP[kind.name]:,.0f} survivors) | "
        f"{ratio:.2f} | {load()} |",
        flush=True,
    )


def print_memory(
    sizes: list[int],
    churns: list[float],
    arm_kinds: list[Kind],
    details: dict[tuple[int, str], dict[str, float]],
    steady: dict[tuple[int, str, float], float | None],
    opts: Options,
) -> None:
    print("\n## memory (tracemalloc, keys not counted)\n")
    after = " | ".join(f"after warm-up, churn {pct(c)}" for c in churns)
    print(
        "| N | arm | per request, tracked | per state change, young | per request, admitted "
        f"| per state change, admitted | per departure, retained | {after} |"
    )
    print("|---:|---|" + "---:|" * (5 + len(churns)))
    for n in sizes:
        for kind in arm_kinds:
            d = details.get((n, kind.name))
            if d is None:
                blanks = " |" * (4 + len(churns))
                print(f"| {n:,} | {kind.name} | not run (N > {kind.cap:,}) |{blanks}")
                continue
            cells = " | ".join(fmt_b(steady.get((n, kind.name, c))) for c in churns)
            if n > opts.traced_max:
                cells = " | ".join(f"not traced (N > {opts.traced_max:,})" for c in churns)
            print(
                f"| {n:,} | {kind.name} | {fmt_b(d['new'])} | {fmt_b(d['young change'])} | "
                f"{fmt_b(d['admitted'])} | {fmt_b(d['change'])} | {fmt_b(d['departure'])} "
                f"| {cells} |"
            )
    print(
        "\n- after warm-up: the iterations before the timing (above), per tracked request, "
        "from the empty arm"
    )


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
