"""Thread safety: state changes from many threads while one thread runs check()."""

from __future__ import annotations

import collections
import threading
import time

import stallguard as sg
from stallguard.instrumentation import set_on_expire_hooks
from stallguard.testing import FakeClock

# Healthy requests flow a -> b -> c -> ok/err (or are forgotten) with deadlines far
# longer than the fake clock can advance during the run, so none of them may expire.
# Doomed requests park in "d", whose 10 ms deadline passes many times during the run,
# so they expire while the writers are still busy.
SPEC = sg.Spec(
    "threads",
    {"a": 10_000, "b": 10_000, "c": sg.Deadline(10_000, stall=5_000), "d": 0.01},
    terminal=["ok", "err"],
)
THREADS = 8
TRANSITIONS_PER_THREAD = 50_000


def test_many_writers_one_checker_lose_nothing_and_expire_exactly_once():
    set_on_expire_hooks([])
    clock = FakeClock()
    wd = sg.Watchdog(SPEC, clock=clock, memory=10**6)
    expiries: list = []
    stop = threading.Event()
    start = threading.Barrier(THREADS + 1)
    doomed: dict[int, list[int]] = {}
    healthy: dict[int, list[int]] = {}
    checks = [0]

    def writer(t: int) -> None:
        start.wait()
        mine_doomed = doomed[t] = []
        mine_healthy = healthy[t] = []
        key = t * 10**7
        transitions = 0
        while transitions < TRANSITIONS_PER_THREAD:
            key += 1
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

    def checker() -> None:
        start.wait()
        while not stop.is_set():
            clock.advance(0.000_01)
            expiries.extend(wd.check())
            checks[0] += 1
            # A yield, not a wait: a checker that never releases the GIL starves the
            # writers that hold the watchdog's lock (a convoy that made this test take
            # minutes on some runs, with the old engine as with the new one).
            time.sleep(0)

    # daemons: a failing run must not keep the test process alive
    threads = [threading.Thread(target=writer, args=(t,), daemon=True) for t in range(THREADS)]
    check_thread = threading.Thread(target=checker, daemon=True)
    for th in [*threads, check_thread]:
        th.start()
    for th in threads:
        th.join(timeout=120)
        assert not th.is_alive()
    stop.set()
    check_thread.join(timeout=60)
    assert clock() < 5_000, "the run outlasted the healthy deadlines; the test is invalid"
    during_run = len(expiries)
    clock.advance(2)
    expiries.extend(wd.check())

    all_doomed = {k for keys in doomed.values() for k in keys}
    all_healthy = {k for keys in healthy.values() for k in keys}
    counts = collections.Counter(e.key for e in expiries)
    assert max(counts.values()) == 1, "a key expired twice"
    assert set(counts) == all_doomed  # every doomed key, and no healthy one
    assert during_run > 0, "no expiry happened concurrently with the writers"
    assert len(all_doomed) + len(all_healthy) > THREADS * TRANSITIONS_PER_THREAD // 5
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
        th.join(timeout=60)
    assert len(wd) == 0
    assert wd.snapshot().late_events == len(late)
    assert wd.snapshot().expired == len(all_doomed)
