"""``Watchdog.guard``: a decorator that watches a ``poll()``-style function."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, cast

from ._errors import ConfigError, UnknownStateError
from ._fifo import EXPIRED
from ._spec import State, state_label
from ._validate import unhashable

if TYPE_CHECKING:
    from ._watchdog import Watchdog

__all__ = ["guard"]

K = TypeVar("K", bound=Hashable)
P = ParamSpec("P")
R = TypeVar("R")

_MISSING: Any = object()


def _state_map(
    wd: Watchdog[Any], state: Callable[[Any], State] | Mapping[Any, State] | None
) -> tuple[Callable[[Any], State] | None, tuple[str, ...]]:
    """``guard(state=...)`` as a function (None: the value itself) and how an error
    lists the known values."""
    slots = wd._slots
    if isinstance(state, Mapping):
        mapping = dict(state)
        for value in mapping.values():
            try:
                known = value in slots
            except TypeError:
                known = False
            if not known:
                raise ConfigError(
                    f"guard(state=...) maps to {value!r}, which spec "
                    f"{wd._spec.name!r} does not declare"
                )
        shown = tuple(f"{v!r} -> {state_label(st)}" for v, st in mapping.items())
        return mapping.__getitem__, shown
    if state is None or callable(state):
        return state, tuple(s.label for s in slots.values())
    raise ConfigError(f"guard(state=...) must be a mapping or a callable, got {state!r}")


def guard(
    self: Watchdog[K],
    *,
    key: Callable[..., K],
    failed: Any,
    state: Callable[[Any], State] | Mapping[Any, State] | None = None,
    check: bool = True,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a ``poll()``-style function or method that returns a state.

    Each call observes the returned state for ``key(*args, **kwargs)`` (for a method,
    the instance comes first); with *check* it then runs :meth:`check` (one
    comparison when nothing is due). Once the key has been force-failed, the wrapper
    returns *failed* instead of whatever the poll returned, every time it is called
    (while the key is remembered). Terminal results untrack the key.

    Args:
        key: maps the call's arguments to the request key.
        failed: what to return for a force-failed request (SGLang: ``KVPoll.Failed``).
        state: maps the returned value to a spec state: a mapping or a callable
            (SGLang's ``KVPoll`` returns plain ints). Default: the value itself.
        check: run the deadline check on every call.

    The wrapped poll raises :class:`~stallguard.UnknownStateError` for a value that
    maps to no declared state (also an unhashable one).

    Example::

        @watchdog.guard(key=lambda self: self.room, failed=KVPoll.Failed,
                        state={0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput",
                               3: "Transferring", 4: "Success"})
        def poll(self) -> int: ...
    """
    return _wrap(self, key, failed, state, check)


def _wrap(
    wd: Watchdog[K],
    key: Callable[..., K],
    failed: Any,
    state: Callable[[Any], State] | Mapping[Any, State] | None,
    check: bool,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """:meth:`Watchdog.guard`'s decorator."""
    if not callable(key):
        raise ConfigError(f"guard(key=...) must be a callable, got {key!r}")
    to_state, known_values = _state_map(wd, state)
    where = wd._where
    slots = wd._slots
    spec_name = wd._spec.name
    gone = wd._gone
    observe = wd.observe
    expire = wd._expire
    clock = wd._clock

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def guarded(arg: Any = _MISSING, /, *args: Any, **kwargs: Any) -> Any:
            # A poll is nearly always called with one argument (poll(self)); calling
            # fn and key with it directly, not through (*args, **kwargs), saves
            # ~0.15 µs per call (CPython 3.11).
            if arg is _MISSING or args or kwargs:
                if arg is not _MISSING:
                    args = (arg, *args)
                result = fn(*args, **kwargs)
                k = key(*args, **kwargs)
            else:
                result = fn(arg)  # type: ignore[call-arg]
                k = key(arg)
            s: Any
            if to_state is None:
                s = result
            else:
                try:
                    s = to_state(result)
                except (KeyError, TypeError) as exc:  # unmapped, or unhashable
                    raise UnknownStateError(spec_name, k, result, known_values) from exc
            try:
                slot = slots.get(s)
            except TypeError:
                raise UnknownStateError(spec_name, k, result, known_values) from None
            try:
                rec = where.get(k)
            except TypeError:
                raise unhashable(k) from None
            if rec is not None and rec.slot is slot:
                # tracked in this state already: not failed (unless this check does)
                if not check:
                    return result
                now = clock()
                try:
                    if now < wd._next_due:
                        return result
                except TypeError:  # a bad reading: refused by _expire, as in check()
                    pass
                expire(now, True)
            else:
                observe(k, s)
                if check:
                    now = clock()
                    try:
                        due = not now < wd._next_due
                    except TypeError:
                        due = True
                    if due:
                        expire(now, True)
            if gone.get(k) is EXPIRED:
                return failed
            return result

        return cast("Callable[P, R]", guarded)

    return decorate
