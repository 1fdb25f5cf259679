#!/usr/bin/env python3
"""The deadline engine, before and after, side by side with arms alternating.

bench_core.py runs each arm's series one after the other; on a shared 2-core machine
whose load moves by tens of percent in seconds, that makes its ratios drift. This
script times the same operations with the arms **alternating batch by batch** in one
process, so that every arm sees the same machine, and prints ratios:

* ``stallguard``: this checkout's watchdog (lazy per-clock FIFOs);
* ``previous``: the watchdog as of git revision ``--previous`` (default ``0b9bc74``, the
  ``OrderedDict`` engine), extracted from this repository's history into a temporary
  directory and imported as a separate package;
* ``naive scan``'s plain dict update and ``asyncio call_at`` (from bench_core.py);
* ``dict store`` (state change only): a bare ``dict[key] = state`` through the dict's
  bound ``__setitem__``, the floor any tracking costs.

Every timed batch is charged the garbage collections its own allocations cause and
none of another arm's (charged()). The load average is printed beside each row.

Rows (issue 14's targets): state change (no slower than the naive dict update), same-state
observe, ``check()`` with nothing due (unchanged), one expiry per check (≤ 1.5 µs), the
guarded poll's added cost (at most 2x the asyncio arm's). ``--quick`` is a smoke test.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import bench_core as bc  # noqa: E402

import stallguard as sg  # noqa: E402
from stallguard.instrumentation import set_on_expire_hooks  # noqa: E402

pc = time.perf_counter_ns


def load_previous(rev: str) -> Any:
    """The ``stallguard`` package at git *rev*, imported as ``stallguard_previous``."""
    root = Path(tempfile.mkdtemp(prefix="stallguard-previous-"))
    archive = subprocess.run(
        ["git", "-C", str(HERE.parent), "archive", rev, "stallguard"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    (root / "stallguard").rename(root / "stallguard_previous")
    sys.path.insert(0, str(root))
    module = importlib.import_module("stallguard_previous")
    module.instrumentation.set_on_expire_hooks([])
    return module


def load_compiled() -> Any:
    """This checkout's package with the compiled core (hatch_build.py, mypyc), imported
    as ``stallguard_compiled`` beside the sources (``stallguard``), so that the two
    alternate in one process. The build is cached in build/bench-compiled/ and redone
    when a file of the package changes (~40-60 s)."""
    import hashlib
    import shutil

    sys.path.insert(0, str(HERE.parent))
    import hatch_build

    source = HERE.parent / "stallguard"
    files = sorted(p for p in source.rglob("*.py") if "__pycache__" not in p.parts)
    digest = hashlib.sha256()
    for path in [*files, HERE.parent / "hatch_build.py"]:
        digest.update(str(path.relative_to(HERE.parent)).encode() + path.read_bytes())
    key = f"{digest.hexdigest()[:16]} {sys.version}"
    root = HERE.parent / "build" / "bench-compiled"
    stamp = root / "key"
    if not (stamp.is_file() and stamp.read_text() == key):
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(
            source, root / "stallguard_compiled", ignore=shutil.ignore_patterns("__pycache__")
        )
        print("# compiling the core with mypyc (build/bench-compiled) ...", flush=True)
        hatch_build.compile_core(root / "stallguard_compiled", root)
        stamp.write_text(key)
    sys.path.insert(0, str(root))
    module = importlib.import_module("stallguard_compiled")
    if not module.__compiled__:
        raise SystemExit(f"the compiled build does not run: {module._accel.WHY}")
    module.instrumentation.set_on_expire_hooks([])
    return module


class Arm:
    """A watchdog of either package, driven directly."""

    def __init__(self, name: str, pkg: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        spec = pkg.Spec(
            name="bench", deadlines=dict.fromkeys(bc.LIVE, bc.LONG), terminal=bc.TERMINAL
        )
        self.wd = pkg.Watchdog(spec, clock=clock)
        self.observe = self.wd.observe
        self.check = self.wd.check

    def guard(self, poll: Callable[[Any], int]) -> Callable[[Any], int]:
        return self.wd.guard(key=lambda s: s.room, failed=0, state=bc.KVPOLL)(poll)  # type: ignore[no-any-return]


#: per arm: the time of the collections charged to it (ns), see charged()
GC_NS: dict[str, int] = {}
#: per arm, in the series being measured: [collection ns, operations, survivors]
SERIES_GC: dict[str, list[int]] = {}
#: the collections' share of each arm's figure in the last series (ns per operation),
#: and the objects each of its operations left to generation 2
GC_PER_OP: dict[str, float] = {}
SURVIVORS_PER_OP: dict[str, float] = {}
#: the size of generation 2 and the time of a full collection, measured at the start of
#: each series (see charged())
_long_lived = [1]
_full_ns = [0]


def measure_full_collection() -> None:
    """Time a full collection and count generation 2 (at the start of a series): the
    faster of two in a row (the first also frees what the setup left behind)."""
    times = []
    for _ in range(2):
        t0 = bc.pc()
        gc.collect()
        times.append(bc.pc() - t0)
    _full_ns[0] = min(times)
    _long_lived[0] = max(len(gc.get_objects(generation=2)), 1)


def _timed_collect(generation: int) -> tuple[int, int]:
    """gc.collect(*generation*), timed by the series' timer: (ns, objects collected)."""
    t0 = bc.pc()
    found = gc.collect(generation)
    return bc.pc() - t0, found


def charged(name: str, run: Callable[[int], tuple[int, int]]) -> Callable[[int], tuple[int, int]]:
    """*run* charged the garbage collections its own allocations cause, and none of
    another arm's. The automatic collector is off while the batches run (the caller
    turns it off: no collection runs between batches uncharged); after each batch:

    * a collection of generation 0, then of generation 1, timed: they hold only the
      GC-tracked objects this batch allocated (the previous batch, of whichever arm,
      ended the same way), so their cost is this arm's own;
    * what survives both goes to generation 2. CPython starts a full collection when
      the survivors pending exceed a quarter of generation 2's size, so each survivor
      costs, amortized, 4 / (generation 2's size) of a full collection: the batch is
      charged that for each of its survivors, at the full collection's time measured
      at the start of the series (measure_full_collection; a full collection walks the
      whole process's heap, every arm's objects, as it would in a server). Charging
      the rate rather than running the collection makes the charge independent of how
      many batches a series runs: at 10^5-10^6 tracked a series of a few hundred
      batches reaches no full collection, and at 10^3 the arm that happened to cross
      the threshold would pay all of it.

    An arm that allocates no tracked object (or only ones freed at once by reference
    counting) pays nothing. Young collections run every batch instead of every 700
    allocations: slightly more often than the automatic collector would, with the
    same total work. The collections' time is kept out of the batch's sample and
    accounted in SERIES_GC (a median would otherwise drop it); amortized() adds each
    arm's collection time per operation, over the whole series, to every sample."""

    def run_charged(b: int) -> tuple[int, int]:
        dt, done = run(b)
        spent = _timed_collect(0)[0]
        young = len(gc.get_objects(generation=1))  # (untimed: bookkeeping)
        more, found = _timed_collect(1)
        survivors = max(young - found, 0)
        spent += more + survivors * 4 * _full_ns[0] // _long_lived[0]
        account = SERIES_GC.setdefault(name, [0, 0, 0])
        account[0] += spent
        account[1] += done
        account[2] += survivors
        GC_NS[name] = GC_NS.get(name, 0) + spent
        return dt, done

    return run_charged


def amortized(samples: dict[str, list[float]]) -> dict[str, list[float]]:
    """*samples* (per-op times of the batches, collections left out) plus each arm's
    collection time per operation over the series (SERIES_GC, then reset)."""
    out = {}
    for name, xs in samples.items():
        spent, ops, survivors = SERIES_GC.get(name, (0, 0, 0))
        per_op = spent / ops if ops else 0.0
        GC_PER_OP[name] = per_op
        SURVIVORS_PER_OP[name] = survivors / ops if ops else 0.0
        out[name] = [x + per_op for x in xs]
    SERIES_GC.clear()
    return out


def alternate(
    series: dict[str, Callable[[int], tuple[int, int]]], opts: bc.Opts
) -> dict[str, list[float]]:
    """Round-robin batches of every arm's series (about 1 ms each), each charged its own
    garbage collections (charged(); the automatic collector stays off throughout, so
    that no collection runs between batches uncharged); per-op samples."""
    batch = {}
    for name, run in series.items():  # (calibrated uncharged: a batch's work, ~1 ms)
        dt, done = run(1)
        batch[name] = int(min(opts.max_batch, max(1, 1_000_000 / max(dt / max(done, 1), 1.0))))
    measure_full_collection()
    gc.disable()
    try:
        charged_series = {name: charged(name, run) for name, run in series.items()}
        return amortized(_alternate(charged_series, batch, opts))
    finally:
        gc.enable()


def _alternate(
    series: dict[str, Callable[[int], tuple[int, int]]], batch: dict[str, int], opts: bc.Opts
) -> dict[str, list[float]]:
    SERIES_GC.clear()
    samples: dict[str, list[float]] = {name: [] for name in series}
    end = pc() + int(opts.budget_s * len(series) * 1e9)
    rounds = 0
    while rounds < opts.max_samples and (rounds < opts.min_samples or pc() < end):
        for name, run in series.items():
            dt, done = run(batch[name])
            samples[name].append(dt / done)
        rounds += 1
    return samples


def tracked(make: Callable[[], Any], keys: list[int]) -> Any:
    arm = make()
    for k in keys:
        arm.observe(k, "Bootstrapping")
    return arm


def expiry_one_per_check(
    makers: dict[str, Callable[[bc.SetClock], Any]], keys: list[int], opts: bc.Opts
) -> dict[str, list[float]]:
    """N tracked, entering one per second; each check finds exactly one due. The arms'
    checks alternate; wall time per check."""
    samples: dict[str, list[float]] = {name: [] for name in makers}
    end = pc() + int(opts.budget_s * len(makers) * 1e9)
    rounds = 0
    while rounds < opts.min_samples or (pc() < end and rounds < opts.max_samples):
        arms = {}
        for name, make in makers.items():
            clock = bc.SetClock()
            arm = make(clock)
            for k in keys:
                clock.now += 1.0
                arm.observe(k, "Transferring")
            arms[name] = (arm, clock)
        for j in range(1, min(100, len(keys)) + 1):
            for name, (arm, clock) in arms.items():
                clock.now = now = j + bc.LONG
                t0 = bc.pc()
                done = len(arm.check(now))
                dt = bc.pc() - t0
                if done != 1:
                    raise RuntimeError(f"{name}: expired {done}, expected 1")
                samples[name].append(dt)
        rounds += 1
    return samples


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test, not a measurement")
    parser.add_argument(
        "--sizes", default=None, help="comma-separated N (default 1000,10000,100000)"
    )
    parser.add_argument("--previous", default="0b9bc74", help="git revision of the previous engine")
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="the 'previous' arm is this checkout's core compiled with mypyc (load_compiled)",
    )
    parser.add_argument(
        "--this-compiled",
        action="store_true",
        help="the 'stallguard' arm is this checkout's compiled core (against --previous)",
    )
    parser.add_argument(
        "--timer",
        choices=("wall", "cpu"),
        default="wall",
        help="time the batches by the wall clock (default) or by this thread's CPU time "
        "(time.thread_time_ns: on a loaded shared machine it leaves out the time the "
        "process waits for a core; cache contention stays in)",
    )
    args = parser.parse_args()
    if args.timer == "cpu":
        bc.pc = time.thread_time_ns
    opts = bc.Opts(args.quick)
    sizes = [
        int(s)
        for s in (args.sizes or ("100,1000" if args.quick else "1000,10000,100000")).split(",")
    ]
    set_on_expire_hooks([])
    this = load_compiled() if args.this_compiled else sg
    prev = load_compiled() if args.compiled else load_previous(args.previous)
    other = "this checkout compiled (mypyc)" if args.compiled else args.previous
    mine = "this checkout compiled (mypyc)" if args.this_compiled else "this checkout"
    print("# deadline engine:", mine, "vs", other, "(arms alternating batch by batch)\n")
    print(
        f"- python {sys.version.split()[0]}, timer {args.timer}, load average "
        f"{os.getloadavg()[0]:.2f} at start\n"
    )
    print(
        "| operation | N | stallguard | previous | naive dict | dict store | asyncio call_at "
        "| stallguard / naive | stallguard / dict store | stallguard / previous | load |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        keys = bc.make_keys(n)
        arms = {
            "stallguard": tracked(lambda: Arm("stallguard", this), keys),
            "previous": tracked(lambda: Arm("previous", prev), keys),
            "naive": tracked(bc.NaiveArm, keys),
            "asyncio": tracked(bc.AsyncioArm, keys),
        }
        store = dict.fromkeys(keys, "Bootstrapping")
        same = alternate(
            {name: bc.observe_series(a.observe, keys, same=True) for name, a in arms.items()}, opts
        )
        idle = alternate(
            {name: bc.check_series(arms[name].check) for name in ("stallguard", "previous")}, opts
        )
        change = alternate(
            {name: bc.observe_series(a.observe, keys, same=False) for name, a in arms.items()}
            | {"dict store": bc.observe_series(store.__setitem__, keys, same=False)},
            opts,
        )
        arms["asyncio"].close()
        row("state change", n, change)
        gc_share = ", ".join(
            f"{k} {v:,.0f} ns ({SURVIVORS_PER_OP[k]:.2f} survivors/op)"
            for k, v in GC_PER_OP.items()
        )
        print(f"|  | (of which collections: {gc_share}) |  |  |  |  |  |  |  |  |  |")
        row("same-state observe", n, same)
        row("check(), nothing due", n, idle)
        expiry = expiry_one_per_check(
            {
                "stallguard": lambda clock: Arm("stallguard", this, clock),
                "previous": lambda clock: Arm("previous", prev, clock),
            },
            keys,
            opts,
        )
        row("expiry, one per check", n, expiry)
        senders = [bc.Sender(k) for k in keys]
        guards = {}
        for name, make in (
            ("stallguard", lambda: Arm("stallguard", this)),
            ("previous", lambda: Arm("previous", prev)),
            ("asyncio", bc.AsyncioArm),
        ):
            arm = make()
            for s in senders:
                arm.observe(s.room, bc.KVPOLL[bc.TRANSFERRING])
            guards[name] = (arm, arm.guard(bc.Sender.poll))
        bare: list[float] = []
        polls = alternate(
            {name: bc.guard_series(g, senders, bare) for name, (_, g) in guards.items()}, opts
        )
        guards["asyncio"][0].close()
        row("guarded poll, added", n, polls)
    print(f"\n- load average at end {os.getloadavg()[0]:.2f}")
    shown = ", ".join(f"{name} {GC_NS[name] / 1e6:,.1f} ms" for name in sorted(GC_NS))
    print(f"- garbage collection time charged to each arm's batches: {shown}")
    return 0


def row(op: str, n: int, samples: dict[str, list[float]]) -> None:
    def cell(name: str) -> str:
        xs = samples.get(name)
        return "—" if not xs else f"{med(xs):.0f} ns"

    sg_ = med(samples["stallguard"])
    naive = f"{sg_ / med(samples['naive']):.2f}" if "naive" in samples else "—"
    asyn = f"{sg_ / med(samples['asyncio']):.2f}" if "asyncio" in samples else "—"
    ref = naive if "naive" in samples else asyn
    store = f"{sg_ / med(samples['dict store']):.2f}" if "dict store" in samples else "—"
    print(
        f"| {op} | {n:,} | {cell('stallguard')} | {cell('previous')} | {cell('naive')} | "
        f"{cell('dict store')} | {cell('asyncio')} | {ref} | {store} | "
        f"{sg_ / med(samples['previous']):.2f} | {os.getloadavg()[0]:.1f} |",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
