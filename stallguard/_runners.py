"""Runners: call :meth:`Watchdog.check` exactly when a deadline is due, in the background.

Two runners share one loop (see docs/runners.md for the why):

1. ``check()`` (expire whatever is due),
2. arm a fresh wake-up signal,
3. ``next_deadline()`` (exact; from here on, any earlier deadline calls
   the runner's ``on_earlier_deadline`` listener, which fires the signal),
4. wait until the signal fires or the deadline's time has come.

Arming the signal *before* reading the next deadline closes the race with a state change
that lands in between: either ``next_deadline()`` already includes it, or it fires the
signal.

* :func:`run_watchdog` / :func:`watching`: an anyio task (asyncio or trio), no thread.
* :class:`WatchdogThread`: a plain thread for synchronous programs.

Neither runs a timer per request. The waker that the watchdog calls (from any thread,
never under its lock) only sets a flag and, from a foreign thread, posts one non-blocking call
to the event loop; it never calls back into the watchdog. Runners are listeners of the
watchdog, so several may run one watchdog (each check() is atomic: every request still
expires once).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, NoReturn, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel

from ._errors import ConfigError, StallguardError
from ._watchdog import Watchdog
from .instrumentation import _metrics

__all__ = [
    "ASYNC_WAIT_MAX",
    "THREAD_WAIT_MAX",
    "AsyncWait",
    "ThreadWait",
    "WatchdogThread",
    "run_watchdog",
    "watching",
]

log = logging.getLogger("stallguard")

W = TypeVar("W", bound=Watchdog[Any])
T = TypeVar("T")

#: ``await wait(wake, timeout)`` must return once *wake* is set or *timeout* seconds (on
#: the watchdog's clock; ``None``: no timeout) have passed, whichever comes first.
AsyncWait = Callable[[anyio.Event, "float | None"], Awaitable[None]]
#: ``wait(wake, timeout)`` must return once *wake* is set or *timeout* seconds (on the
#: watchdog's clock; ``None``: no timeout) have passed, whichever comes first.
ThreadWait = Callable[[threading.Event, "float | None"], None]


def _check_watchdog(watchdog: object) -> Watchdog[Any]:
    if not isinstance(watchdog, Watchdog):
        raise ConfigError(f"watchdog must be a stallguard.Watchdog, got {watchdog!r}")
    return watchdog


def _install(watchdog: Watchdog[Any], waker: Callable[[], None]) -> None:
    """Wake *waker* whenever an earlier deadline appears (a listener: any number of
    runners, metrics and integrations may listen to one watchdog)."""
    watchdog.add_listener(on_earlier_deadline=waker)


def _uninstall(watchdog: Watchdog[Any], waker: Callable[[], None]) -> None:
    for listener in watchdog.listeners:
        if listener.on_earlier_deadline is waker:
            listener.remove()


#: The longest single wait the thread runner asks for, in seconds: what
#: :meth:`threading.Event.wait` accepts (:data:`threading.TIMEOUT_MAX`, about 292 years
#: on Linux). A later deadline is waited for in several rounds.
THREAD_WAIT_MAX: float = threading.TIMEOUT_MAX
#: The longest single wait the anyio runner asks for, in seconds (a day). asyncio and
#: trio accept any finite timeout today (checked up to ``1e300``); the cap keeps the
#: runner independent of an event loop's timer limits, for one extra wake-up a day.
ASYNC_WAIT_MAX: float = 86_400.0


def _runner_failed(watchdog: Watchdog[Any], runner: str, error: BaseException) -> None:
    """A runner loop ended on *error*: say so at once, loudly, and count it."""
    log.error(
        "stallguard: %s of %r stopped: %s: %s; overdue requests of this watchdog are "
        "no longer failed in the background",
        runner,
        watchdog,
        type(error).__name__,
        error,
        exc_info=error,
    )
    watchdog._runner_failed()
    _metrics._count_runner_error(watchdog.spec.name)


def _clock(watchdog: Watchdog[Any]) -> Callable[[], float]:
    # The runner computes its waits on the watchdog's own clock, so a FakeClock in a
    # test drives the runner as well (with a matching ``wait``).
    return watchdog.clock


# --------------------------------------------------------------------------- anyio


class _LoopWaker:
    """The watchdog's ``on_earlier_deadline`` for an event-loop runner.

    Called from any thread, possibly under the watchdog lock: it must not block and must
    not call into the watchdog. On the loop's own thread it sets the event directly;
    from another thread it posts ``event.set`` to the loop without waiting (asyncio's
    ``call_soon_threadsafe`` / trio's ``TrioToken.run_sync_soon``). Waking an anyio
    runner with anyio's ``from_thread.run_sync`` would block the calling thread until the
    loop runs, which can deadlock: the caller holds the watchdog lock that the loop
    thread may be waiting for in ``check()``.
    """

    __slots__ = ("armed", "event", "post", "thread")

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.post = self._find_post()
        self.event = anyio.Event()
        self.armed = False

    @staticmethod
    def _find_post() -> Callable[[Callable[[], object]], object]:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            return loop.call_soon_threadsafe
        trio = sys.modules.get("trio")
        if trio is not None:
            try:
                return trio.lowlevel.current_trio_token().run_sync_soon  # type: ignore[no-any-return]
            except RuntimeError:
                pass
        raise StallguardError(
            "run_watchdog() must run in an asyncio or trio event loop (through anyio)"
        )

    def arm(self) -> anyio.Event:
        self.event = anyio.Event()
        self.armed = True
        return self.event

    def __call__(self) -> None:
        if not self.armed:  # already woken for this round: nothing more to do
            return
        self.armed = False
        event = self.event
        if threading.get_ident() == self.thread:
            event.set()
            return
        try:
            self.post(event.set)
        except Exception:  # the loop has closed: its runner is gone, nobody to wake
            pass


def _waiter(wait: T | None, default: T, kind: str) -> T:
    """A runner's *wait*: *default* if None, else *wait*, which must be *kind* of
    ``(wake, timeout)``."""
    if wait is None:
        return default
    if not callable(wait):
        raise ConfigError(f"wait must be {kind} (wake, timeout), got {wait!r}")
    return wait


async def _anyio_wait(wake: anyio.Event, timeout: float | None) -> None:
    if timeout is None:
        await wake.wait()
    else:
        with anyio.move_on_after(timeout):
            await wake.wait()


async def run_watchdog(
    watchdog: Watchdog[Any],
    *,
    wait: AsyncWait | None = None,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Run *watchdog*'s deadline checks in the background of an anyio program, forever.

    The task sleeps until :meth:`Watchdog.next_deadline` (no deadline: until one
    appears), runs :meth:`Watchdog.check`, and sleeps again. A state change that brings
    in an earlier deadline than the one it sleeps for wakes it at once, whichever thread
    made it. It creates no thread and no timer per request. Cancel it to stop it (for
    example by cancelling its task group); it leaves the watchdog as it found it.

    Works on asyncio and trio. ``on_expire`` and the instrumentation hooks run on this
    task, in the event loop's thread, so they may schedule work on the loop directly.

    If the loop fails (``check()`` or *wait* raising, also a ``SystemExit`` or
    ``KeyboardInterrupt`` from an ``on_expire`` hook: anything but cancellation), the
    error is logged at ERROR at once, counted in the watchdog's
    ``snapshot().runner_errors`` (and the ``stallguard.runner.errors`` metric), and
    propagates to the task group. A single wait is never longer than
    ``ASYNC_WAIT_MAX`` seconds; a later deadline is waited for in several rounds.

    Args:
        watchdog: the watchdog to run. Any number of runners may run one watchdog
            (each request still expires once), but one is all it needs.
        wait: how to wait (for tests): ``await wait(wake, timeout)`` returns once the
            :class:`anyio.Event` *wake* is set or *timeout* seconds on the watchdog's clock
            have passed (``None``: no timeout). The default waits in real time with
            :func:`anyio.move_on_after`, which matches the default clock
            (:func:`time.monotonic`); a test with a
            :class:`~stallguard.testing.FakeClock` passes a *wait* that advances the fake
            clock instead.
        task_status: for :meth:`anyio.abc.TaskGroup.start`, which returns once the runner
            is listening for new deadlines.

    Raises:
        StallguardError: if not run under asyncio or trio.

    Example::

        async with anyio.create_task_group() as tg:
            await tg.start(stallguard.run_watchdog, watchdog)
            ...  # serve requests; call tg.cancel_scope.cancel() to stop
    """
    watchdog = _check_watchdog(watchdog)
    wait = _waiter(wait, _anyio_wait, "an async callable")
    clock = _clock(watchdog)
    waker = _LoopWaker()
    _install(watchdog, waker)
    try:
        task_status.started()
        while True:
            watchdog.check()
            wake = waker.arm()
            due = watchdog.next_deadline()
            if due is None:
                await wait(wake, None)
                continue
            timeout = due - clock()
            if timeout > 0:
                await wait(wake, min(timeout, ASYNC_WAIT_MAX))
            else:  # already due (a slow hook, or a coarse timer): check again, cancellably
                await anyio.lowlevel.checkpoint()
    except anyio.get_cancelled_exc_class():  # cancelled: stopped, not failed
        raise
    except BaseException as exc:  # also SystemExit or KeyboardInterrupt from a hook
        _runner_failed(watchdog, "run_watchdog()", exc)
        raise
    finally:
        _uninstall(watchdog, waker)


@asynccontextmanager
async def watching(watchdog: W, *, wait: AsyncWait | None = None) -> AsyncIterator[W]:
    """Run :func:`run_watchdog` for *watchdog* while the ``async with`` block runs.

    The runner is listening when the block starts and is cancelled (and has let go of the
    watchdog) when it ends.

    Example::

        async with stallguard.watching(stallguard.Watchdog(spec)) as watchdog:
            ...  # observe state changes; overdue requests are failed in the background

    Args:
        watchdog: the watchdog to run.
        wait: see :func:`run_watchdog`.

    Yields:
        *watchdog*.
    """
    async with anyio.create_task_group() as tg:
        await tg.start(functools.partial(run_watchdog, watchdog, wait=wait))
        try:
            yield watchdog
        finally:
            tg.cancel_scope.cancel()


# --------------------------------------------------------------------------- thread


def _thread_wait(wake: threading.Event, timeout: float | None) -> None:
    wake.wait(timeout)


class _Run:
    """One run of a :class:`WatchdogThread`: its thread, stop flag and outcome."""

    __slots__ = ("error", "stopping", "thread", "wake", "waker")

    thread: threading.Thread

    def __init__(self) -> None:
        self.wake = threading.Event()
        self.waker = self.wake.set  # one bound method, so that it can be uninstalled
        self.stopping = False
        self.error: BaseException | None = None


class WatchdogThread:
    """Run a watchdog's deadline checks on one background thread, for synchronous
    programs.

    The thread sleeps until :meth:`Watchdog.next_deadline`, runs
    :meth:`Watchdog.check`, and sleeps again; an earlier deadline, from any thread,
    wakes it at once. ``on_expire`` and the instrumentation hooks run on this thread.
    One thread per runner, never one per request.

    If anything ends the thread other than :meth:`stop` (``check()`` or *wait* raising,
    an ``on_expire`` raising ``SystemExit``...), the error is logged at ERROR at once,
    counted in the watchdog's ``snapshot().runner_errors`` (and the
    ``stallguard.runner.errors`` metric), kept in :attr:`failure`, and re-raised by
    :meth:`stop`.

    A stopped runner can be started again (a new thread, same watchdog).

    Args:
        watchdog: the watchdog to run. Any number of runners may run one watchdog
            (each request still expires once), but one is all it needs.
        name: the thread's name (default ``"stallguard-<spec name>"``).
        daemon: make it a daemon thread, so that a runner nobody stopped does not keep
            the process alive at exit (default True).
        wait: how to wait (for tests): ``wait(wake, timeout)`` returns once the
            :class:`threading.Event` *wake* is set or *timeout* seconds on the watchdog's
            clock have passed (``None``: no timeout). Default: ``wake.wait(timeout)``,
            in real time. *timeout* is never above :data:`threading.TIMEOUT_MAX`.

    Raises:
        ConfigError: for a *watchdog* that is not a :class:`~stallguard.Watchdog`, a
            *name* that is not a string, a non-bool *daemon* or a non-callable *wait*.

    Use it as a context manager, or call :meth:`start` and :meth:`stop`::

        with stallguard.WatchdogThread(watchdog):
            serve()   # overdue requests are failed in the background
    """

    def __init__(
        self,
        watchdog: Watchdog[Any],
        *,
        name: str | None = None,
        daemon: bool = True,
        wait: ThreadWait | None = None,
    ) -> None:
        self.watchdog = _check_watchdog(watchdog)
        wait = _waiter(wait, _thread_wait, "a callable")
        if name is not None and not isinstance(name, str):
            raise ConfigError(f"name must be a string or None, got {name!r}")
        if not isinstance(daemon, bool):
            raise ConfigError(f"daemon must be True or False, got {daemon!r}")
        self._wait = wait
        self._name = name if name is not None else f"stallguard-{watchdog.spec.name}"
        self._daemon = daemon
        self._control = threading.Lock()  # start() and stop() from several threads
        self._run: _Run | None = None
        self._failure: BaseException | None = None

    @property
    def name(self) -> str:
        """The thread's name."""
        return self._name

    @property
    def failure(self) -> BaseException | None:
        """The error that ended the last run, if one did (None while it runs, after a
        clean stop, and before the first start). Cleared by :meth:`start`."""
        return self._failure

    def start(self) -> WatchdogThread:
        """Start the thread; returns self. It is listening for deadlines on return.

        A runner that was stopped (or that an error ended) starts again on a new
        thread; :attr:`failure` is cleared.

        Raises:
            RuntimeError: if this runner's thread is still running (not stopped, or a
                :meth:`stop` that timed out and whose hook still blocks ``check()``).
        """
        with self._control:
            run = self._run
            if run is not None and run.thread.is_alive():
                what = "is stopping" if run.stopping else "is already running"
                raise RuntimeError(f"{self!r} {what}; stop() it before starting it again")
            run = _Run()
            thread = run.thread = threading.Thread(
                target=self._loop, args=(run,), name=self._name, daemon=self._daemon
            )
            _install(self.watchdog, run.waker)
            self._failure = None
            self._run = run
            try:
                thread.start()
            except BaseException:
                _uninstall(self.watchdog, run.waker)
                self._run = None
                raise
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop the thread and wait for it to end (up to *timeout* real seconds;
        None: as long as it takes). Idempotent; a runner never started is left able
        to start.

        Raises:
            TimeoutError: if the thread is still running after *timeout* (a hook is
                blocking ``check()``); it stops once the hook returns.
            BaseException: whatever ended the thread (``check()`` or *wait* raising),
                once; it stays in :attr:`failure` until the next :meth:`start`.
        """
        _check_timeout(timeout)
        with self._control:
            run = self._run
            if run is None:
                return
            run.stopping = True
            run.wake.set()
        if run.thread is not threading.current_thread():
            self._join(run.thread, timeout)
        _uninstall(self.watchdog, run.waker)
        error, run.error = run.error, None
        if error is not None:
            raise error

    def _join(self, thread: threading.Thread, timeout: float | None) -> None:
        """Wait for *thread* to end, up to *timeout* seconds."""
        thread.join(None if timeout is None else min(timeout, threading.TIMEOUT_MAX))
        if thread.is_alive():
            raise TimeoutError(
                f"{self!r} did not stop within {timeout}s: an on_expire or "
                "instrumentation hook is blocking check()"
            )

    def is_alive(self) -> bool:
        """True while the thread runs."""
        run = self._run
        return run is not None and run.thread.is_alive()

    def __enter__(self) -> WatchdogThread:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        if self.is_alive():
            state = "running"
        elif self._failure is not None:
            state = f"failed ({type(self._failure).__name__})"
        else:
            state = "stopped"
        return f"<stallguard.WatchdogThread {self._name!r} {state}>"

    def _loop(self, run: _Run) -> None:
        watchdog, wake, wait = self.watchdog, run.wake, self._wait
        clock = _clock(watchdog)
        try:
            while not run.stopping:
                watchdog.check()
                wake.clear()
                if run.stopping:
                    break
                due = watchdog.next_deadline()
                if due is None:
                    wait(wake, None)
                    continue
                timeout = due - clock()
                if timeout > 0:
                    wait(wake, min(timeout, THREAD_WAIT_MAX))
        except BaseException as exc:
            run.error = exc
            self._failure = exc
            _runner_failed(watchdog, repr(self), exc)
        finally:
            _uninstall(watchdog, run.waker)


def _check_timeout(timeout: object) -> None:
    """Refuse a :meth:`WatchdogThread.stop` timeout that is neither None nor a number of
    seconds >= 0 (nan included)."""
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not timeout >= 0  # also refuses nan
    ):
        raise ValueError(f"timeout must be None or a number of seconds >= 0, got {timeout!r}")
