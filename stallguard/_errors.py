"""The exceptions stallguard raises."""

from __future__ import annotations

__all__ = ["ClockError", "ConfigError", "StallguardError", "UnknownStateError"]


class StallguardError(Exception):
    """Base class of every exception stallguard raises on purpose."""


class ConfigError(StallguardError, ValueError):
    """A spec, a watchdog argument or a configuration file is invalid.

    The message names the offending field (and, for files, the file and key)
    and the bad value, and says what would be accepted instead.
    """


class ClockError(StallguardError, ValueError):
    """A watchdog's clock returned something that is not a time: not a real number
    (``None``, a string, a ``datetime``, a bool), NaN, infinite, or an integer too large
    for a float.

    Raised by the watchdog method that read it (:meth:`~stallguard.Watchdog.observe`,
    :meth:`~stallguard.Watchdog.heartbeat`, :meth:`~stallguard.Watchdog.forget`,
    :meth:`~stallguard.Watchdog.snapshot`, and a :meth:`~stallguard.Watchdog.check` that
    may expire something), before it changed anything: a bad reading is never taken
    for a time, so it never expires a request. The message names the watchdog's spec,
    the clock and the reading.
    """

    def __init__(self, spec: str, clock: object, reading: object, problem: str) -> None:
        self.spec = spec
        self.clock = clock
        self.reading = reading
        super().__init__(
            f"the clock of watchdog {spec!r} ({clock!r}) returned {problem}; a clock "
            "must return a finite number of seconds (time.monotonic() does)"
        )


class UnknownStateError(StallguardError, ValueError):
    """A state was observed that the watchdog's spec does not declare.

    Raised by :meth:`stallguard.Watchdog.observe` (and the :meth:`~stallguard.Watchdog.guard`
    wrapper) when ``unknown_state="raise"``, the default. Silently ignoring an unknown state
    would leave the request without any deadline, which is the failure stallguard exists to
    prevent.
    """

    def __init__(self, spec: str, key: object, state: object, known: tuple[str, ...]) -> None:
        self.spec = spec
        self.key = key
        self.state = state
        self.known = known
        super().__init__(
            f"spec {spec!r} has no state {state!r} (observed for key {key!r}); "
            f"known states: {', '.join(known)}. Declare it in the spec (with a deadline, "
            "None for an explicit 'no deadline', or as terminal), or map poll values to "
            "spec states with guard(state=...)."
        )
