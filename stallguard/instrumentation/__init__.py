"""Instrumentation: what happens, besides enforcement, when a request expires.

Every watchdog hands each :class:`~stallguard.Expiry` to the process-wide hooks set
here, in both ``enforce`` and ``report`` mode, after its own ``on_expire``. The defaults
are chosen by what is importable: :data:`LoggingOnExpireHook` always, and
:data:`OpenTelemetryOnExpireHook` when ``opentelemetry`` is importable (it is a
dependency; a no-op until the application installs an SDK).

* :func:`set_on_expire_hooks` replaces them; ``None`` restores the defaults; ``[]``
  disables them. :func:`get_on_expire_hooks` returns them.
* :func:`opentelemetry_on_expire_hook` builds a span hook on an explicit tracer
  provider.
* :func:`enable_metrics` / :func:`disable_metrics` switch the OpenTelemetry metrics
  (expiry counter, state duration histogram, per-state gauges), off by default.

See docs/instrumentation.md.
"""

from ._hooks import (
    ExpiryHook,
    ExpiryHookFactory,
    get_on_expire_hooks,
    live_watchdogs,
    set_on_expire_hooks,
)
from ._logging import LoggingOnExpireHook
from ._metrics import (
    DEFAULT_STATE_DURATION_BUCKETS,
    METRIC_EXPIRIES,
    METRIC_OLDEST_AGE,
    METRIC_REQUEST_COUNT,
    METRIC_REQUESTS,
    METRIC_RUNNER_ERRORS,
    METRIC_STATE_DURATION,
    disable_metrics,
    enable_metrics,
)
from ._otel import (
    ERROR_TYPES,
    EVENT_DEADLINE,
    INSTRUMENTATION_SCOPE,
    SPAN_FORCED_FAILURE,
    SPAN_STALL_REPORTED,
    OpenTelemetryOnExpireHook,
    opentelemetry_on_expire_hook,
)

__all__ = [
    "DEFAULT_STATE_DURATION_BUCKETS",
    "ERROR_TYPES",
    "EVENT_DEADLINE",
    "INSTRUMENTATION_SCOPE",
    "METRIC_EXPIRIES",
    "METRIC_OLDEST_AGE",
    "METRIC_REQUESTS",
    "METRIC_REQUEST_COUNT",
    "METRIC_RUNNER_ERRORS",
    "METRIC_STATE_DURATION",
    "SPAN_FORCED_FAILURE",
    "SPAN_STALL_REPORTED",
    "ExpiryHook",
    "ExpiryHookFactory",
    "LoggingOnExpireHook",
    "OpenTelemetryOnExpireHook",
    "disable_metrics",
    "enable_metrics",
    "get_on_expire_hooks",
    "live_watchdogs",
    "opentelemetry_on_expire_hook",
    "set_on_expire_hooks",
]
