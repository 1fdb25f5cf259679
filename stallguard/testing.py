"""Helpers for testing code that uses stallguard, deterministically.

* :class:`FakeClock`: a clock you move by hand; pass it as ``Watchdog(clock=...)``.
* :func:`record_expiries`: a context manager that collects every expiry, in place of
  the process-wide instrumentation hooks.
* :func:`stop_and_wait`, :func:`threads_stopped`: freeze a peer process (the fault
  stallguard exists for) and know that the freeze took effect (Linux).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from ._details import Expiry
from ._validate import is_real
from .instrumentation import _hooks, get_on_expire_hooks, set_on_expire_hooks

__all__ = [
    "FakeClock",
    "free_port",
    "free_ports",
    "record_expiries",
    "stop_and_wait",
    "threads_stopped",
]


class FakeClock:
    """A monotonic clock for tests: it only moves when told to.

    Args:
        start: the initial time in seconds.

    Example::

        clock = FakeClock()
        watchdog = Watchdog(spec, clock=clock)
        watchdog.observe("r1", "Transferring")
        clock.advance(120)
        assert [e.key for e in watchdog.check()] == ["r1"]
    """

    __slots__ = ("_lock", "_now")

    def __init__(self, start: float = 0.0) -> None:
        self._now = self._valid("start", start)
        self._lock = threading.Lock()

    @staticmethod
    def _valid(name: str, value: object) -> float:
        if not is_real(value):
            raise TypeError(f"{name} must be a number of seconds, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value!r}")
        return float(value)

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        """Move the clock forward by *seconds* (>= 0) and return the new time."""
        seconds = self._valid("seconds", seconds)
        if seconds < 0:
            raise ValueError(f"a monotonic clock cannot go backwards: advance({seconds!r})")
        with self._lock:
            self._now += seconds
            return self._now

    def set(self, now: float) -> None:
        """Set the clock to *now*, which must not be earlier than the current time."""
        now = self._valid("now", now)
        with self._lock:
            if now < self._now:
                raise ValueError(
                    f"a monotonic clock cannot go backwards: set({now!r}) < {self._now!r}"
                )
            self._now = now

    def __repr__(self) -> str:
        return f"FakeClock({self._now!r})"


@contextlib.contextmanager
def record_expiries(*, keep_hooks: bool = False) -> Iterator[list[Expiry[Any]]]:
    """Collect every expiry from every watchdog while the block runs.

    Args:
        keep_hooks: also run the hooks that were active (logging, OpenTelemetry);
            by default they are replaced for the duration of the block.

    Yields:
        The list the expiries are appended to.
    """
    seen: list[Expiry[Any]] = []
    previous = _hooks._configured
    hooks: list[Any] = [seen.append]
    if keep_hooks:
        hooks.extend(get_on_expire_hooks())
    set_on_expire_hooks(hooks)
    try:
        yield seen
    finally:
        set_on_expire_hooks(previous)


def threads_stopped(pid: int) -> bool:
    """Whether every thread of process *pid* is stopped (state ``T`` or ``t`` in
    ``/proc/PID/task/*/stat``; a thread that exited or is a zombie counts as stopped).
    Linux only: :class:`OSError` if *pid* has no ``/proc`` entry."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):  # the thread just exited
            continue
        if state not in ("T", "t", "Z", "X"):
            return False
    return True


def stop_and_wait(pid: int, timeout: float = 10.0) -> float:
    """SIGSTOP process *pid* and return once every thread of it is stopped; returns the
    seconds that took. ``kill`` returns when the signal is queued, and a stop takes
    effect thread by thread: a transfer thread running on another core goes on for a
    moment, long enough to finish a small transfer the test meant to catch in flight.

    Raises:
        TimeoutError: the process did not stop within *timeout* seconds.
    """
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    while not threads_stopped(pid):
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"process {pid} did not stop within {timeout} s")
        time.sleep(0.001)
    return time.monotonic() - t0


def free_ports(n: int, lo: int = 21000, hi: int = 27000) -> list[int]:
    """*n* distinct TCP ports free on loopback now, from *lo* up to *hi* (excluded),
    below the kernel's ephemeral range (32768-60999 on Linux by default), starting at
    a random port so parallel test workers rarely pick the same ones. A port found by
    binding port 0 is an ephemeral one, and in the seconds before a server (a gloo
    store, an HTTP server) binds it, any process's own ephemeral bind or outgoing
    connection can take it: "address already in use" in a suite run under load.

    Raises:
        ValueError: not ``0 < lo < hi <= 65536``, or *n* is not a positive int.
        RuntimeError: fewer than *n* ports of the range are free.
    """
    if not 0 < lo < hi <= 65536:
        raise ValueError(f"free_ports: bad range {lo}-{hi}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"free_ports: n must be a positive int, got {n!r}")
    out: list[int] = []
    start = random.randrange(lo, hi)
    for i in range(hi - lo):
        port = lo + (start - lo + i) % (hi - lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        out.append(port)
        if len(out) == n:
            return out
    raise RuntimeError(f"no {n} free ports in {lo}-{hi}")


def free_port() -> int:
    """One port of :func:`free_ports`."""
    return free_ports(1)[0]
