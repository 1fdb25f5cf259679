#!/usr/bin/env python3
"""Side-by-side benchmark of stallguard's core watchdog.

Four ways to give every tracked request a per-state deadline run in this one process,
on the same keys, the same states and the same deadlines:

* ``stallguard``: :class:`stallguard.Watchdog` (per-state FIFOs, one lower-bound
  comparison in ``check()`` when nothing is due).
* ``asyncio``: one ``loop.call_at`` timer handle per request; a state change cancels the
  handle and schedules a new one; the event loop fires due handles.
* ``naive``: a dict of ``key -> (state, entered_at)`` scanned in full on every check
  ("scan every request each poll").
* ``transitions``: the ``transitions`` library's ``Timeout`` state feature, which starts a
  ``threading.Timer`` (one OS thread) on every entry into a timed state. It is capped at a
  small N (default 1,000): 10^5 OS threads are not an option on this machine.

Timings use :func:`time.perf_counter_ns` around a batch of operations (about 1 ms; the
``for`` loop that drives the batch is included, a few tens of ns per operation, the same
for every arm); a batch gives one per-operation sample, and the report shows the median
and the 90th percentile of the samples. Expiries run on a settable clock, so that a
chosen number of requests is due at each check; the one long operation, a check that
expires all N at once, is timed in thread CPU time (:func:`time.thread_time_ns`) so that
time spent preempted on a busy machine is not counted. Instrumentation hooks are
disabled throughout. The garbage collector stays enabled, as in production. Memory is the
:mod:`tracemalloc` delta of tracking N requests, divided by N (key objects are made
beforehand and not counted). docs/performance.md describes each row; ``--help`` lists the
options; ``--quick`` finishes in seconds and is a smoke test only.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import math
import os
import platform
import statistics
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Benchmark the checkout this script sits in, not whatever stallguard is installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import transitions
from transitions import Machine
from transitions.extensions.states import Timeout, add_state_features

import stallguard as sg
from stallguard.instrumentation import set_on_expire_hooks

pc = time.perf_counter_ns

# SGLang's KV sender phases (KVPoll: Failed=0, Bootstrapping=1, WaitingForInput=2,
# Transferring=3, Success=4). Deadlines are long, so nothing expires by accident while
# state changes, checks and polls are timed; the expiry runs move a settable clock past
# them (transitions' timers, which read the real clock, get a short timeout instead).
LIVE = ("Bootstrapping", "WaitingForInput", "Transferring")
TERMINAL = ("Success", "Failed")
LONG = 3600.0
KVPOLL = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}
TRANSFERRING = 3

SPEC = sg.Spec(
    name="bench",
    deadlines=dict.fromkeys(LIVE, LONG),
    terminal=list(TERMINAL),
)
SPEC_LIFETIME_STALL = sg.Spec(
    name="bench_lifetime_stall",
    deadlines={
        "Bootstrapping": LONG,
        "WaitingForInput": LONG,
        "Transferring": sg.Deadline(LONG, stall=LONG),
    },
    terminal=list(TERMINAL),
    lifetime=2 * LONG,
)


def make_keys(n: int) -> list[int]:
    """N distinct 63-bit ints, like SGLang's bootstrap rooms."""
    return [(1 << 62) + 7919 * i for i in range(n)]


# ---------------------------------------------------------------------------- the arms


class StallguardArm:
    """stallguard.Watchdog, used directly."""

    name = "stallguard"
    check_note = ""

    def __init__(self, spec: sg.Spec = SPEC, clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.wd: sg.Watchdog[int] = sg.Watchdog(spec, clock=clock)
        self.observe = self.wd.observe
        self.check: Callable[..., Any] | None = self.wd.check

    def fire(self, now: float) -> int:
        """Expire what is due at *now*; the number expired."""
        return len(self.wd.check(now))

    def guard(self, poll: Callable[[Any], int]) -> Callable[[Any], int]:
        return self.wd.guard(key=lambda s: s.room, failed=0, state=KVPOLL)(poll)

    def close(self) -> None:
        pass


class NaiveArm:
    """A dict of key -> (state, entered_at), scanned in full by every check."""

    name = "naive scan"
    check_note = ""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.table: dict[int, tuple[str, float]] = {}
        self.deadlines = dict.fromkeys(LIVE, LONG)
        self.failed: set[int] = set()
        self.lock = threading.Lock()
        self.clock = clock

    def observe(self, key: int, state: str) -> None:
        current = self.table.get(key)
        if current is not None and current[0] == state:
            return
        with self.lock:  # check() iterates the dict; mutations must not race it
            if state in TERMINAL:
                self.table.pop(key, None)
            else:
                self.table[key] = (state, self.clock())

    def check(self, now: float | None = None) -> list[tuple[int, str, float, float]]:
        if now is None:
            now = self.clock()
        deadlines = self.deadlines
        with self.lock:
            due = [
                (k, s, t, now - t) for k, (s, t) in self.table.items() if now - t >= deadlines[s]
            ]
            for k, *_ in due:
                del self.table[k]
                self.failed.add(k)
        return due

    def fire(self, now: float) -> int:
        return len(self.check(now))

    def guard(self, poll: Callable[[Any], int]) -> Callable[[Any], int]:
        observe, check, failed = self.observe, self.check, self.failed

        def guarded(s: Any) -> int:
            result = poll(s)
            observe(s.room, KVPOLL[result])
            check()
            return 0 if s.room in failed else result

        return guarded

    def close(self) -> None:
        pass


class AsyncioArm:
    """One loop.call_at timer handle per request; cancel + call_at on a state change.

    The event loop is not running while operations are timed (call_at and cancel work
    on a stopped loop); ``idle()`` runs one loop iteration between batches, untimed, so
    that asyncio purges cancelled handles from its heap as a running loop would. For the
    expiry runs the loop's clock is a settable one (``_SteppedLoop``).
    """

    name = "asyncio call_at"
    check_note = "n/a: the event loop checks its timer heap itself"

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.loop = asyncio.new_event_loop() if clock is None else _SteppedLoop(clock)
        self.handles: dict[int, asyncio.TimerHandle] = {}
        self.states: dict[int, str] = {}
        self.deadlines = dict.fromkeys(LIVE, LONG)
        self.failed: set[int] = set()
        self.expired: list[tuple[int, str, float]] = []
        self.check: Callable[..., Any] | None = None

    def observe(self, key: int, state: str) -> None:
        if self.states.get(key) == state:
            return
        handle = self.handles.pop(key, None)
        if handle is not None:
            handle.cancel()
        if state in TERMINAL:
            self.states.pop(key, None)
            return
        self.states[key] = state
        loop = self.loop
        now = loop.time()
        self.handles[key] = loop.call_at(now + self.deadlines[state], self._fire, key, state, now)

    def _fire(self, key: int, state: str, entered: float) -> None:
        del self.handles[key]
        del self.states[key]
        self.failed.add(key)
        self.expired.append((key, state, entered))

    def idle(self) -> None:
        """One event-loop iteration: fires what is due, purges cancelled handles."""
        self.loop.call_soon(self.loop.stop)
        self.loop.run_forever()

    def fire(self, now: float) -> int:
        """One loop iteration at *now* (the stepped clock must already read *now*)."""
        self.expired.clear()
        self.idle()  # one iteration runs every due handle
        return len(self.expired)

    def guard(self, poll: Callable[[Any], int]) -> Callable[[Any], int]:
        observe, failed = self.observe, self.failed

        def guarded(s: Any) -> int:
            result = poll(s)
            observe(s.room, KVPOLL[result])
            return 0 if s.room in failed else result

        return guarded

    def close(self) -> None:
        for handle in self.handles.values():
            handle.cancel()
        self.handles.clear()
        self.idle()
        self.loop.close()


class _SteppedLoop(asyncio.SelectorEventLoop):  # type: ignore[misc,valid-type]
    """An event loop that reads a settable clock, so that its timers can be fired a
    chunk at a time."""

    def __init__(self, clock: Callable[[], float]) -> None:
        super().__init__()
        self._stepped_clock = clock

    def time(self) -> float:
        return self._stepped_clock()


class SetClock:
    """A clock that reads what it was set to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@add_state_features(Timeout)
class _TimeoutMachine(Machine):
    pass


class _Model:
    """A transitions model: one per request."""

    def __init__(self, key: int) -> None:
        self.key = key
        self.failed = False


class TransitionsArm:
    """transitions' Timeout state: a threading.Timer (an OS thread) per state entry."""

    name = "transitions Timeout"
    check_note = "n/a: a timer thread per request fires on its own"

    def __init__(self, timeout: float = LONG) -> None:
        self.models: dict[int, _Model] = {}
        self.fired: list[int] = []
        self.want = 0
        self.all_fired = threading.Event()
        states: list[Any] = [{"name": "New"}]
        states += [{"name": s, "timeout": timeout, "on_timeout": self._fire} for s in LIVE]
        states += [{"name": s} for s in TERMINAL]
        self.machine = _TimeoutMachine(
            model=None, states=states, initial="New", send_event=True, auto_transitions=True
        )
        self.to = {s: "to_" + s for s in (*LIVE, *TERMINAL)}
        self.check: Callable[..., Any] | None = None

    def observe(self, key: int, state: str) -> None:
        model = self.models.get(key)
        if model is None:
            if state in TERMINAL:
                return
            model = self.models[key] = _Model(key)
            self.machine.add_model(model)
        elif model.state == state:  # type: ignore[attr-defined]
            return
        getattr(model, self.to[state])()
        if state in TERMINAL:
            del self.models[key]

    def _fire(self, event: Any) -> None:  # runs on the timer's own thread
        event.model.failed = True
        self.fired.append(event.model.key)
        if len(self.fired) >= self.want:
            self.all_fired.set()

    def expire_all(self, keys: Sequence[int]) -> tuple[int, int]:
        """CPU time (all threads, time.process_time_ns) from the last state entry until
        every timer has fired; the arm must be built with a short timeout."""
        self.want = len(keys)
        for k in keys:
            self.observe(k, "Transferring")
        t0 = time.process_time_ns()
        self.all_fired.wait(timeout=60)
        dt = time.process_time_ns() - t0
        return dt, len(self.fired)

    def guard(self, poll: Callable[[Any], int]) -> Callable[[Any], int]:
        models, observe = self.models, self.observe

        def guarded(s: Any) -> int:
            result = poll(s)
            state = KVPOLL[result]
            model = models.get(s.room)
            if model is None or model.state != state:  # type: ignore[attr-defined]
                observe(s.room, state)
                model = models.get(s.room)
            return 0 if model is not None and model.failed else result

        return guarded

    def close(self) -> None:
        for model in self.models.values():
            model.to_Failed()  # type: ignore[attr-defined]  # exit() cancels the timer
            self.machine.remove_model(model)
        self.models.clear()


ARMS: tuple[Any, ...] = (StallguardArm, AsyncioArm, NaiveArm, TransitionsArm)


def wait_threads(baseline: int, timeout: float = 10.0) -> None:
    """Wait until cancelled timer threads have exited."""
    end = time.monotonic() + timeout
    while threading.active_count() > baseline and time.monotonic() < end:
        time.sleep(0.01)


# ---------------------------------------------------------------------- measurement

Sample = Callable[[int], tuple[int, int]]  # run up to b ops -> (elapsed ns, ops done)


class Stats:
    """Per-operation samples (ns) of one arm, one operation, one N."""

    def __init__(self, samples: Sequence[float], note: str = "") -> None:
        self.samples = list(samples)
        self.note = note

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def p90(self) -> float:
        if len(self.samples) < 2:
            return self.samples[0]
        return statistics.quantiles(self.samples, n=10, method="inclusive")[-1]


class Opts:
    def __init__(self, quick: bool) -> None:
        self.budget_s = 0.05 if quick else 0.6  # wall-clock budget per timed series
        self.max_batch = 200 if quick else 1000
        self.min_samples = 5 if quick else 15
        self.max_samples = 60 if quick else 400
        self.expiry_reps = 2 if quick else 7
        self.transitions_expiry_reps = 1 if quick else 3
        self.transitions_timeout = 0.3 if quick else 1.0


def measure(run: Sample, opts: Opts, between: Callable[[], None] | None = None) -> Stats:
    """Calibrate a batch size (about 1 ms a batch, at most opts.max_batch operations),
    then collect per-operation samples until the budget is spent."""
    gc.collect()
    dt, done = run(1)
    per_op = max(dt / max(done, 1), 1.0)
    batch = int(min(opts.max_batch, max(1, 1_000_000 / per_op)))
    samples: list[float] = []
    deadline = pc() + int(opts.budget_s * 1e9)
    while len(samples) < opts.max_samples and (len(samples) < opts.min_samples or pc() < deadline):
        if between is not None:
            between()
        dt, done = run(batch)
        samples.append(dt / done)
    return Stats(samples)


def observe_series(observe: Callable[[int, str], None], keys: list[int], same: bool) -> Sample:
    """Batches of observe() over consecutive keys. *same*: re-observe each key's current
    state; otherwise move every key to the other of two states on each round."""
    n = len(keys)
    pos = 0
    rnd = 0

    def run(b: int) -> tuple[int, int]:
        nonlocal pos, rnd
        b = min(b, n - pos)  # a batch never crosses a round boundary
        chunk = keys[pos : pos + b]
        state = "Bootstrapping" if same else ("WaitingForInput", "Transferring")[rnd % 2]
        t0 = pc()
        for k in chunk:
            observe(k, state)
        dt = pc() - t0
        pos += b
        if pos == n:
            pos, rnd = 0, rnd + 1
        return dt, b

    return run


def check_series(check: Callable[[], Any]) -> Sample:
    def run(b: int) -> tuple[int, int]:
        r = range(b)
        t0 = pc()
        for _ in r:
            check()
        return pc() - t0, b

    return run


class Sender:
    """Stands in for an SGLang KV sender: poll() returns its KVPoll value."""

    __slots__ = ("room",)

    def __init__(self, room: int) -> None:
        self.room = room

    def poll(self) -> int:
        return TRANSFERRING


def guard_series(guarded: Callable[[Any], int], senders: list[Sender], bare_out: list[float]):
    """Interleaved batches: the bare poll, then the guarded poll on the same senders;
    a sample is the difference per call. Bare per-call times go to *bare_out*."""
    bare = Sender.poll
    n = len(senders)
    pos = 0

    def run(b: int) -> tuple[int, int]:
        nonlocal pos
        b = min(b, n - pos)
        chunk = senders[pos : pos + b]
        t0 = pc()
        for s in chunk:
            bare(s)
        t1 = pc()
        for s in chunk:
            guarded(s)
        t2 = pc()
        pos = (pos + b) % n
        bare_out.append((t1 - t0) / b)
        return (t2 - t1) - (t1 - t0), b

    return run


def count_per_request() -> tuple[int, int]:
    """(live threads, timer handles + tasks + Thread objects) in this process."""
    timers = 0
    for obj in gc.get_objects():
        if isinstance(obj, (asyncio.Handle, asyncio.Future, threading.Thread)):
            timers += 1
    return threading.active_count(), timers


def memory_per_request(make: Callable[[], Any], keys: list[int]) -> float:
    """tracemalloc delta of tracking *keys* (in Bootstrapping), divided by their number."""
    arm = make()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for k in keys:
            arm.observe(k, "Bootstrapping")
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
        arm.close()
    return (after - before) / len(keys)


# --------------------------------------------------------------------------- the run


Results = dict[tuple[str, int, str], Stats]  # (operation, N, arm name) -> stats

OPS = (
    ("state change", "observe() of a new state"),
    ("same-state observe", "observe() of the current state"),
    ("check(), nothing due", "deadline check with N tracked, none due"),
    (
        "expiry, 100 per check",
        "N tracked, 100 of them due at each check, time per expired request (instrumentation "
        "hooks disabled, as in every expiry row)",
    ),
    ("expiry, one per check", "N tracked, one due at each check, time per check"),
    ("expiry, lifetime+stall", "100 per check, spec with a lifetime and a stall window"),
    (
        "expiry, all N at once",
        "one check that expires all N tracked, thread CPU time per expired request",
    ),
    ("guarded poll, added", "guard-wrapped poll minus the bare poll, state unchanged"),
    ("memory per request", "tracemalloc bytes per tracked request"),
    ("memory, lifetime+stall", "same, spec with lifetime and a stall window"),
    ("threads per request", "OS threads started per tracked request"),
    ("timers per request", "timer handles, tasks, Thread objects per request"),
)


def tracking(cls: Any, keys: list[int]) -> Any:
    """A fresh arm tracking *keys* in Bootstrapping."""
    arm = cls()
    for k in keys:
        arm.observe(k, "Bootstrapping")
    return arm


def timed_ops(cls: Any, n: int, keys: list[int], opts: Opts, results: Results) -> None:
    """Same-state observes, checks with nothing due, state changes; N keys tracked."""
    name = cls.name
    arm = tracking(cls, keys)
    between = getattr(arm, "idle", None)
    results["same-state observe", n, name] = measure(
        observe_series(arm.observe, keys, same=True), opts, between
    )
    if arm.check is not None:
        results["check(), nothing due", n, name] = measure(check_series(arm.check), opts)
    else:
        results["check(), nothing due", n, name] = Stats([math.nan], arm.check_note)
    # state changes last: they move the keys on
    results["state change", n, name] = measure(
        observe_series(arm.observe, keys, same=False), opts, between
    )
    arm.close()


def counts(cls: Any, n: int, keys: list[int], results: Results) -> None:
    """Threads and timer objects that tracking N keys creates, per key."""
    gc.collect()
    threads0, timers0 = count_per_request()
    arm = tracking(cls, keys)
    gc.collect()
    threads1, timers1 = count_per_request()
    arm.close()
    results["threads per request", n, cls.name] = Stats([(threads1 - threads0) / n])
    results["timers per request", n, cls.name] = Stats([(timers1 - timers0) / n])


def guarded_polls(cls: Any, n: int, keys: list[int], opts: Opts, results: Results) -> None:
    """A guarded poll whose state did not change, minus the bare poll."""
    arm = cls()
    senders = [Sender(k) for k in keys]
    guarded = arm.guard(Sender.poll)
    for s in senders:  # every sender tracked in Transferring, the state its poll returns
        arm.observe(s.room, KVPOLL[TRANSFERRING])
    for s in senders[:10]:
        guarded(s)  # warm up
    bare: list[float] = []
    stats = measure(guard_series(guarded, senders, bare), opts, getattr(arm, "idle", None))
    stats.note = f"bare poll {statistics.median(bare):.0f} ns"
    results["guarded poll, added", n, cls.name] = stats
    arm.close()


def stepped(cls: Any, clock: SetClock, spec: sg.Spec = SPEC) -> Any:
    """An arm of *cls* on a settable clock."""
    return StallguardArm(spec, clock=clock) if cls is StallguardArm else cls(clock=clock)


def expiry_chunks(
    make: Callable[[SetClock], Any], keys: list[int], opts: Opts, chunk: int
) -> Stats:
    """N tracked; each check finds *chunk* of them due (as many checks as leave 90% or
    more of the N tracked, at most 100); wall time per expired request."""
    n = len(keys)
    chunk = max(1, min(chunk, n // 10))
    checks = max(1, min(100, n // (10 * chunk)))
    samples: list[float] = []
    end = pc() + int(opts.budget_s * 1e9)
    while len(samples) < opts.min_samples or (pc() < end and len(samples) < opts.max_samples):
        clock = SetClock()
        arm = make(clock)
        for i, k in enumerate(keys):
            if i % chunk == 0:
                clock.now += 1.0  # chunk j enters at time j
            arm.observe(k, "Transferring")
        # no gc.collect() here: a full collection just before evicts the caches and
        # makes the first check ~25% slower than the ones a running poll loop sees
        for j in range(1, checks + 1):
            clock.now = now = j + LONG  # chunk j is due
            t0 = pc()
            done = arm.fire(now)
            dt = pc() - t0
            if done != chunk:
                raise RuntimeError(f"{arm.name}: expired {done}, expected {chunk}")
            samples.append(dt / done)
        arm.close()
    return Stats(samples)


def expiry_all_at_once(make: Callable[[SetClock], Any], keys: list[int], opts: Opts) -> Stats:
    """N tracked, all due at one check; thread CPU time per expired request (one such
    check lasts up to a few hundred ms, long enough to be preempted on a busy machine,
    which would inflate a wall-clock time)."""
    samples = []
    for _ in range(opts.expiry_reps):
        clock = SetClock()
        clock.now = 1.0
        arm = make(clock)
        for k in keys:
            arm.observe(k, "Transferring")
        clock.now = now = 1.0 + LONG
        gc.collect()
        t0 = time.thread_time_ns()
        done = arm.fire(now)
        dt = time.thread_time_ns() - t0
        arm.close()
        if done != len(keys):
            raise RuntimeError(f"{arm.name}: expired {done} of {len(keys)}")
        samples.append(dt / done)
    return Stats(samples)


def expiries(
    cls: Any, n: int, keys: list[int], opts: Opts, results: Results, threads0: int
) -> None:
    """Cost of expiring overdue requests, per request."""
    name = cls.name
    if cls is TransitionsArm:
        samples = []
        for _ in range(opts.transitions_expiry_reps):
            arm = TransitionsArm(timeout=opts.transitions_timeout)
            dt, done = arm.expire_all(keys)
            arm.close()
            wait_threads(threads0)
            if done != n:
                raise RuntimeError(f"{name}: {done} of {n} timers fired")
            samples.append(dt / n)
        note = (
            "each timer fires on its own thread; CPU time of the whole process "
            "(time.process_time_ns) from the last timer start until all N fired, per timer"
        )
        for op in ("expiry, 100 per check", "expiry, one per check", "expiry, all N at once"):
            results[op, n, name] = Stats(samples, note)
        return
    results["expiry, 100 per check", n, name] = expiry_chunks(
        lambda clock: stepped(cls, clock), keys, opts, 100
    )
    results["expiry, one per check", n, name] = expiry_chunks(
        lambda clock: stepped(cls, clock), keys, opts, 1
    )
    results["expiry, all N at once", n, name] = expiry_all_at_once(
        lambda clock: stepped(cls, clock), keys, opts
    )
    if cls is NaiveArm:
        for op in ("expiry, 100 per check", "expiry, one per check"):
            results[op, n, name].note = "every check scans all N requests to find the due ones"
        results["expiry, all N at once", n, name].note = (
            "builds a tuple per expired request, where stallguard builds an Expiry and "
            "asyncio calls a callback"
        )
    if cls is StallguardArm:
        results["expiry, lifetime+stall", n, name] = expiry_chunks(
            lambda clock: stepped(cls, clock, SPEC_LIFETIME_STALL), keys, opts, 100
        )


def run_size(n: int, opts: Opts, cap: int, results: Results, log: Callable[[str], None]) -> None:
    keys = make_keys(n)
    for cls in ARMS:
        if cls is TransitionsArm and n > cap:
            continue
        log(f"  N={n:>7,} {cls.name}")
        threads0 = threading.active_count()
        timed_ops(cls, n, keys, opts, results)
        wait_threads(threads0)
        counts(cls, n, keys, results)
        wait_threads(threads0)
        guarded_polls(cls, n, keys, opts, results)
        wait_threads(threads0)
        results["memory per request", n, cls.name] = Stats([memory_per_request(cls, keys)])
        wait_threads(threads0)
        if cls is StallguardArm:
            results["memory, lifetime+stall", n, cls.name] = Stats(
                [memory_per_request(lambda: StallguardArm(SPEC_LIFETIME_STALL), keys)]
            )
        expiries(cls, n, keys, opts, results, threads0)
        wait_threads(threads0)


# ------------------------------------------------------------ time-in-state statistics


def cpu_observe_series(observe: Callable[[int, str], None], keys: list[int]) -> Sample:
    """observe_series(same=False), timed in thread CPU time."""
    n = len(keys)
    pos = 0
    rnd = 0

    def run(b: int) -> tuple[int, int]:
        nonlocal pos, rnd
        b = min(b, n - pos)
        chunk = keys[pos : pos + b]
        state = ("WaitingForInput", "Transferring")[rnd % 2]
        t0 = time.thread_time_ns()
        for k in chunk:
            observe(k, state)
        dt = time.thread_time_ns() - t0
        pos += b
        if pos == n:
            pos, rnd = 0, rnd + 1
        return dt, b

    return run


def statistics_cost(n: int, opts: Opts) -> list[tuple[str, Stats, Stats, float]]:
    """The recording's cost (issue 15): the same operations on two watchdogs, one
    recording time-in-state statistics (the default) and one without (its recorder
    removed), in alternating batches timed in thread CPU time (time spent preempted on a
    busy machine is not counted). Returns (operation, without, with, paired ratio): the
    paired ratio is the median over rounds of on/off of the two batches run back to
    back."""
    rows = []
    keys = make_keys(n)
    on, off = sg.Watchdog(SPEC), sg.Watchdog(SPEC)
    off._stats = None  # the watchdog as it was before statistics
    for wd in (on, off):
        for k in keys:
            wd.observe(k, "Bootstrapping")
    changes = {wd: cpu_observe_series(wd.observe, keys) for wd in (on, off)}

    def lives(wd: sg.Watchdog[int]) -> Sample:
        serial = iter(range(10**12))

        def run(b: int) -> tuple[int, int]:
            fresh = [next(serial) + 10**9 for _ in range(b)]
            observe = wd.observe
            t0 = time.thread_time_ns()
            for k in fresh:
                observe(k, "Bootstrapping")
                observe(k, "Transferring")
                observe(k, "Success")
            return time.thread_time_ns() - t0, b

        return run

    for op, series in (
        ("state change (observe() of a new state)", changes),
        ("a request's life: 3 observes, 2 stays recorded", {wd: lives(wd) for wd in (on, off)}),
    ):
        samples: dict[Any, list[float]] = {on: [], off: []}
        pairs: list[float] = []
        gc.collect()
        deadline = pc() + int(2 * opts.budget_s * 1e9)
        batch = 200 if opts.budget_s < 0.1 else 1000
        while len(samples[on]) < opts.max_samples and (
            len(samples[on]) < opts.min_samples or pc() < deadline
        ):
            for wd in (off, on) if len(samples[on]) % 2 else (on, off):
                dt, done = series[wd](batch)
                samples[wd].append(dt / done)
            pairs.append(samples[on][-1] / samples[off][-1])
        rows.append((op, Stats(samples[off]), Stats(samples[on]), statistics.median(pairs)))
    return rows


# ------------------------------------------------------------------------ reporting


def fmt_time(ns: float) -> str:
    if math.isnan(ns):
        return "n/a"
    if abs(ns) >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if abs(ns) >= 1e3:
        return f"{ns / 1e3:.2f} µs"
    return f"{ns:.0f} ns"


def fmt_cell(op: str, stats: Stats) -> str:
    if op.startswith("memory"):
        return f"{stats.median:.0f} B"
    if op.startswith(("threads", "timers")):
        return f"{stats.median:.2f}"
    if math.isnan(stats.median):
        return "n/a"
    return f"{fmt_time(stats.median)} (p90 {fmt_time(stats.p90)})"


def ratio(op: str, alt: Stats, base: Stats) -> str:
    if op.startswith(("threads", "timers")):
        return ""
    if math.isnan(alt.median) or math.isnan(base.median) or base.median <= 0:
        return ""
    return f" · {alt.median / base.median:.1f}x"


def table(results: Results, sizes: Sequence[int], cap: int) -> str:
    names = [cls.name for cls in ARMS]
    lines = [
        "| operation | N | " + " | ".join(names) + " |",
        "|---|---:|" + "---|" * len(names),
    ]
    notes: dict[str, None] = {}
    for op, _ in OPS:
        for n in sizes:
            base = results.get((op, n, "stallguard"))
            if base is None:
                continue
            cells = []
            for name in names:
                stats = results.get((op, n, name))
                if stats is None:
                    if name.startswith("transitions") and n > cap:
                        cells.append(f"not run (N > {cap:,})")
                    else:
                        cells.append("—")
                    continue
                cell = fmt_cell(op, stats)
                if name != "stallguard":
                    cell += ratio(op, stats, base)
                if stats.note and not stats.note.startswith("bare"):
                    notes[f"{name}, {op}: {stats.note}."] = None
                cells.append(cell)
            lines.append(f"| {op} | {n:,} | " + " | ".join(cells) + " |")
    bares = ", ".join(
        results[op_n_arm].note.removeprefix("bare poll ")
        for op_n_arm in [("guarded poll, added", n, "stallguard") for n in sizes]
        if op_n_arm in results
    )
    legend = [
        "Times are the median (p90) per operation; `· kx` is the alternative's median "
        "divided by stallguard's (above 1: slower than stallguard).",
        *(f"{op}: {what}." for op, what in OPS),
        f"The bare poll itself took {bares} (per N, stallguard runs).",
        *notes,
    ]
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {line}" for line in legend)


def targets(results: Results, sizes: Sequence[int]) -> list[tuple[str, str, bool]]:
    """(target, stallguard's value at each N, met at every N)."""

    def per_n(op: str) -> list[float]:
        return [results[op, n, "stallguard"].median for n in sizes]

    def times(values: list[float]) -> str:
        return " / ".join(fmt_time(v) for v in values)

    out = []
    for what, op, limit in (
        ("state change ≤ 1 µs", "state change", 1000),
        ("check(), nothing due ≤ 1 µs", "check(), nothing due", 1000),
        ("≤ 2 µs per expiry, hooks excluded: 100 per check", "expiry, 100 per check", 2000),
        ("≤ 2 µs per expiry: one per check", "expiry, one per check", 2000),
        ("≤ 2 µs per expiry: lifetime+stall spec", "expiry, lifetime+stall", 2000),
        ("≤ 2 µs per expiry: all N in one check()", "expiry, all N at once", 2000),
        ("guarded poll, state unchanged: ≤ 0.5 µs added", "guarded poll, added", 500),
    ):
        values = per_n(op)
        out.append((what, times(values), max(values) <= limit))
    check = per_n("check(), nothing due")
    flat = check[-1] / check[0]
    out.append(
        (
            f"check() flat in N: median at N={sizes[-1]:,} ≤ 1.5 x median at N={sizes[0]:,}",
            f"{flat:.2f}x",
            flat <= 1.5,
        )
    )
    for what, op in (
        ("≤ 300 B per tracked request", "memory per request"),
        ("≤ 300 B per tracked request, lifetime+stall spec", "memory, lifetime+stall"),
    ):
        values = per_n(op)
        out.append((what, " / ".join(f"{v:.0f} B" for v in values), max(values) <= 300))
    threads, timers = per_n("threads per request"), per_n("timers per request")
    out.append(
        (
            "no thread, task or timer per request",
            f"{max(threads):.2f} threads, {max(timers):.2f} timers/tasks",
            max(threads) == 0 and max(timers) == 0,
        )
    )
    return out


def environment() -> str:
    load = os.getloadavg()
    return (
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}\n"
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs (nproc), "
        f"{platform.system()} {platform.release()}\n"
        f"- python: {platform.python_implementation()} {platform.python_version()}\n"
        f"- stallguard checkout {Path(sg.__file__).parent}, transitions {transitions.__version__}\n"
        f"- load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )


def print_statistics_cost(sizes: Sequence[int], opts: Opts) -> None:
    print("## Time-in-state statistics: recording on vs off (alternating batches)")
    print()
    print("| operation | N | statistics off | statistics on | on / off | paired |")
    print("|---|---:|---|---|---:|---:|")
    for n in sizes:
        for op, off, on, paired in statistics_cost(n, opts):
            print(
                f"| {op} | {n:,} | {fmt_cell(op, off)} | {fmt_cell(op, on)} | "
                f"{on.median / off.median:.2f}x | {paired:.2f}x |"
            )
    print()
    print(
        "Thread CPU time per operation, median (p90) over alternating batches of ~1,000 "
        "operations; paired: the median over rounds of on/off for batches run back to back."
    )
    print()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Benchmark stallguard's core watchdog side by side with asyncio "
        "call_at timers, a naive scan and transitions' Timeout states."
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes and budgets; finishes in seconds (a smoke test, not a measurement)",
    )
    parser.add_argument(
        "--sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="comma-separated numbers of tracked requests (default 1000,10000,100000; "
        "--quick: 100,1000)",
    )
    parser.add_argument(
        "--transitions-cap",
        type=int,
        default=None,
        help="largest N for the transitions arm, which starts one OS thread per tracked "
        "request (default 1000; --quick: 100)",
    )
    parser.add_argument(
        "--statistics-only",
        action="store_true",
        help="only the time-in-state statistics A/B (recording on vs off, alternating)",
    )
    args = parser.parse_args(argv)
    sizes = sorted(args.sizes or ([100, 1000] if args.quick else [1000, 10_000, 100_000]))
    if not sizes or sizes[0] < 1:
        parser.error(f"--sizes must be positive ints, got {sizes!r}")
    cap = (
        args.transitions_cap if args.transitions_cap is not None else (100 if args.quick else 1000)
    )
    if cap > 2000:
        parser.error(f"--transitions-cap {cap} would start {cap} OS threads at once; at most 2000")
    opts = Opts(args.quick)

    set_on_expire_hooks([])  # instrumentation hooks disabled: expiry cost is stallguard's own

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    print(
        "# stallguard core benchmark"
        + (" (--quick: smoke test, not a measurement)" if args.quick else "")
    )
    print()
    print(environment())
    print(
        f"- sizes: {', '.join(f'{n:,}' for n in sizes)}; transitions' Timeout arm capped at "
        f"N = {cap:,} (it starts one OS thread per tracked request; 10^5 threads are not run)"
    )
    print()
    started = time.monotonic()
    print_statistics_cost(sizes, opts)
    if args.statistics_only:
        return 0
    results: Results = {}
    for n in sizes:
        run_size(n, opts, cap, results, log)
    print(table(results, sizes, cap))
    print()
    print(f"## Targets (stallguard; values at N = {' / '.join(f'{n:,}' for n in sizes)})")
    print()
    print("| target | measured | result |")
    print("|---|---|---|")
    for what, measured, ok in targets(results, sizes):
        print(f"| {what} | {measured} | {'PASS' if ok else 'MISS'} |")
    print()
    load = os.getloadavg()
    print(
        f"- load average at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
        f"run took {time.monotonic() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
