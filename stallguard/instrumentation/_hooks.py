"""The instrumentation hook registry (process-wide, like stamina's)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, Union

import attrs

if TYPE_CHECKING:
    from .._details import Expiry
    from .._watchdog import Watchdog

__all__ = [
    "ExpiryHook",
    "ExpiryHookFactory",
    "get_on_expire_hooks",
    "set_on_expire_hooks",
]


class ExpiryHook(Protocol):
    """Called with the frozen :class:`~stallguard.Expiry` of every expiry, enforced or
    reported. Exceptions are logged and counted by the watchdog, never propagated."""

    def __call__(self, expiry: Expiry[Any]) -> object: ...


@attrs.frozen
class ExpiryHookFactory:
    """Wraps a zero-argument callable that builds an :class:`ExpiryHook` the first time
    one is needed, so that importing (say) an OpenTelemetry module costs nothing until
    a request actually expires."""

    hook_factory: Callable[[], ExpiryHook]


HookSpec = Union[ExpiryHook, ExpiryHookFactory]

_lock = threading.Lock()
_configured: tuple[HookSpec, ...] | None = None  # None: the defaults
_resolved: tuple[ExpiryHook, ...] | None = None
_watchdogs: weakref.WeakSet[Watchdog[Any]] = weakref.WeakSet()


def _default_hooks() -> tuple[HookSpec, ...]:
    from ._logging import LoggingOnExpireHook

    hooks: list[HookSpec] = [LoggingOnExpireHook]
    try:
        import opentelemetry.trace  # noqa: F401
    except ImportError:  # pragma: no cover - opentelemetry-api is a dependency
        pass
    else:
        from ._otel import OpenTelemetryOnExpireHook

        hooks.append(OpenTelemetryOnExpireHook)
    return tuple(hooks)


def set_on_expire_hooks(hooks: Iterable[HookSpec] | None) -> None:
    """Set the process-wide instrumentation hooks that see every expiry.

    Args:
        hooks: hooks or :class:`ExpiryHookFactory` instances; ``None`` restores the
            defaults (logging, plus OpenTelemetry when importable); an empty iterable
            disables instrumentation.
    """
    global _configured, _resolved
    configured = None if hooks is None else tuple(hooks)
    if configured is not None:
        for hook in configured:
            if not (isinstance(hook, ExpiryHookFactory) or callable(hook)):
                from .._errors import ConfigError

                raise ConfigError(
                    f"set_on_expire_hooks() takes callables or ExpiryHookFactory "
                    f"instances, got {hook!r}"
                )
    with _lock:
        _configured = configured
        _resolved = None


def get_on_expire_hooks() -> tuple[ExpiryHook, ...]:
    """The active hooks, with factories resolved (which imports what they need)."""
    return _active_hooks()


def _active_hooks() -> tuple[ExpiryHook, ...]:
    global _resolved
    resolved = _resolved
    if resolved is not None:
        return resolved
    with _lock:
        if _resolved is None:
            specs = _default_hooks() if _configured is None else _configured
            _resolved = tuple(
                s.hook_factory() if isinstance(s, ExpiryHookFactory) else s for s in specs
            )
        return _resolved


def _register_watchdog(watchdog: Watchdog[Any]) -> None:
    _watchdogs.add(watchdog)


def live_watchdogs() -> list[Watchdog[Any]]:
    """Every watchdog still alive in this process (for observable metrics)."""
    return list(_watchdogs)
