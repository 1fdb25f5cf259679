"""Instrumentation: what happens, besides enforcement, when a request expires.

Every watchdog hands each :class:`~stallguard.Expiry` to the process-wide hooks set
here, in both ``enforce`` and ``report`` mode. By default: a logging hook and, since
``opentelemetry-api`` is a dependency, an OpenTelemetry span hook (a no-op until an SDK
is configured). :func:`set_on_expire_hooks` replaces them; ``None`` restores the
defaults; ``[]`` disables instrumentation.
"""

from ._hooks import (
    ExpiryHook,
    ExpiryHookFactory,
    get_on_expire_hooks,
    live_watchdogs,
    set_on_expire_hooks,
)
from ._hooks import (
    _active_hooks as _active_hooks,
)
from ._hooks import (
    _register_watchdog as _register_watchdog,
)
from ._logging import LoggingOnExpireHook
from ._otel import OpenTelemetryOnExpireHook

__all__ = [
    "ExpiryHook",
    "ExpiryHookFactory",
    "LoggingOnExpireHook",
    "OpenTelemetryOnExpireHook",
    "get_on_expire_hooks",
    "live_watchdogs",
    "set_on_expire_hooks",
]
