"""The OpenTelemetry span hook (needs only ``opentelemetry-api``).

Nothing here imports OpenTelemetry until the first expiry (or an explicit
:func:`~stallguard.instrumentation.get_on_expire_hooks`): the hook is an
:class:`ExpiryHookFactory`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._errors import ConfigError
from ._hooks import ExpiryHook, ExpiryHookFactory

if TYPE_CHECKING:
    from .._details import Expiry

__all__ = [
    "ERROR_TYPES",
    "EVENT_DEADLINE",
    "SPAN_FORCED_FAILURE",
    "SPAN_STALL_REPORTED",
    "OpenTelemetryOnExpireHook",
    "opentelemetry_on_expire_hook",
]

log = logging.getLogger("stallguard")

#: Name of the span emitted for an enforced expiry (status ``ERROR``).
SPAN_FORCED_FAILURE = "stallguard.forced_failure"
#: Name of the span emitted for an expiry in ``report`` mode (status unset).
SPAN_STALL_REPORTED = "stallguard.stall_reported"

#: Name of the span event at the instant the deadline passed (attribute
#: ``stallguard.deadline_s``); the span's ``stallguard.late_s`` says how long after it
#: the check found the request.
EVENT_DEADLINE = "stallguard.deadline"
#: Watchdog-clock readings closer than this (seconds) belong to one check.
_SAME_CHECK = 1e-6

#: The OpenTelemetry instrumentation scope of every span and metric.
INSTRUMENTATION_SCOPE = "stallguard"

#: The ``error.type`` attribute of an enforced expiry's span and counter point, by the
#: expiry's :attr:`~stallguard.Expiry.reason` (OpenTelemetry's recording-errors
#: convention: a low-cardinality, documented value saying which failure it was).
ERROR_TYPES: Mapping[str, str] = {
    "state": "state_deadline_exceeded",
    "stall": "stall_window_exceeded",
    "lifetime": "lifetime_exceeded",
}


def _scope_version() -> str | None:
    try:
        from .. import __version__
    except Exception:  # pragma: no cover - metadata unreadable
        return None
    return str(__version__)


def _init_otel_hook(tracer_provider: Any) -> ExpiryHook:
    from opentelemetry import propagate, trace
    from opentelemetry.context import Context

    tracer = trace.get_tracer(
        INSTRUMENTATION_SCOPE, _scope_version(), tracer_provider=tracer_provider
    )
    start_span = tracer.start_span
    set_span_in_context = trace.set_span_in_context
    get_current_span = trace.get_current_span
    NonRecordingSpan = trace.NonRecordingSpan
    SpanContext = trace.SpanContext
    Span = trace.Span
    Link = trace.Link
    error = trace.StatusCode.ERROR
    time_ns = time.time_ns
    error_types = ERROR_TYPES

    def parent_context(parent: Any) -> Context:
        # Always built on an empty context: a span for a stalled request must not
        # become the child of whatever span is current in the loop that ran check().
        if isinstance(parent, Context):
            return parent
        if isinstance(parent, SpanContext):
            return set_span_in_context(NonRecordingSpan(parent), Context())
        if isinstance(parent, Span):
            return set_span_in_context(parent, Context())
        if isinstance(parent, Mapping):  # a propagation carrier, e.g. W3C traceparent
            return propagate.extract(parent, context=Context())
        log.warning(
            "stallguard: ignoring trace_parent %r: expected an OpenTelemetry Context, "
            "SpanContext, Span, or a propagation carrier mapping",
            parent,
        )
        return Context()

    def link(target: Any) -> Any:
        if isinstance(target, Link):
            return target
        if isinstance(target, SpanContext):
            return Link(target)
        if isinstance(target, Span):
            return Link(target.get_span_context())
        if isinstance(target, Mapping):  # a Context, or a propagation carrier
            ctx = target if isinstance(target, Context) else propagate.extract(target)
            return Link(get_current_span(ctx).get_span_context())
        log.warning(
            "stallguard: ignoring trace link %r: expected an OpenTelemetry Link, "
            "SpanContext, Span, Context, or a propagation carrier mapping",
            target,
        )
        return None

    # One wall-clock reading per check: every span of the check ends at it, and every
    # other instant is placed by its distance from the check's reading on the watchdog
    # clock (start = the recorded entry or heartbeat, the deadline event = start +
    # deadline). The check's reading is entered_at + elapsed, the same for every expiry
    # of a check (to rounding: readings closer than _SAME_CHECK are one check).
    last: list[tuple[float, int]] = [(-math.inf, 0)]

    def end_of(expiry: Expiry[Any]) -> int:
        checked = expiry.entered_at + expiry.elapsed
        seen, end_ns = last[0]
        if abs(checked - seen) > _SAME_CHECK:
            end_ns = time_ns()
            last[0] = (checked, end_ns)
        return end_ns

    def emit_span(expiry: Expiry[Any]) -> None:
        end_ns = end_of(expiry)
        start_ns = end_ns - round(expiry.elapsed * 1e9)
        deadline_ns = start_ns + round(expiry.deadline * 1e9)
        parent = expiry.trace_parent
        links = None
        if expiry.trace_links:
            links = [x for x in map(link, expiry.trace_links) if x is not None]
        attributes: dict[str, Any] = {
            "stallguard.spec": expiry.spec,
            "stallguard.key": str(expiry.key),
            "stallguard.state": expiry.state_label,
            "stallguard.deadline_s": float(expiry.deadline),
            "stallguard.elapsed_s": float(expiry.elapsed),
            "stallguard.late_s": float(expiry.elapsed - expiry.deadline),
            "stallguard.reason": expiry.reason,
            "stallguard.mode": expiry.mode,
        }
        enforced = expiry.mode == "enforce"
        if enforced:
            attributes["error.type"] = error_types[expiry.reason]
        if expiry.attributes:  # the user's first: stallguard's own names win
            attributes = {**expiry.attributes, **attributes}
        span = start_span(
            SPAN_FORCED_FAILURE if enforced else SPAN_STALL_REPORTED,
            context=Context() if parent is None else parent_context(parent),
            attributes=attributes,
            links=links,
            start_time=start_ns,
        )
        if span.is_recording():
            span.add_event(
                EVENT_DEADLINE,
                {"stallguard.deadline_s": float(expiry.deadline)},
                timestamp=deadline_ns,
            )
            if enforced:
                span.set_status(error, expiry.describe())
        span.end(end_time=end_ns)

    return emit_span


def opentelemetry_on_expire_hook(*, tracer_provider: Any = None) -> ExpiryHookFactory:
    """An OpenTelemetry span hook, as a factory for :func:`set_on_expire_hooks`.

    Each expiry emits one span: ``stallguard.forced_failure`` with status ``ERROR`` (and
    :meth:`~stallguard.Expiry.describe` as the status description) in ``enforce`` mode,
    ``stallguard.stall_reported`` with status unset in ``report`` mode. The span is
    back-dated: it starts when the clock that fired started (the state entry for reason
    ``"state"``, the last progress for ``"stall"``, the first sight for ``"lifetime"``)
    and ends at the check, so its duration is :attr:`~stallguard.Expiry.elapsed`. Every
    span of one check ends at the same instant (one wall-clock reading per check), and
    each carries a ``stallguard.deadline`` event at the instant its deadline passed
    (start + deadline, attribute ``stallguard.deadline_s``).

    Attributes: ``stallguard.spec``, ``stallguard.key`` (``str`` of the key),
    ``stallguard.state``, ``stallguard.deadline_s``, ``stallguard.elapsed_s``,
    ``stallguard.late_s`` (how long after the deadline the check found it: elapsed less
    deadline),
    ``stallguard.reason``, ``stallguard.mode``, and on the forced-failure span
    ``error.type`` (:data:`ERROR_TYPES` of the reason), plus the user's attributes from
    :meth:`~stallguard.Watchdog.annotate` (which cannot override stallguard's own).
    The parent is the request's ``trace_parent`` (a ``Context``, ``SpanContext``,
    ``Span``, or a propagation carrier such as
    ``{"traceparent": "00-..."}``); without one the span is a root span, never the child
    of whatever span is current where ``check()`` runs. ``trace_links`` become span links.

    Args:
        tracer_provider: the ``TracerProvider`` to use; None (the default) uses the
            global one, the one current at each expiry. While no SDK is installed the
            global provider is the API's no-op proxy and the hook costs about what the
            API's no-op ``start_span()`` costs: nothing that only a recording span needs
            (the status description) is computed (figures in docs/instrumentation.md).

    Raises:
        ConfigError: if *tracer_provider* has no ``get_tracer()`` method.
    """
    if tracer_provider is not None and not callable(getattr(tracer_provider, "get_tracer", None)):
        raise ConfigError(
            f"opentelemetry_on_expire_hook(tracer_provider=...) must be an OpenTelemetry "
            f"TracerProvider or None, got {tracer_provider!r}"
        )
    return ExpiryHookFactory(lambda: _init_otel_hook(tracer_provider))


#: The OpenTelemetry span hook on the global tracer provider (a default); see
#: :func:`opentelemetry_on_expire_hook` for the span it emits.
OpenTelemetryOnExpireHook = opentelemetry_on_expire_hook()
