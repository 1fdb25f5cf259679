"""The span stallguard emits when it force-fails a request, printed to the console.

Run it: ``python examples/otel_console.py`` (needs ``opentelemetry-sdk``).

The application installs an OpenTelemetry SDK the usual way (a global TracerProvider,
here exporting to the console); stallguard's default span hook picks it up, nothing to
configure on the stallguard side. A KV transfer request carries its own trace (SGLang
keeps one per request): the watchdog is told its span context with ``annotate()``, so
the failure span lands in the request's trace, as a child of its span.

The request stalls in Transferring. Instead of waiting two minutes for its deadline,
the example moves the watchdog's clock by hand (``FakeClock``) and dates the request
span as if the two minutes had really passed: the trace looks like the real thing.

Standard output: the spans, as JSON (first ``stallguard.forced_failure``, then the
request's ``kv_transfer``). Standard error: stallguard's log line and a summary.
"""

from __future__ import annotations

import logging
import sys
import time

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

import stallguard
from stallguard.testing import FakeClock

SPEC = stallguard.Spec(
    name="kv_sender",
    deadlines={"Bootstrapping": 300, "WaitingForInput": 120, "Transferring": 120},
    terminal=["Success", "Failed"],
)
# The request's life: each state and how long it stays there. Transferring never ends:
# its decode peer froze. 121 s there is 1 s past the 120 s deadline.
LIFE = [("Bootstrapping", 0.2), ("WaitingForInput", 0.3), ("Transferring", 121.0)]


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    provider = TracerProvider(resource=Resource.create({"service.name": "prefill-server"}))
    provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)

    clock = FakeClock()  # stands in for time.monotonic: moved by hand, no waiting
    watchdog = stallguard.Watchdog(SPEC, clock=clock)

    # The request's own span, dated as if the request had started the whole LIFE ago.
    lived_ns = int(sum(seconds for _, seconds in LIFE) * 1e9)
    request_span = trace.get_tracer("example.prefill").start_span(
        "kv_transfer",
        attributes={"sglang.bootstrap_room": 7},
        start_time=time.time_ns() - lived_ns,
    )

    room = 7
    for state, seconds in LIFE:
        watchdog.observe(room, state)
        if state == "Bootstrapping":
            watchdog.annotate(
                room,
                attributes={"sglang.bootstrap_room": room, "sglang.rid": "req-7"},
                trace_parent=request_span.get_span_context(),
            )
        clock.advance(seconds)

    for expiry in watchdog.check():  # the scheduler loop's check: one request overdue
        # Failing the request the way its owner fails requests, here: ending its span.
        request_span.set_status(trace.StatusCode.ERROR, expiry.describe())
        request_span.end()
        print(f"failed room {expiry.key}: {expiry.describe()}", file=sys.stderr)

    provider.shutdown()
    return 0 if watchdog.expired(room) else 1


if __name__ == "__main__":
    sys.exit(main())
