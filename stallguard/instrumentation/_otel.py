"""The OpenTelemetry span hook (needs only ``opentelemetry-api``)."""

from __future__ import annotations

import time
from typing import Any

from ._hooks import ExpiryHook, ExpiryHookFactory

__all__ = ["OpenTelemetryOnExpireHook", "SPAN_FORCED_FAILURE", "SPAN_STALL_REPORTED"]

SPAN_FORCED_FAILURE = "stallguard.forced_failure"
SPAN_STALL_REPORTED = "stallguard.stall_reported"


def _init_otel_hook() -> ExpiryHook:
    from opentelemetry import context as otel_context
    from opentelemetry import trace

    try:
        from .. import __version__ as version
    except Exception:  # pragma: no cover - metadata missing in a raw checkout
        version = None
    tracer = trace.get_tracer("stallguard", version)
    set_span_in_context = trace.set_span_in_context
    NonRecordingSpan = trace.NonRecordingSpan
    SpanContext = trace.SpanContext
    Link = trace.Link
    Status = trace.Status
    StatusCode = trace.StatusCode

    def _parent(parent: Any) -> Any:
        if parent is None:
            return None
        if isinstance(parent, SpanContext):
            return set_span_in_context(NonRecordingSpan(parent))
        if isinstance(parent, trace.Span):
            return set_span_in_context(parent)
        return parent  # an opentelemetry.context.Context

    def emit_span(expiry: Any) -> None:
        end_ns = time.time_ns()
        start_ns = end_ns - int(expiry.elapsed * 1e9)
        links = [link if isinstance(link, Link) else Link(link) for link in expiry.trace_links]
        attributes = {
            "stallguard.spec": expiry.spec,
            "stallguard.key": str(expiry.key),
            "stallguard.state": expiry.state_label,
            "stallguard.deadline_s": float(expiry.deadline),
            "stallguard.elapsed_s": float(expiry.elapsed),
            "stallguard.reason": expiry.reason,
            "stallguard.mode": expiry.mode,
        }
        attributes.update(expiry.attributes)
        span = tracer.start_span(
            SPAN_FORCED_FAILURE if expiry.enforced else SPAN_STALL_REPORTED,
            context=_parent(expiry.trace_parent) or otel_context.Context(),
            links=links,
            attributes=attributes,
            start_time=start_ns,
        )
        if expiry.enforced:
            span.set_status(Status(StatusCode.ERROR, expiry.describe()))
        span.end(end_time=end_ns)

    return emit_span


#: Emits one span per expiry: ``stallguard.forced_failure`` (status ERROR) in enforce
#: mode, ``stallguard.stall_reported`` in report mode. The span starts when the clock
#: that fired started (state entry, last progress or first sight) and ends at the check.
OpenTelemetryOnExpireHook = ExpiryHookFactory(_init_otel_hook)
