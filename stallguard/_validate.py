"""The one place where durations and watchdog choices are validated.

Every entry point (``Deadline``/``Spec``, :class:`~stallguard.WatchdogOptions`, the
config loaders, the adapters' config through :func:`~stallguard.parse_deadlines`) goes
through these functions, so a bad value gets the same message wherever it came from:
the location (a field name, or ``file: [table] key``) and the value.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeGuard

from ._errors import ClockError, ConfigError, UnknownStateError

if TYPE_CHECKING:
    from ._core import WatchdogCore
    from ._fifo import Rec, Slot

__all__ = [
    "MODES",
    "UNKNOWN_STATE",
    "DEFAULT_MEMORY",
    "SHOW_LIMIT",
    "check_at",
    "check_seconds",
    "check_time",
    "choice",
    "did_you_mean",
    "digits",
    "expire_hooks",
    "is_count",
    "is_real",
    "is_text",
    "says_none",
    "listener_args",
    "shorten",
    "unhashable",
    "tracked",
    "unhashable_lookup",
    "unknown_state",
]

_INF = math.inf

#: The watchdog modes, in the order docs list them.
MODES = ("enforce", "report")
#: What ``unknown_state`` accepts.
UNKNOWN_STATE = ("raise", "ignore")
#: How many concluded keys a watchdog remembers by default.
DEFAULT_MEMORY = 65_536


def did_you_mean(value: object, allowed: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the closest of *allowed* to *value*, or ``""``.
    The one hint every config error uses (the core's and the adapters'); only a string
    gets one (``str()`` of a 5,000-digit integer would raise)."""
    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(str(value), list(allowed), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def is_real(value: object) -> TypeGuard[int | float]:
    """Whether *value* is a real number as every check here means it: an int or a float,
    not a bool (``True`` is an int to Python, never a number of seconds)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_count(value: object, least: int = 0) -> TypeGuard[int]:
    """Whether *value* is an int (not a bool) of at least *least*."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def is_text(value: object) -> TypeGuard[str]:
    """Whether *value* is a non-empty string (a name, a label, a unit)."""
    return isinstance(value, str) and value != ""


def says_none(value: object) -> bool:
    """Whether *value* is the text ``"none"`` (any case, spaces around it ignored): how a
    config file or an environment variable says "no deadline"."""
    return isinstance(value, str) and value.strip().lower() == "none"


#: What :func:`seconds_or_problem` says is wrong with a duration.
NOT_A_NUMBER = "not a number"
TOO_LARGE = "too large for a float"
NOT_POSITIVE_FINITE = "not positive and finite"


def seconds_or_problem(value: object) -> float | str:
    """The one rule for durations: *value* as float seconds if it is a positive, finite
    real number (bools and strings are not numbers), else what is wrong with it
    (:data:`NOT_A_NUMBER`, :data:`TOO_LARGE` or :data:`NOT_POSITIVE_FINITE`). Callers
    word the error for their location (a field, a file's key, an environment variable)."""
    if not is_real(value):
        return NOT_A_NUMBER
    try:
        seconds = float(value)
    except OverflowError:
        return TOO_LARGE
    if math.isnan(seconds) or math.isinf(seconds) or seconds <= 0:
        return NOT_POSITIVE_FINITE
    return seconds


def check_seconds(where: str, value: object) -> float | None:
    """*value* as a duration: a positive, finite real number of seconds, or None.

    Args:
        where: how the error names the value's location, e.g. ``"Deadline.seconds"``.

    Raises:
        ConfigError: naming *where* and the value: not a number (bools and strings are
            not numbers), NaN, infinite, too large for a float, zero or negative.
    """
    if value is None:
        return None
    seconds = seconds_or_problem(value)
    if isinstance(seconds, str):
        said = _CHECK_SECONDS[seconds]
        raise ConfigError(said.format(where=where, shown=_show(value), type=type(value).__name__))
    return seconds


#: :func:`check_seconds`' message for each problem of :func:`seconds_or_problem`
_CHECK_SECONDS = {
    NOT_A_NUMBER: "{where} must be a number of seconds or None, got {shown} ({type})",
    TOO_LARGE: "{where} must be a positive, finite number of seconds, got {shown}, "
    "which is too large for a float",
    NOT_POSITIVE_FINITE: "{where} must be a positive, finite number of seconds, got "
    "{shown}; use None to declare explicitly that there is no deadline",
}


def choice(where: str, value: object, allowed: tuple[str, ...]) -> str:
    """*value* if it is one of *allowed*, else a ConfigError with a hint."""
    if isinstance(value, str) and value in allowed:
        return value
    expected = " or ".join(repr(a) for a in allowed)
    raise ConfigError(
        f"{where} must be {expected}, got {_show(value)}{did_you_mean(value, allowed)}"
    )


#: The longest rendering of a value in an error message (longer ones are shortened).
SHOW_LIMIT = 80


def digits(value: int) -> int:
    """How many decimal digits ``abs(value)`` has, for an integer of any size (``str()``
    refuses integers of more than 4,300 digits)."""
    n = abs(value)
    if n < 10**18:
        return len(str(n))
    count = int(math.log10(n)) + 1  # log10 accepts an int of any size; fix rounding below
    if 10 ** (count - 1) > n:
        count -= 1
    elif 10**count <= n:
        count += 1
    return count


def shorten(text: str, limit: int = SHOW_LIMIT) -> str:
    """*text*, cut to *limit* characters with ``...`` and its length when longer."""
    if len(text) <= limit:
        return text
    return f"{text[: max(limit - 3, 1)]}... ({len(text)} characters)"


def _show(value: object) -> str:
    """repr(value), shortened (a 400-digit integer is shown by its size)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        return f"an integer of {digits(value)} digits"
    try:
        text = repr(value)
    except Exception:  # a repr that fails (or recurses too deeply)
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= SHOW_LIMIT else text[: SHOW_LIMIT - 3] + "..."


# ------------------------------------------------------------- the watchdog's arguments


def check_time(name: str, value: Any) -> float:
    """*value* as a time on the watchdog's clock: a finite real number.

    Raises:
        TypeError: if it is not a real number (bools are not).
        ValueError: if it is NaN, infinite, or an int too large for a float.
    """
    if value.__class__ is not float and (
        value.__class__ is bool or not isinstance(value, (int, float))
    ):
        raise TypeError(
            f"{name} must be a time in seconds on the watchdog's clock, got {value!r} "
            f"({type(value).__name__})"
        )
    try:
        if math.isfinite(value):
            return float(value)
    except OverflowError:  # an int too large for a float
        pass
    raise ValueError(f"{name} must be a finite time on the watchdog's clock, got {value!r}")


def check_at(at: Any, now: float) -> float:
    """*at* as a start time: a finite number not later than *now*."""
    if at.__class__ is float and -_INF < at < _INF and at <= now:
        return at  # the common case, first
    at = check_time("at", at)
    if not at <= now:
        raise ValueError(f"at={at!r} is later than the watchdog clock's now ({now!r})")
    return at  # type: ignore[no-any-return]


def unhashable(key: object) -> TypeError:
    """The error for a request key that cannot be a dict key."""
    return TypeError(f"a request key must be hashable, got {key!r} ({type(key).__name__})")


def expire_hooks(on_expire: object) -> tuple[Callable[..., object], ...]:
    """A watchdog's ``on_expire`` (None, a callable, or an iterable of callables) as a
    tuple of callables."""
    if on_expire is None:
        return ()
    if callable(on_expire):
        return (on_expire,)
    if isinstance(on_expire, Iterable) and not isinstance(on_expire, (str, bytes)):
        return _callables(on_expire)
    raise ConfigError(f"on_expire must be a callable or a sequence of callables, got {on_expire!r}")


def _callables(on_expire: Iterable[Any]) -> tuple[Callable[..., object], ...]:
    """The hooks of an iterable ``on_expire``, each checked to be callable."""
    hooks = tuple(on_expire)
    for hook in hooks:
        if not callable(hook):
            raise ConfigError(f"on_expire must hold callables, got {hook!r}")
    return hooks


def listener_args(**functions: object) -> None:
    """``add_listener``'s arguments: each callable or None, at least one given."""
    for name, fn in functions.items():
        if fn is not None and not callable(fn):
            raise ConfigError(f"add_listener({name}=...) must be callable, got {fn!r}")
    if all(fn is None for fn in functions.values()):
        raise ConfigError(
            "add_listener() needs at least one of on_expire, on_leave, on_earlier_deadline"
        )


def clock_reading(spec: str, clock: object, reading: Any) -> float:
    """A watchdog clock's *reading* as a float: a finite real number, else the
    :class:`~stallguard.ClockError` naming the spec, the clock and the reading."""
    t = reading
    if t.__class__ is not float:
        if t.__class__ is bool or not isinstance(t, (int, float)):
            raise ClockError(spec, clock, reading, f"{_show(t)} ({type(t).__name__})")
        try:
            t = float(t)
        except OverflowError:
            raise ClockError(
                spec, clock, reading, f"{_show(reading)}, which is too large for a float"
            ) from None
    if not -_INF < t < _INF:
        raise ClockError(spec, clock, reading, f"{t!r} ({type(reading).__name__})")
    return t


def check_annotations(attributes: object, trace_links: object) -> tuple[Any, ...] | None:
    """``annotate()``'s *attributes* (None, or a mapping with string keys) checked, and
    its *trace_links* (None, or an iterable that is not a string) as a tuple."""
    if attributes is not None:
        _check_attributes(attributes)
    if trace_links is None:
        return None
    if isinstance(trace_links, (str, bytes)) or not isinstance(trace_links, Iterable):
        raise TypeError(f"trace_links must be an iterable, got {trace_links!r}")
    return tuple(trace_links)


def _check_attributes(attributes: object) -> None:
    """Refuse ``annotate()``'s *attributes* unless a mapping with string keys."""
    if not isinstance(attributes, Mapping):
        raise TypeError(f"attributes must be a mapping, got {attributes!r}")
    for name in attributes:
        if not isinstance(name, str):
            raise TypeError(f"attribute names must be strings, got {name!r}")


def unhashable_lookup(
    wd: WatchdogCore, key: object, state: object
) -> tuple[Slot | None, Rec | None]:
    """``Watchdog.observe``'s look-ups when one raised TypeError: an unhashable state
    is an unknown one; an unhashable key is refused."""
    try:
        slot = wd._slots.get(state)  # type: ignore[call-overload]
    except TypeError:
        slot = None
    try:
        return slot, wd._where.get(key)
    except TypeError:
        raise unhashable(key) from None


def tracked(wd: WatchdogCore, key: object) -> Rec | None:
    """*key*'s record, or None if it is not tracked (lock held); an unhashable key is
    refused. (``heartbeat`` inlines it: a call less per progress event.)"""
    try:
        return wd._where.get(key)
    except TypeError:
        raise unhashable(key) from None


def unknown_state(wd: WatchdogCore, key: object, state: object) -> None:
    """``Watchdog.observe`` of a state the spec does not declare: refused
    (``unknown_state="raise"``) or counted."""
    if wd._options.unknown_state == "raise":
        raise UnknownStateError(
            wd._spec.name, key, state, tuple(s.label for s in wd._slots.values())
        )
    with wd._lock:
        wd._unknown += 1
