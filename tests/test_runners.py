"""The background runners: anyio (asyncio and trio) and the plain thread.

No test waits on the wall clock for a deadline. Each runner computes its waits on the
watchdog's clock (a FakeClock here) and is handed a scripted ``wait`` in place of the
real-time one: it records every wait, and either advances the FakeClock by the timeout
(time passes while the runner sleeps) or blocks until the runner is woken (time stands
still, so only a wake-up can move the runner on). Wake-ups are checked by the order of
events, never by timing. The ``fail_after`` / ``Queue.get`` timeouts below are only
safety nets against a hang.
"""

from __future__ import annotations

import queue
import threading
from functools import partial

import anyio
import pytest

import stallguard as sg
from stallguard.testing import FakeClock, record_expiries

SPEC = sg.Spec(
    name="kv_sender",
    deadlines={"Bootstrapping": 300, "Transferring": 120, "Queued": None},
    terminal=["Success", "Failed"],
)
SAFETY = 10  # seconds: only guards against a hang


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


class ScriptedWait:
    """Stands in for the runner's real-time wait (``anyio.move_on_after`` on an event).

    advance=True: the FakeClock moves by the timeout, as if the runner slept that long.
    advance=False: time stands still; the wait returns only when the runner is woken.
    """

    def __init__(self, clock: FakeClock, *, advance: bool) -> None:
        self.clock = clock
        self.advance = advance
        self.calls: list[float | None] = []
        self._changed = anyio.Event()

    async def __call__(self, wake: anyio.Event, timeout: float | None) -> None:
        self.calls.append(timeout)
        self._changed.set()
        self._changed = anyio.Event()
        if self.advance and timeout is not None:
            self.clock.advance(timeout)
            await anyio.lowlevel.checkpoint()
            return
        await wake.wait()

    async def until(self, count: int) -> list[float | None]:
        """Wait (event-driven) until the runner has started *count* waits."""
        with anyio.fail_after(SAFETY):
            while len(self.calls) < count:
                await self._changed.wait()
        return self.calls


@pytest.mark.anyio
async def test_expires_each_deadline_in_order_on_the_watchdog_clock() -> None:
    clock = FakeClock(1000)
    failed: list[tuple[object, float]] = []
    wd = sg.Watchdog(SPEC, clock=clock, on_expire=lambda e: failed.append((e.key, clock())))
    wd.observe("slow", "Bootstrapping")  # due at 1300
    wd.observe("fast", "Transferring")  # due at 1120
    wd.observe("idle", "Queued")  # no deadline
    wait = ScriptedWait(clock, advance=True)
    with record_expiries() as seen:
        async with anyio.create_task_group() as tg:
            await tg.start(partial(sg.run_watchdog, wd, wait=wait))
            calls = await wait.until(3)
            tg.cancel_scope.cancel()
    # slept 120 to the first deadline, 180 more to the second, then indefinitely
    assert calls == [120.0, 180.0, None]
    assert failed == [("fast", 1120.0), ("slow", 1300.0)]
    assert [(e.key, e.state, e.elapsed) for e in seen] == [
        ("fast", "Transferring", 120.0),
        ("slow", "Bootstrapping", 300.0),
    ]
    assert [r.key for r in wd.snapshot().requests] == ["idle"]


@pytest.mark.anyio
async def test_an_earlier_deadline_wakes_the_runner_a_later_one_does_not() -> None:
    clock = FakeClock()
    wd = sg.Watchdog(SPEC, clock=clock)
    wait = ScriptedWait(clock, advance=False)
    async with anyio.create_task_group() as tg:
        await tg.start(partial(sg.run_watchdog, wd, wait=wait))
        assert await wait.until(1) == [None]  # nothing tracked: sleeps until woken
        wd.observe("a", "Bootstrapping")  # first deadline at 300: wakes it
        assert await wait.until(2) == [None, 300.0]
        clock.advance(100)
        wd.observe("b", "Transferring")  # due at 220 < 300: wakes it
        assert await wait.until(3) == [None, 300.0, 120.0]
        wd.observe("c", "Bootstrapping")  # due at 400 > 220: no reason to wake
        wd.observe("d", "Queued")  # no deadline at all
        await anyio.wait_all_tasks_blocked()
        assert wait.calls == [None, 300.0, 120.0]
        tg.cancel_scope.cancel()
    assert wd.check() == []  # the clock never moved past a deadline


@pytest.mark.anyio
async def test_a_foreign_thread_wakes_the_runner() -> None:
    clock = FakeClock()
    wd = sg.Watchdog(SPEC, clock=clock)
    wait = ScriptedWait(clock, advance=False)
    async with anyio.create_task_group() as tg:
        await tg.start(partial(sg.run_watchdog, wd, wait=wait))
        await wait.until(1)
        # observe() from worker threads: the waker must post to the loop, never block
        await anyio.to_thread.run_sync(wd.observe, "r1", "Bootstrapping")
        assert await wait.until(2) == [None, 300.0]
        clock.advance(100)
        await anyio.to_thread.run_sync(wd.observe, "r2", "Transferring")  # due 220 < 300
        assert await wait.until(3) == [None, 300.0, 120.0]
        tg.cancel_scope.cancel()
    assert wd.check() == []


@pytest.mark.anyio
async def test_the_default_wait_is_woken_by_an_earlier_deadline() -> None:
    # The real-time wait (anyio.move_on_after), driven only by wake-ups: the runner is
    # asleep for r1's 300 s when r2 brings a deadline 180 s earlier; it must wake and
    # recompute at once. Counted through next_deadline(), which it calls once per round.
    clock = FakeClock()
    wd = sg.Watchdog(SPEC, clock=clock)
    rounds: list[float | None] = []
    next_round = anyio.Event()
    real_next_deadline = wd.next_deadline

    def counting_next_deadline() -> float | None:
        nonlocal next_round
        rounds.append(real_next_deadline())
        next_round.set()
        next_round = anyio.Event()
        return rounds[-1]

    wd.next_deadline = counting_next_deadline  # type: ignore[method-assign]
    wd.observe("r1", "Bootstrapping")
    async with anyio.create_task_group() as tg:
        await tg.start(sg.run_watchdog, wd)
        await anyio.wait_all_tasks_blocked()
        assert rounds == [300.0]
        wd.observe("r2", "Transferring")
        with anyio.fail_after(SAFETY):
            while len(rounds) < 2:
                await next_round.wait()
        assert rounds == [300.0, 120.0]
        tg.cancel_scope.cancel()
    assert not wd.listeners


@pytest.mark.anyio
async def test_cancellation_stops_cleanly_and_releases_the_watchdog() -> None:
    clock = FakeClock()
    wd = sg.Watchdog(SPEC, clock=clock)
    wait = ScriptedWait(clock, advance=False)
    wd.observe("r1", "Bootstrapping")
    async with anyio.create_task_group() as tg:
        await tg.start(partial(sg.run_watchdog, wd, wait=wait))
        assert wd.listeners
        await wait.until(1)
        tg.cancel_scope.cancel()
    assert not wd.listeners
    wd.observe("r2", "Transferring")  # no runner to wake: must not fail
    # and a new runner can take over
    wait2 = ScriptedWait(clock, advance=True)
    async with anyio.create_task_group() as tg:
        await tg.start(partial(sg.run_watchdog, wd, wait=wait2))
        assert await wait2.until(3) == [120.0, 180.0, None]
        tg.cancel_scope.cancel()
    assert wd.expired("r1") and wd.expired("r2")


@pytest.mark.anyio
async def test_watching_runs_the_watchdog_for_the_block() -> None:
    clock = FakeClock()
    wd = sg.Watchdog(SPEC, clock=clock)
    wait = ScriptedWait(clock, advance=True)
    async with sg.watching(wd, wait=wait) as running:
        assert running is wd
        await wait.until(1)
        wd.observe("r1", "Transferring")
        await wait.until(3)
        assert wd.expired("r1")
    assert not wd.listeners


@pytest.mark.anyio
async def test_two_runners_share_a_watchdog_and_expire_once() -> None:
    """Runners are listeners: a second one does not take the first one's slot, and
    each request still expires exactly once."""
    clock = FakeClock()
    wd = sg.Watchdog(SPEC, clock=clock)
    seen: list[object] = []
    wd.add_listener(on_expire=lambda e: seen.append(e.key))
    wd.observe("r1", "Transferring")
    async with sg.watching(wd, wait=ScriptedWait(clock, advance=False)):
        assert len(wd.listeners) == 2
        async with sg.watching(wd, wait=ScriptedWait(clock, advance=False)):
            assert len(wd.listeners) == 3
            clock.advance(120)
            wd.check()
            wd.check()
        assert len(wd.listeners) == 2
    assert len(wd.listeners) == 1
    assert seen == ["r1"]
    with pytest.raises(sg.ConfigError, match="watchdog must be a stallguard.Watchdog"):
        await sg.run_watchdog(SPEC)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_raising_check_ends_the_runner_with_the_error() -> None:
    clock = FakeClock()
    wd = sg.Watchdog(SPEC, clock=clock)
    wd.observe("r1", "Transferring")

    def broken(now: float | None = None) -> list[sg.Expiry[object]]:
        raise RuntimeError("bug in check")

    wd.check = broken  # type: ignore[method-assign]
    with pytest.raises(ExceptionGroup) as caught:  # noqa: F821 - builtin on 3.11
        async with sg.watching(wd, wait=ScriptedWait(clock, advance=True)):
            await anyio.sleep_forever()
    assert caught.group_contains(RuntimeError, match="bug in check")
    assert not wd.listeners


# --------------------------------------------------------------------------- thread


class ThreadScriptedWait:
    """Stands in for the thread runner's real-time wait (``threading.Event.wait``);
    same two modes as :class:`ScriptedWait`."""

    def __init__(self, clock: FakeClock, *, advance: bool) -> None:
        self.clock = clock
        self.advance = advance
        self.calls: queue.Queue[float | None] = queue.Queue()

    def __call__(self, wake: threading.Event, timeout: float | None) -> None:
        self.calls.put(timeout)
        if self.advance and timeout is not None:
            self.clock.advance(timeout)
            return
        wake.wait()

    def next(self) -> float | None:
        return self.calls.get(timeout=SAFETY)


def ended(runner: sg.WatchdogThread) -> None:
    """Wait (safety-bounded) until *runner*'s thread has ended by itself."""
    run = runner._run
    assert run is not None
    run.thread.join(SAFETY)
    assert not run.thread.is_alive()


def test_thread_expires_in_order_and_stops_cleanly() -> None:
    clock = FakeClock()
    failed: list[tuple[object, float, str]] = []
    wd = sg.Watchdog(
        SPEC,
        clock=clock,
        on_expire=lambda e: failed.append((e.key, clock(), threading.current_thread().name)),
    )
    wd.observe("slow", "Bootstrapping")
    wd.observe("fast", "Transferring")
    wait = ThreadScriptedWait(clock, advance=True)
    runner = sg.WatchdogThread(wd, wait=wait, name="sg-test")
    with runner:
        assert [wait.next(), wait.next(), wait.next()] == [120.0, 180.0, None]
        assert runner.is_alive()
    assert not runner.is_alive()
    assert not wd.listeners
    assert failed == [("fast", 120.0, "sg-test"), ("slow", 300.0, "sg-test")]
    runner.stop()  # idempotent


def test_thread_is_woken_early_by_any_thread() -> None:
    clock = FakeClock()
    wd = sg.Watchdog(SPEC, clock=clock)
    wait = ThreadScriptedWait(clock, advance=False)
    runner = sg.WatchdogThread(wd, wait=wait).start()
    try:
        assert wait.next() is None
        wd.observe("a", "Bootstrapping")
        assert wait.next() == 300.0
        worker = threading.Thread(target=wd.observe, args=("b", "Transferring"))
        worker.start()
        worker.join()
        assert wait.next() == 120.0
        wd.observe("c", "Bootstrapping")  # later deadline: no wake-up
        assert wait.calls.empty()
    finally:
        runner.stop(timeout=SAFETY)
    assert not runner.is_alive() and not wd.listeners
    # stopping woke it once more; it did not check anything in between that could expire
    assert wd.check() == [] and len(wd) == 3


def test_thread_runners_share_a_watchdog_and_one_start() -> None:
    clock = FakeClock()
    wd = sg.Watchdog(SPEC, clock=clock)
    with sg.WatchdogThread(wd, wait=ThreadScriptedWait(clock, advance=False)) as runner:
        with sg.WatchdogThread(wd, wait=ThreadScriptedWait(clock, advance=False)):
            assert len(wd.listeners) == 2  # a second runner listens beside the first
        assert len(wd.listeners) == 1
        with pytest.raises(RuntimeError, match="is already running"):
            runner.start()
    with pytest.raises(sg.ConfigError, match="wait must be a callable"):
        sg.WatchdogThread(wd, wait=42)  # type: ignore[arg-type]


def test_thread_stop_raises_what_ended_it() -> None:
    clock = FakeClock()
    wd = sg.Watchdog(SPEC, clock=clock)
    calls = []

    def broken(now: float | None = None) -> list[sg.Expiry[object]]:
        calls.append(now)
        raise RuntimeError("bug in check")

    wd.check = broken  # type: ignore[method-assign]
    runner = sg.WatchdogThread(wd, wait=ThreadScriptedWait(clock, advance=False)).start()
    ended(runner)
    assert not runner.is_alive() and calls == [None]
    with pytest.raises(RuntimeError, match="bug in check"):
        runner.stop()
    runner.stop()  # reported once


def test_thread_stop_times_out_on_a_blocking_hook() -> None:
    clock = FakeClock()
    entered, release = threading.Event(), threading.Event()

    def blocking_hook(expiry: sg.Expiry[object]) -> None:
        entered.set()
        release.wait(SAFETY)

    wd = sg.Watchdog(SPEC, clock=clock, on_expire=blocking_hook)
    wd.observe("r1", "Transferring")
    runner = sg.WatchdogThread(wd, wait=ThreadScriptedWait(clock, advance=True)).start()
    assert entered.wait(SAFETY)
    with pytest.raises(TimeoutError, match="did not stop within 0s"):
        runner.stop(timeout=0)
    release.set()
    runner.stop(timeout=SAFETY)
    assert not runner.is_alive()
