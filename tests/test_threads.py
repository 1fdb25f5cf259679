"""Thread safety: state changes from many threads while one thread runs check().

Robust on a loaded machine (it failed at load 10-15 on 2 cores, when the checker was
starved and expired nothing while the writers ran): the work is bounded, the writers
wait (event-driven) half-way through until the checker has expired something, and no
assertion depends on how fast anything runs. Real time only bounds a hang (``SAFETY``)
and paces the checker (which also bounds how far it moves the fake clock: far less
than the healthy deadlines, whatever the load).

Meaningful on the compiled core too (tests/test_compiled.py; a state change there takes
a third of the time and, being native code, is never interrupted by a thread switch but
where it calls Python, e.g. the FakeClock under the lock): the interpreter switches
threads every 0.1 ms instead of every 5 ms during the run, and the test checks that the
writers really ran interleaved (their progress marks alternate many times), not one
after another.
"""

from __future__ import annotations

import collections
import itertools
import sys
import threading

import pytest

import stallguard as sg
from stallguard.instrumentation import set_on_expire_hooks
from stallguard.testing import FakeClock

# Healthy requests flow a -> b -> c -> ok/err (or are forgotten) with deadlines the fake
# clock cannot reach during the run, so none of them may expire. Doomed requests park in
# "d", whose 10 ms deadline the checker passes after 10 rounds, so they expire while the
# writers are still busy.
HEALTHY = 1e6
SPEC = sg.Spec(
    "threads",
    {"a": HEALTHY, "b": HEALTHY, "c": sg.Deadline(HEALTHY, stall=HEALTHY / 2), "d": 0.01},
    terminal=["ok", "err"],
)
THREADS = 8
TRANSITIONS_PER_THREAD = 20_000
STEP = 0.001  # fake seconds per checker round
PACE = 0.0002  # real seconds the checker pauses per round: at most 5 fake s per real s
SAFETY = 300  # real seconds: only guards against a hang
SWITCH = 1e-4  # real seconds between the interpreter's thread switches during the run
MARK = 100  # a writer notes its progress every MARK transitions


@pytest.fixture(autouse=True)
def _switch_often():
    before = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH)
    yield
    sys.setswitchinterval(before)


def test_many_writers_one_checker_lose_nothing_and_expire_exactly_once():
    set_on_expire_hooks([])
    clock = FakeClock()
    wd = sg.Watchdog(SPEC, clock=clock, memory=10**6)
    first_expiry = threading.Event()
    wd.add_listener(on_expire=lambda e: first_expiry.set())
    expiries: list = []
    writers_done = threading.Event()
    start = threading.Barrier(THREADS + 1, timeout=SAFETY)
    doomed: dict[int, list[int]] = {}
    healthy: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    still_writing: list[int] = []  # writers that saw an expiry with work left to do
    marks: list[int] = []  # writer ids, one per MARK transitions, in the order made

    def writer(t: int) -> None:
        try:
            start.wait()
            mine_doomed = doomed[t] = []
            mine_healthy = healthy[t] = []
            key = t * 10**7
            transitions = 0
            waited = False
            while transitions < TRANSITIONS_PER_THREAD:
                if not waited and transitions >= TRANSITIONS_PER_THREAD // 2:
                    # Half-way: wait for the checker's first expiry, so that expiries
                    # provably happen while every writer still has work to do.
                    waited = True
                    assert first_expiry.wait(SAFETY), "the checker never expired anything"
                    assert wd.snapshot(requests=False).expired > 0
                    still_writing.append(t)
                key += 1
                if key % MARK == 0:
                    marks.append(t)
                if key % 10 == 0:
                    wd.observe(key, "d")
                    mine_doomed.append(key)
                    transitions += 1
                    continue
                wd.observe(key, "a")
                wd.observe(key, "b")
                wd.observe(key, "b")  # same state: no reset, no-op
                wd.observe(key, "c")
                wd.heartbeat(key)
                if key % 7 == 0:
                    wd.forget(key)
                else:
                    wd.observe(key, "ok" if key % 2 else "err")
                mine_healthy.append(key)
                transitions += 5
        except BaseException as exc:
            errors.append(exc)
            first_expiry.set()  # (let the others go: the test fails below)

    def checker() -> None:
        try:
            start.wait()
            while not writers_done.is_set():
                clock.advance(STEP)  # time moves while the writers read the clock
                expiries.extend(wd.check())
                writers_done.wait(PACE)  # releases the GIL to the writers
        except BaseException as exc:
            errors.append(exc)

    # daemons: a failing run must not keep the test process alive
    threads = [threading.Thread(target=writer, args=(t,), daemon=True) for t in range(THREADS)]
    check_thread = threading.Thread(target=checker, daemon=True)
    for th in [*threads, check_thread]:
        th.start()
    for th in threads:
        th.join(SAFETY)
        assert not th.is_alive(), "a writer hung"
    writers_done.set()
    check_thread.join(SAFETY)
    assert not check_thread.is_alive(), "the checker hung"
    assert not errors, errors
    assert sorted(still_writing) == list(range(THREADS))
    # the writers ran interleaved: their marks alternate (one after another: THREADS - 1)
    switches = sum(a != b for a, b in itertools.pairwise(marks))
    assert switches >= 4 * THREADS, (switches, len(marks))
    assert clock() < HEALTHY / 2, "the run outlasted the healthy deadlines; the test is invalid"
    # the FIFOs stayed in time order while the clock moved under the writers' reads
    assert wd._in_time_order()
    clock.advance(2)
    expiries.extend(wd.check())
    assert wd._overdue(clock()) == []

    all_doomed = {k for keys in doomed.values() for k in keys}
    all_healthy = {k for keys in healthy.values() for k in keys}
    counts = collections.Counter(e.key for e in expiries)
    assert max(counts.values()) == 1, "a key expired twice"
    assert set(counts) == all_doomed  # every doomed key, and no healthy one
    assert len(all_doomed) + len(all_healthy) > THREADS * TRANSITIONS_PER_THREAD // 6
    # nothing is left behind
    assert len(wd) == 0 and wd.next_deadline() is None
    footprint = wd._footprint()
    del footprint["remembered"], footprint["entries"]  # tombstones; stale FIFO entries
    assert set(footprint.values()) == {0}, footprint
    # late events for expired keys, from many threads, re-arm nothing
    late = sorted(all_doomed)

    def late_writer(chunk: list[int]) -> None:
        for k in chunk:
            wd.observe(k, "a")
            wd.heartbeat(k)

    late_threads = [threading.Thread(target=late_writer, args=(late[i::4],)) for i in range(4)]
    for th in late_threads:
        th.start()
    for th in late_threads:
        th.join(SAFETY)
        assert not th.is_alive()
    assert len(wd) == 0
    assert wd.snapshot().late_events == len(late)
    assert wd.snapshot().expired == len(all_doomed)
