"""Runners never die silently, never ask the platform for a wait it refuses, and a thread
runner can be stopped and started again (issue 10, points 2 and 5).

As in tests/test_runners.py, no test waits on the wall clock for a deadline: the
watchdogs run on a FakeClock, and the only real waits are ones that a wake-up or
``stop()`` ends (``SAFETY`` only bounds a hang).
"""

from __future__ import annotations

import logging
import queue
import threading

import anyio
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import stallguard as sg
from stallguard import instrumentation as si
from stallguard._runners import ASYNC_WAIT_MAX, THREAD_WAIT_MAX
from stallguard.testing import FakeClock

SAFETY = 10  # seconds: only guards against a hang
HUGE = 1e10  # a valid deadline above threading.TIMEOUT_MAX (~9.2e9 s on Linux)
SPEC = sg.Spec(
    name="runner_edges",
    deadlines={"Forever": HUGE, "Transferring": 120, "Queued": None},
    terminal=["Success"],
)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def reader():
    """Metrics on (an in-memory SDK reader); the runner error counter is read from it."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    si.enable_metrics(provider, state_durations=False)
    yield reader
    si.disable_metrics()
    provider.shutdown()


def runner_errors(reader: InMemoryMetricReader) -> dict[str, int]:
    """spec -> value of the stallguard.runner.errors counter."""
    found: dict[str, int] = {}
    data = reader.get_metrics_data()
    for resource_metrics in data.resource_metrics if data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name == si.METRIC_RUNNER_ERRORS:
                    for point in metric.data.data_points:
                        found[point.attributes["stallguard.spec"]] = point.value
    return found


def ended(runner: sg.WatchdogThread) -> None:
    run = runner._run
    assert run is not None
    run.thread.join(SAFETY)
    assert not run.thread.is_alive()


class RealWait:
    """The thread runner's real wait (``Event.wait(timeout)``), recording each timeout:
    a timeout the platform refuses raises here exactly as in the default wait."""

    def __init__(self) -> None:
        self.calls: queue.Queue[float | None] = queue.Queue()

    def __call__(self, wake: threading.Event, timeout: float | None) -> None:
        self.calls.put(timeout)
        wake.wait(timeout)

    def next(self) -> float | None:
        return self.calls.get(timeout=SAFETY)


# --------------------------------------------------------------------------- point 2


def test_thread_survives_a_deadline_beyond_the_platform_wait_limit() -> None:
    assert HUGE > threading.TIMEOUT_MAX  # the premise of the test
    clock = FakeClock()
    wd = sg.Watchdog(SPEC, clock=clock)
    wd.observe("long", "Forever")
    wait = RealWait()
    runner = sg.WatchdogThread(wd, wait=wait).start()
    try:
        assert wait.next() == THREAD_WAIT_MAX <= threading.TIMEOUT_MAX
        assert runner.is_alive() and runner.failure is None
        wd.observe("short", "Transferring")  # an earlier deadline still wakes it
        assert wait.next() == 120.0
        assert runner.is_alive()
    finally:
        runner.stop(timeout=SAFETY)  # raises whatever ended the thread: nothing did
    assert wd.snapshot().runner_errors == 0


def test_thread_failure_is_visible_at_once_without_stop(caplog, reader) -> None:
    clock = FakeClock()
    wd = sg.Watchdog(SPEC, clock=clock)
    boom = RuntimeError("wait broke")

    def broken_wait(wake: threading.Event, timeout: float | None) -> None:
        raise boom

    runner = sg.WatchdogThread(wd, wait=broken_wait, name="sg-broken")
    with caplog.at_level(logging.ERROR, logger="stallguard"):
        runner.start()
        ended(runner)
    # visible without calling stop(): the property, the snapshot, the log, the metric
    assert runner.failure is boom and not runner.is_alive()
    assert "failed (RuntimeError)" in repr(runner)
    assert wd.snapshot().runner_errors == 1
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "sg-broken" in errors[0].getMessage()
    assert errors[0].exc_info is not None and errors[0].exc_info[1] is boom
    assert runner_errors(reader) == {"runner_edges": 1}
    assert not wd.listeners  # the runner let go of the watchdog
    with pytest.raises(RuntimeError, match="wait broke"):
        runner.stop()
    runner.stop()  # raised once
    assert runner.failure is boom  # still there until the next start()


def test_thread_survives_nothing_silently_not_even_system_exit(caplog) -> None:
    # threading swallows SystemExit without a word: the runner must not.
    clock = FakeClock()

    def on_expire(expiry: sg.Expiry[object]) -> None:
        raise SystemExit(3)

    wd = sg.Watchdog(SPEC, clock=clock, on_expire=on_expire)
    wd.observe("r", "Transferring")
    clock.advance(120)
    runner = sg.WatchdogThread(wd, wait=RealWait())
    with caplog.at_level(logging.ERROR, logger="stallguard"):
        runner.start()
        ended(runner)
    assert isinstance(runner.failure, SystemExit)
    assert wd.snapshot().runner_errors == 1
    assert any(r.levelno == logging.ERROR for r in caplog.records)
    with pytest.raises(SystemExit):
        runner.stop()


@pytest.mark.anyio
async def test_anyio_failure_is_logged_counted_and_propagated(caplog, reader) -> None:
    clock = FakeClock()
    wd = sg.Watchdog(SPEC, clock=clock)

    async def broken_wait(wake: anyio.Event, timeout: float | None) -> None:
        raise RuntimeError("wait broke")

    with (
        caplog.at_level(logging.ERROR, logger="stallguard"),
        pytest.raises(ExceptionGroup) as caught,  # noqa: F821 - builtin on 3.11
    ):
        async with sg.watching(wd, wait=broken_wait):
            await anyio.sleep_forever()
    assert caught.group_contains(RuntimeError, match="wait broke")
    assert wd.snapshot().runner_errors == 1
    assert runner_errors(reader) == {"runner_edges": 1}
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "run_watchdog()" in errors[0].getMessage()


def leaves_of(error: BaseException) -> list[BaseException]:
    """*error*, or the exceptions an (exception) group holds, flattened."""
    if isinstance(error, BaseExceptionGroup):  # noqa: F821 - builtin on 3.11
        return [leaf for inner in error.exceptions for leaf in leaves_of(inner)]
    return [error]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("error", [SystemExit, KeyboardInterrupt])
def test_anyio_logs_and_counts_an_interrupting_hook_then_lets_it_go(
    backend: str, error: type[BaseException], caplog, reader
) -> None:
    """Issue 20: run_watchdog let a SystemExit or KeyboardInterrupt from a hook end it
    without a log line or a count (only an Exception was), unlike WatchdogThread."""
    clock = FakeClock()
    enforced: list[object] = []

    def on_expire(expiry: sg.Expiry[object]) -> None:
        enforced.append(expiry.key)
        raise error()

    wd = sg.Watchdog(SPEC, clock=clock, on_expire=on_expire)
    wd.observe("r", "Transferring")
    clock.advance(120)

    async def main() -> None:
        with anyio.fail_after(SAFETY):
            async with sg.watching(wd):
                await anyio.sleep_forever()

    with (
        caplog.at_level(logging.ERROR, logger="stallguard"),
        pytest.raises(BaseException) as caught,
    ):
        anyio.run(main, backend=backend)
    assert [type(e) for e in leaves_of(caught.value)] == [error]  # propagated, as documented
    errors = [r for r in caplog.records if r.name == "stallguard" and r.levelno == logging.ERROR]
    assert len(errors) == 1 and "run_watchdog()" in errors[0].getMessage()
    assert error.__name__ in errors[0].getMessage()
    assert wd.snapshot().runner_errors == 1
    assert runner_errors(reader) == {"runner_edges": 1}
    assert not wd.listeners
    # and the watchdog lost nothing: the next check returns the interrupted expiry,
    # without enforcing it twice
    assert [e.key for e in wd.check()] == ["r"] and enforced == ["r"]


@pytest.mark.anyio
async def test_anyio_cancellation_is_not_a_failure(caplog) -> None:
    wd = sg.Watchdog(SPEC, clock=FakeClock())
    with caplog.at_level(logging.ERROR, logger="stallguard"):
        async with sg.watching(wd):
            pass
    assert wd.snapshot().runner_errors == 0 and not caplog.records


@pytest.mark.anyio
async def test_anyio_waits_are_capped_and_the_default_wait_survives_huge_ones() -> None:
    clock = FakeClock()
    wd = sg.Watchdog(
        sg.Spec(name="runner_huge", deadlines={"Forever": 1e300, "Transferring": 120}),
        clock=clock,
    )
    wd.observe("long", "Forever")
    seen: list[float | None] = []
    got_one = anyio.Event()

    async def recording(wake: anyio.Event, timeout: float | None) -> None:
        seen.append(timeout)
        got_one.set()
        await wake.wait()

    with anyio.fail_after(SAFETY):
        async with sg.watching(wd, wait=recording):
            await got_one.wait()
    assert seen == [ASYNC_WAIT_MAX]
    # the real wait of the event loop, with the longest deadline a Spec accepts
    wd.forget("long", remember=False)
    wd.observe("long2", "Forever")
    with anyio.fail_after(SAFETY):
        async with sg.watching(wd):
            await anyio.lowlevel.checkpoint()
            wd.observe("short", "Transferring")
            await anyio.lowlevel.checkpoint()
    assert wd.snapshot().runner_errors == 0


# --------------------------------------------------------------------------- point 5


class ThreadWaitBlocking:
    """Time stands still: records each timeout and returns only when woken."""

    def __init__(self) -> None:
        self.calls: queue.Queue[float | None] = queue.Queue()

    def __call__(self, wake: threading.Event, timeout: float | None) -> None:
        self.calls.put(timeout)
        wake.wait()

    def next(self) -> float | None:
        return self.calls.get(timeout=SAFETY)


def test_stop_before_start_leaves_the_runner_startable() -> None:
    clock = FakeClock()
    wd = sg.Watchdog(SPEC, clock=clock)
    wait = ThreadWaitBlocking()
    runner = sg.WatchdogThread(wd, wait=wait)
    runner.stop()  # never started: nothing to do, and it must not poison start()
    runner.start()
    try:
        assert wait.next() is None
        wd.observe("r", "Transferring")
        assert wait.next() == 120.0  # it is listening
        assert runner.is_alive()
    finally:
        runner.stop(timeout=SAFETY)


def test_a_stopped_runner_starts_again_and_checks_again() -> None:
    clock = FakeClock()
    failed: list[object] = []
    wd = sg.Watchdog(SPEC, clock=clock, on_expire=lambda e: failed.append(e.key))
    wait = ThreadWaitBlocking()
    runner = sg.WatchdogThread(wd, wait=wait)
    for round_ in range(3):
        runner.start()
        assert wait.next() is None
        wd.observe(round_, "Transferring")
        assert wait.next() == 120.0
        runner.stop(timeout=SAFETY)
        assert not runner.is_alive() and not wd.listeners
        clock.advance(120)  # overdue while no runner runs
        runner.start()  # the restarted runner checks at once
        assert wait.next() is None
        runner.stop(timeout=SAFETY)
    assert failed == [0, 1, 2]


def test_start_while_a_timed_out_stop_still_waits_for_a_hook_is_refused() -> None:
    clock = FakeClock()
    entered, release = threading.Event(), threading.Event()

    def blocking_hook(expiry: sg.Expiry[object]) -> None:
        entered.set()
        release.wait(SAFETY)

    wd = sg.Watchdog(SPEC, clock=clock, on_expire=blocking_hook)
    wd.observe("r1", "Transferring")
    clock.advance(120)
    runner = sg.WatchdogThread(wd, wait=ThreadWaitBlocking()).start()
    assert entered.wait(SAFETY)
    with pytest.raises(TimeoutError):
        runner.stop(timeout=0)
    with pytest.raises(RuntimeError, match="is stopping; stop\\(\\) it before starting it again"):
        runner.start()
    release.set()
    runner.stop(timeout=SAFETY)
    runner.start()  # once the old thread has ended, it starts again
    assert runner.is_alive()
    runner.stop(timeout=SAFETY)


def test_stop_refuses_a_bad_timeout() -> None:
    runner = sg.WatchdogThread(sg.Watchdog(SPEC, clock=FakeClock()))
    for bad in (float("nan"), -1, "1", True):
        with pytest.raises(ValueError, match="timeout must be None or a number"):
            runner.stop(timeout=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"name": 3}, r"name must be a string or None, got 3"), ({"daemon": "no"}, "daemon")],
)
def test_thread_constructor_refuses_bad_arguments(kwargs, message) -> None:
    with pytest.raises(sg.ConfigError, match=message):
        sg.WatchdogThread(sg.Watchdog(SPEC, clock=FakeClock()), **kwargs)


class Gate:
    """A thread-runner wait in which time stands still (it returns only when woken),
    and which tells when the runner is blocked in it with nothing pending: then its last
    ``check()`` ran after everything the test did before waking it."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.blocked = False

    def __call__(self, wake: threading.Event, timeout: float | None) -> None:
        with self.cond:
            self.blocked = True
            self.cond.notify_all()
        wake.wait()
        with self.cond:
            self.blocked = False

    def settle(self, runner: sg.WatchdogThread) -> None:
        run = runner._run
        assert run is not None
        run.waker()  # what the watchdog calls on an earlier deadline
        with self.cond:
            # once the runner cleared the wake-up we set and blocks again, its check()
            # and its clock reading came after this call
            assert self.cond.wait_for(lambda: self.blocked and not run.wake.is_set(), SAFETY)


class StartStop(RuleBasedStateMachine):
    """Random start / stop / observe / time-passes sequences on one WatchdogThread,
    against a model of whether it runs: it runs exactly when the model says (a stop()
    before any start() included), only a running runner holds the watchdog's wake-up
    slot, start() on a running one is refused, a running runner leaves nothing overdue,
    and each overdue request is failed exactly once, by whichever run of the runner."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.failed: list[object] = []
        self.wd = sg.Watchdog(SPEC, clock=self.clock, on_expire=lambda e: self.failed.append(e.key))
        self.gate = Gate()
        self.runner = sg.WatchdogThread(self.wd, wait=self.gate)
        self.running = False
        self.keys = 0

    def settle(self) -> None:
        if self.running:
            self.gate.settle(self.runner)
            overdue = [r.key for r in self.wd.snapshot().requests if r.remaining <= 0]
            assert overdue == []

    @rule()
    def start(self) -> None:
        if self.running:
            with pytest.raises(RuntimeError, match="already running"):
                self.runner.start()
        else:
            self.runner.start()
            self.running = True
        self.settle()

    @rule()
    def stop(self) -> None:
        self.runner.stop(timeout=SAFETY)
        self.running = False

    @rule()
    def observe(self) -> None:
        self.keys += 1
        self.wd.observe(self.keys, "Transferring")
        self.settle()

    @rule(seconds=st.sampled_from([1.0, 119.0, 120.0, 500.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.settle()

    @invariant()
    def matches_the_model(self) -> None:
        assert self.runner.is_alive() == self.running
        assert bool(self.wd.listeners) == self.running
        assert self.runner.failure is None
        assert len(set(self.failed)) == len(self.failed)  # each failed once

    def teardown(self) -> None:
        self.runner.stop(timeout=SAFETY)
        self.wd.check()
        assert sorted(self.failed) == sorted(set(self.failed))
        assert len(self.failed) + len(self.wd) == self.keys  # none lost, none twice


TestStartStop = StartStop.TestCase
TestStartStop.settings = settings(max_examples=40, stateful_step_count=15, deadline=None)
