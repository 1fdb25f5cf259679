"""WatchdogOptions: the one validated owner of a watchdog's settings."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs

from ._details import Mode
from ._errors import ConfigError
from ._validate import DEFAULT_MEMORY, MODES, UNKNOWN_STATE, choice, is_count

__all__ = ["WatchdogOptions"]


def _mode(_instance: object, _attribute: object, value: object) -> None:
    choice("mode", value, MODES)


def _unknown_state(_instance: object, _attribute: object, value: object) -> None:
    choice("unknown_state", value, UNKNOWN_STATE)


def _memory(_instance: object, _attribute: object, value: object) -> None:
    if not is_count(value, 1):
        raise ConfigError(f"memory must be a positive int, got {value!r}")


def _flag(_instance: object, attribute: Any, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{attribute.name} must be True or False, got {value!r}")


def _clock(_instance: object, _attribute: object, value: object) -> None:
    if not callable(value):
        raise ConfigError(f"clock must be a callable returning seconds, got {value!r}")


@attrs.frozen
class WatchdogOptions:
    """How a :class:`~stallguard.Watchdog` behaves, validated once, shared by every way
    of making a watchdog (the constructor, :func:`~stallguard.load_config`,
    :func:`stallguard.transitions.attach`).

    Args:
        mode: ``"enforce"`` fails overdue requests; ``"report"`` only reports them (each
            request once per deadline), for a safe rollout.
        unknown_state: ``"raise"`` raises :class:`~stallguard.UnknownStateError` when a
            state the spec does not declare is observed; ``"ignore"`` drops and counts it.
        memory: how many concluded keys (expired, terminal or forgotten) are remembered
            so that a late event for them is dropped instead of re-tracking the request.
        clock: returns the current time in seconds and never goes backwards
            (:func:`time.monotonic`; tests pass a :class:`stallguard.testing.FakeClock`).
            The watchdog validates every reading (:class:`~stallguard.ClockError`).
        statistics: record time in state per state, and the requests each deadline
            fired (or would have fired) on, for :meth:`~stallguard.Watchdog.statistics`
            and :meth:`~stallguard.Watchdog.advice` (docs/advice.md): one histogram per
            state, and a bucket lookup added to every state change (about 0.3 µs,
            docs/performance.md). Off by default, like metrics: the hot path pays only
            for what is asked for. Turn it on for the shadow (report-mode) rollout that
            advice reads; stallguard-sglang turns it on for its ``/metrics`` export.

    Raises:
        ConfigError: naming the field and the value.
    """

    mode: Mode = attrs.field(default="enforce", validator=_mode)
    unknown_state: str = attrs.field(default="raise", validator=_unknown_state)
    memory: int = attrs.field(default=DEFAULT_MEMORY, validator=_memory)
    clock: Callable[[], float] = attrs.field(default=time.monotonic, validator=_clock)
    statistics: bool = attrs.field(default=False, validator=_flag)

    def evolve(self, **changes: Any) -> WatchdogOptions:
        """A copy with *changes* applied (and validated)."""
        unknown = set(changes) - {f.name for f in attrs.fields(WatchdogOptions)}
        if unknown:
            raise ConfigError(
                f"WatchdogOptions has no field {sorted(unknown)[0]!r}; fields: "
                "mode, unknown_state, memory, clock, statistics"
            )
        return attrs.evolve(self, **changes)


def resolve(options: object, **given: Any) -> WatchdogOptions:
    """The ``Watchdog`` constructor's options: *options* (None: the defaults) with the
    keyword arguments that are not None (*given*) overriding its fields."""
    if options is None:
        options = WatchdogOptions()
    elif not isinstance(options, WatchdogOptions):
        raise ConfigError(f"options must be a stallguard.WatchdogOptions, got {options!r}")
    given = {name: value for name, value in given.items() if value is not None}
    return options.evolve(**given) if given else options
