"""Declarative request-phase specs: states, per-state deadlines, terminal states."""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, Union

import attrs

from ._errors import ConfigError
from ._validate import check_seconds

__all__ = ["Deadline", "Spec", "State", "state_label"]

#: A state is a non-empty string or a member of an :class:`enum.Enum`.
State = Union[str, enum.Enum]


def state_label(state: State) -> str:
    """The name stallguard uses for *state* in logs, spans, metrics and config files.

    An enum member is labelled by its ``name``; a string is its own label.
    """
    return state.name if isinstance(state, enum.Enum) else state


def _seconds(field: str, value: object) -> float | None:
    """Validate a duration in seconds: a positive, finite real number, or None."""
    return check_seconds(field, value)


def _check_state(field: str, state: object) -> State:
    if isinstance(state, enum.Enum):
        return state
    if isinstance(state, str):
        if not state:
            raise ConfigError(f"{field} contains an empty state name")
        return state
    if not isinstance(state, Hashable):
        raise ConfigError(
            f"{field} contains the unhashable state {state!r} ({type(state).__name__}); "
            "states are strings or enum members"
        )
    raise ConfigError(
        f"{field} contains {state!r} ({type(state).__name__}); states are strings or "
        "enum members. To watch a poll() that returns plain ints (like SGLang's KVPoll), "
        "name the states in the spec and map the values with guard(state=...)"
    )


@attrs.frozen
class Deadline:
    """How long a request may stay in one state.

    Args:
        seconds: the state deadline: the request is expired once it has been in the
            state this long, counted from when it entered the state. Re-observing the
            same state does not restart it. ``None``: no state deadline.
        stall: the progress window: the request is expired once this long has passed
            without a :meth:`~stallguard.Watchdog.heartbeat` (or, before the first one,
            since it entered the state). ``None``: no progress window.

    A bare number in :attr:`Spec.deadlines` means ``Deadline(seconds=number)``, and ``None``
    means ``Deadline()`` (explicitly no deadline).
    """

    seconds: float | None = None
    stall: float | None = None

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "seconds", _seconds("Deadline.seconds", self.seconds))
        object.__setattr__(self, "stall", _seconds("Deadline.stall", self.stall))

    @property
    def bounded(self) -> bool:
        """True if either a state deadline or a progress window is set."""
        return self.seconds is not None or self.stall is not None


def _to_deadline(state: State, value: object) -> Deadline:
    field = f"deadlines[{state_label(state)!r}]"
    if isinstance(value, Deadline):
        return value
    if value is None:
        return Deadline()
    if isinstance(value, Mapping):
        unknown = set(value) - {"seconds", "stall"}
        if unknown:
            raise ConfigError(
                f"{field} has unknown fields {sorted(map(str, unknown))}; "
                "allowed: 'seconds', 'stall'"
            )
        return Deadline(
            seconds=_seconds(f"{field}.seconds", value.get("seconds")),
            stall=_seconds(f"{field}.stall", value.get("stall")),
        )
    return Deadline(seconds=_seconds(field, value))


def _pairs(value: object) -> list[tuple[object, object]]:
    if isinstance(value, Mapping):
        return list(value.items())
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigError(
            f"deadlines must be a mapping of state -> seconds, got {value!r} "
            f"({type(value).__name__})"
        )
    pairs = []
    for item in value:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ConfigError(f"deadlines must hold (state, seconds) pairs, got {item!r}")
        pairs.append(item)
    return pairs


def _convert_deadlines(value: object) -> Mapping[State, Deadline]:
    out: dict[State, Deadline] = {}
    labels: dict[str, State] = {}
    for raw_state, raw_deadline in _pairs(value):
        state = _check_state("deadlines", raw_state)
        label = state_label(state)
        if label in labels:
            raise ConfigError(
                f"deadlines declares state {label!r} twice (as {labels[label]!r} and {state!r})"
            )
        labels[label] = state
        out[state] = _to_deadline(state, raw_deadline)
    return MappingProxyType(out)


def _convert_terminal(value: object) -> tuple[State, ...]:
    if isinstance(value, (str, enum.Enum)):
        value = (value,)
    if not isinstance(value, Iterable):
        raise ConfigError(
            f"terminal must be a collection of states, got {value!r} ({type(value).__name__})"
        )
    out: list[State] = []
    labels: set[str] = set()
    for raw in value:
        state = _check_state("terminal", raw)
        label = state_label(state)
        if label in labels:
            raise ConfigError(f"terminal lists state {label!r} twice")
        labels.add(label)
        out.append(state)
    return tuple(out)


def _convert_lifetime(value: object) -> float | None:
    return _seconds("lifetime", value)


@attrs.frozen
class Spec:
    """The phases of one kind of request and how long each may last.

    Args:
        name: a short name for the kind of request, used in logs, spans and metrics
            (for example ``"kv_sender"``).
        deadlines: every non-terminal state, mapped to its deadline: seconds, a
            :class:`Deadline` (with a progress ``stall`` window), or ``None`` to declare
            explicitly that the state has no deadline. A non-terminal state that is not
            listed here is unknown to the watchdog; there is no deadline by omission.
        terminal: the states in which a request is finished (``Success``, ``Failed``...).
            Observing one untracks the request.
        lifetime: optional bound on a request's whole life, in seconds from the first time
            the watchdog saw it, whatever states it passes through (Temporal's
            schedule-to-close).

    Raises:
        ConfigError: naming the field and value, for an empty spec, a duration that is not
            a positive finite number, a state that is both terminal and deadlined, a state
            listed twice, or a state that is not a string or an enum member.

    Example::

        Spec(
            name="kv_sender",
            deadlines={"Bootstrapping": 300, "WaitingForInput": 120, "Transferring": 120},
            terminal=["Success", "Failed"],
        )
    """

    name: str
    deadlines: Mapping[State, Deadline] = attrs.field(converter=_convert_deadlines)
    terminal: tuple[State, ...] = attrs.field(default=(), converter=_convert_terminal)
    lifetime: float | None = attrs.field(default=None, converter=_convert_lifetime)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError(f"name must be a non-empty string, got {self.name!r}")
        if not self.deadlines:
            raise ConfigError(
                f"spec {self.name!r} declares no non-terminal state: deadlines is empty. "
                "List every state a request can wait in, with seconds or None"
            )
        deadlined = {state_label(s): s for s in self.deadlines}
        for state in self.terminal:
            label = state_label(state)
            if label in deadlined:
                raise ConfigError(
                    f"spec {self.name!r}: state {label!r} is both terminal and in deadlines "
                    f"(deadline {self.deadlines[deadlined[label]]!r}); a terminal state "
                    "ends tracking, so it cannot have a deadline"
                )

    @property
    def states(self) -> tuple[State, ...]:
        """Every declared state (the deadlined ones first, then the terminal ones)."""
        return (*self.deadlines, *self.terminal)

    def state(self, label: str) -> State:
        """The declared state whose label (see :func:`state_label`) is *label*.

        Raises:
            ConfigError: if no declared state has that label.
        """
        for state in self.states:
            if state_label(state) == label:
                return state
        raise ConfigError(
            f"spec {self.name!r} has no state {label!r}; "
            f"known states: {', '.join(map(state_label, self.states))}"
        )

    def evolve(self, **changes: Any) -> Spec:
        """A copy with *changes* applied (and validated), e.g. ``spec.evolve(lifetime=600)``."""
        return attrs.evolve(self, **changes)
