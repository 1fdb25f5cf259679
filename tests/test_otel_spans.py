"""The OpenTelemetry span hook, against the real SDK and its in-memory exporter.

Every test passes its own TracerProvider to the hook (no global provider is set, so
nothing leaks between tests), and moves a FakeClock instead of waiting.
"""

from __future__ import annotations

import enum
import logging
import time

import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanKind, StatusCode

import stallguard as sg
from stallguard import instrumentation as si
from stallguard.testing import FakeClock

SPEC = sg.Spec(
    name="kv_sender",
    deadlines={
        "Bootstrapping": 300,
        "WaitingForInput": 120,
        "Transferring": sg.Deadline(120, stall=30),
    },
    terminal=["Success", "Failed"],
    lifetime=600,
)


@pytest.fixture(autouse=True)
def _restore_hooks():
    yield
    si.set_on_expire_hooks(None)


@pytest.fixture
def provider():
    provider = TracerProvider()
    yield provider
    provider.shutdown()


@pytest.fixture
def exporter(provider):
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    si.set_on_expire_hooks([si.opentelemetry_on_expire_hook(tracer_provider=provider)])
    return exporter


def checked(watchdog: sg.Watchdog) -> tuple[list[sg.Expiry], int, int]:
    """Run check() and return the expiries with the wall time (epoch ns) around it."""
    before = time.time_ns()
    expiries = watchdog.check()
    after = time.time_ns()
    return expiries, before, after


def test_forced_failure_span(exporter):
    clock = FakeClock(5_000.0)
    watchdog = sg.Watchdog(SPEC, clock=clock)
    watchdog.observe(42, "Bootstrapping")
    clock.advance(10)
    watchdog.observe(42, "WaitingForInput")
    clock.advance(121.25)
    (expiry,), before, after = checked(watchdog)

    (span,) = exporter.get_finished_spans()
    assert span.name == "stallguard.forced_failure"
    assert span.kind is SpanKind.INTERNAL
    assert span.instrumentation_scope.name == "stallguard"
    assert dict(span.attributes) == {
        "stallguard.spec": "kv_sender",
        "stallguard.key": "42",
        "stallguard.state": "WaitingForInput",
        "stallguard.deadline_s": 120.0,
        "stallguard.elapsed_s": 121.25,
        "stallguard.late_s": 1.25,
        "stallguard.reason": "state",
        "stallguard.mode": "enforce",
        "error.type": "state_deadline_exceeded",  # OpenTelemetry's recording-errors convention
    }
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == expiry.describe()
    assert "WaitingForInput for 121.250s, past its 120s deadline" in span.status.description
    # Back-dated: it starts when the request entered WaitingForInput, 121.25 s before
    # the check (not when the request was first seen, 131.25 s before), and ends at it.
    assert before <= span.end_time <= after
    assert span.end_time - span.start_time == 121_250_000_000
    assert span.parent is None  # no trace_parent: a root span


def test_report_mode_span_is_stall_reported_with_status_unset(exporter):
    clock = FakeClock()
    watchdog = sg.Watchdog(SPEC, clock=clock, mode="report")
    watchdog.observe("r", "WaitingForInput")
    clock.advance(125)
    assert len(watchdog.check()) == 1
    clock.advance(1)
    assert watchdog.check() == []  # reported once per deadline

    (span,) = exporter.get_finished_spans()
    assert span.name == "stallguard.stall_reported"
    assert span.status.status_code is StatusCode.UNSET
    assert span.attributes["stallguard.mode"] == "report"
    assert span.attributes["stallguard.state"] == "WaitingForInput"
    assert "error.type" not in span.attributes  # nothing failed
    assert span.end_time - span.start_time == 125_000_000_000
    assert "r" in watchdog  # report mode fails nothing


def test_stall_span_starts_at_the_last_progress(exporter):
    clock = FakeClock()
    watchdog = sg.Watchdog(SPEC, clock=clock)
    watchdog.observe("t", "Transferring")
    clock.advance(20)
    watchdog.heartbeat("t")
    clock.advance(30.5)
    _, before, after = checked(watchdog)

    (span,) = exporter.get_finished_spans()
    assert span.attributes["stallguard.reason"] == "stall"
    assert span.attributes["error.type"] == "stall_window_exceeded"
    assert span.attributes["stallguard.deadline_s"] == 30.0
    assert span.attributes["stallguard.elapsed_s"] == 30.5
    assert before <= span.end_time <= after
    assert span.end_time - span.start_time == 30_500_000_000


def test_lifetime_span_starts_at_first_sight(exporter):
    clock = FakeClock()
    watchdog = sg.Watchdog(SPEC, clock=clock)
    watchdog.observe("l", "Bootstrapping")
    for state in ("WaitingForInput", "Bootstrapping") * 3:
        clock.advance(90)
        watchdog.observe("l", state)  # every state change in time
    clock.advance(61)  # 601 s since first sight
    assert len(watchdog.check()) == 1

    (span,) = exporter.get_finished_spans()
    assert span.attributes["stallguard.reason"] == "lifetime"
    assert span.attributes["error.type"] == "lifetime_exceeded"
    assert span.attributes["stallguard.deadline_s"] == 600.0
    assert span.attributes["stallguard.state"] == "Bootstrapping"
    assert span.end_time - span.start_time == 601_000_000_000


def test_user_attributes_are_added_but_cannot_override(exporter):
    clock = FakeClock()
    watchdog = sg.Watchdog(SPEC, clock=clock)
    watchdog.observe(("room", 9), "Bootstrapping")
    watchdog.annotate(
        ("room", 9),
        attributes={
            "sglang.rid": "abc",
            "sglang.bootstrap_room": 9,
            "stallguard.state": "X",
            "error.type": "mine",
        },
    )
    watchdog.annotate(("room", 9), attributes={"sglang.disagg": True})  # merged
    clock.advance(300)
    watchdog.check()

    (span,) = exporter.get_finished_spans()
    assert span.attributes["sglang.rid"] == "abc"
    assert span.attributes["sglang.bootstrap_room"] == 9
    assert span.attributes["sglang.disagg"] is True
    assert span.attributes["stallguard.state"] == "Bootstrapping"
    assert span.attributes["error.type"] == "state_deadline_exceeded"
    assert span.attributes["stallguard.key"] == "('room', 9)"


def test_enum_states_are_labelled_by_name(exporter):
    class KVPoll(enum.IntEnum):
        Failed = 0
        Bootstrapping = 1
        WaitingForInput = 2
        Transferring = 3
        Success = 4

    spec = sg.Spec(
        name="kvpoll",
        deadlines={KVPoll.Bootstrapping: 5, KVPoll.WaitingForInput: 5, KVPoll.Transferring: 5},
        terminal=[KVPoll.Success, KVPoll.Failed],
    )
    clock = FakeClock()
    watchdog = sg.Watchdog(spec, clock=clock)
    watchdog.observe(1, KVPoll.Transferring)
    clock.advance(5)
    watchdog.check()
    (span,) = exporter.get_finished_spans()
    assert span.attributes["stallguard.state"] == "Transferring"


def _parent_forms(parent_span):
    ctx = parent_span.get_span_context()
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(parent_span))
    return {
        "SpanContext": ctx,
        "Context": trace.set_span_in_context(parent_span),
        "Span": parent_span,
        "carrier": carrier,
    }


@pytest.mark.parametrize("form", ["SpanContext", "Context", "Span", "carrier"])
def test_trace_parent_forms(provider, exporter, form):
    request_span = provider.get_tracer("app").start_span("kv_transfer")
    parent = _parent_forms(request_span)[form]
    clock = FakeClock()
    watchdog = sg.Watchdog(SPEC, clock=clock)
    watchdog.observe("p", "Bootstrapping")
    assert watchdog.annotate("p", trace_parent=parent)
    clock.advance(300)
    watchdog.check()
    request_span.end()

    failure = next(s for s in exporter.get_finished_spans() if s.name.startswith("stallguard"))
    expected = request_span.get_span_context()
    assert failure.parent is not None
    assert failure.parent.span_id == expected.span_id
    assert failure.context.trace_id == expected.trace_id


def test_without_a_parent_the_current_span_is_not_adopted(provider, exporter):
    clock = FakeClock()
    watchdog = sg.Watchdog(SPEC, clock=clock)
    watchdog.observe("q", "Bootstrapping")
    clock.advance(300)
    with provider.get_tracer("app").start_as_current_span("scheduler_loop"):
        watchdog.check()
    failure = next(s for s in exporter.get_finished_spans() if s.name.startswith("stallguard"))
    assert failure.parent is None


def test_trace_links(provider, exporter):
    tracer = provider.get_tracer("app")
    spans = [tracer.start_span(f"peer{i}") for i in range(4)]
    contexts = [s.get_span_context() for s in spans]
    clock = FakeClock()
    watchdog = sg.Watchdog(SPEC, clock=clock)
    watchdog.observe("k", "Bootstrapping")
    watchdog.annotate(
        "k",
        trace_links=[
            contexts[0],
            spans[1],
            Link(contexts[2], {"link.role": "decode"}),
            trace.set_span_in_context(spans[3]),
        ],
    )
    clock.advance(300)
    watchdog.check()

    (failure,) = [s for s in exporter.get_finished_spans() if s.name.startswith("stallguard")]
    assert [link.context.span_id for link in failure.links] == [c.span_id for c in contexts]
    assert dict(failure.links[2].attributes) == {"link.role": "decode"}


def test_a_bad_trace_parent_still_gives_a_root_span(exporter, caplog):
    clock = FakeClock()
    watchdog = sg.Watchdog(SPEC, clock=clock)
    watchdog.observe("b", "Bootstrapping")
    watchdog.annotate("b", trace_parent=12345, trace_links=["not-a-span"])
    clock.advance(300)
    with caplog.at_level(logging.WARNING, logger="stallguard"):
        watchdog.check()
    (span,) = exporter.get_finished_spans()
    assert span.parent is None
    assert span.links == ()
    messages = [r.getMessage() for r in caplog.records]
    assert any("ignoring trace_parent 12345" in m for m in messages)
    assert any("ignoring trace link 'not-a-span'" in m for m in messages)
    assert watchdog.snapshot().hook_errors == 0


def test_one_span_per_expiry_in_a_batch(exporter):
    clock = FakeClock()
    watchdog = sg.Watchdog(SPEC, clock=clock)
    for key in range(5):
        watchdog.observe(key, "Bootstrapping")
        clock.advance(1)
    clock.advance(300)
    expiries = watchdog.check()
    spans = exporter.get_finished_spans()
    assert [s.attributes["stallguard.key"] for s in spans] == [str(e.key) for e in expiries]
    assert [s.attributes["stallguard.elapsed_s"] for s in spans] == [e.elapsed for e in expiries]
    assert len({s.context.span_id for s in spans}) == 5


def test_tracer_provider_is_validated():
    with pytest.raises(sg.ConfigError, match=r"tracer_provider=.*got 'otel'"):
        si.opentelemetry_on_expire_hook(tracer_provider="otel")


def test_two_thousand_expiries_in_one_check_share_one_end_and_exact_deadline_events(exporter):
    """Issue 22: every span of one check ends at one reading; each starts exactly at its
    recorded entry or heartbeat and has a deadline event at the deadline instant, to the
    millisecond, however long 2,000 spans take to emit. (With one wall-clock reading per
    span, as before, the ends differ: the control below.)"""
    clock = FakeClock(10_000.0)
    watchdog = sg.Watchdog(SPEC, clock=clock)
    expected: dict[str, tuple[float, float]] = {}  # key -> (clock start, deadline)
    states = ("Bootstrapping", "WaitingForInput", "Transferring")
    for i in range(2_000):
        key = f"r{i}"
        state = states[i % 3]
        watchdog.observe(key, state)
        start = clock()
        if state == "Transferring" and i % 2:
            clock.advance(0.25)
            watchdog.heartbeat(key)  # the stall window restarts here
            start = clock()
        deadline = {"Bootstrapping": 300.0, "WaitingForInput": 120.0, "Transferring": 30.0}[state]
        expected[key] = (start, deadline)
        clock.advance(0.0173 * (1 + i % 7))  # patterned, uneven entry times
    clock.advance(300.0)
    now = clock()
    expiries = watchdog.check()
    assert len(expiries) == 2_000

    spans = exporter.get_finished_spans()
    assert len(spans) == 2_000
    (end,) = {span.end_time for span in spans}  # one end for the whole check
    for span in spans:
        start, deadline = expected[span.attributes["stallguard.key"]]
        # instants on the watchdog clock, placed by their distance from the check
        want_start = end - round((now - start) * 1e9)
        want_deadline = end - round((now - start - deadline) * 1e9)
        assert abs(span.start_time - want_start) < 1_000_000
        (event,) = [e for e in span.events if e.name == si.EVENT_DEADLINE]
        assert abs(event.timestamp - want_deadline) < 1_000_000
        assert event.attributes["stallguard.deadline_s"] == deadline
        assert span.attributes["stallguard.deadline_s"] == deadline
        assert span.attributes["stallguard.late_s"] == pytest.approx(now - start - deadline)
    # the deadline events are as spread as the entries were (not all at one instant)
    assert len({e.timestamp for span in spans for e in span.events}) > 1_000

    # Control: the same spans with a wall-clock reading each (the hook before issue 22)
    # do not agree on their end.
    ends = []
    for _ in expiries:
        ends.append(time.time_ns())
        exporter.get_finished_spans()  # some work between two spans, as exporting is
    assert len(set(ends)) > 1


def test_hooks_are_built_before_the_check_reads_the_clock(exporter):
    """A hook factory built at a process's first expiry (OpenTelemetry's import) runs
    before the reading the check measures its expiries from, so its time never shifts
    the spans: here the factory takes 5 s of the watchdog's clock."""
    clock = FakeClock()
    built = []

    def slow_factory():
        clock.advance(5.0)  # what a slow import costs, on the watchdog's clock
        built.append(clock())
        return lambda expiry: None

    si.set_on_expire_hooks([si.ExpiryHookFactory(slow_factory)])
    watchdog = sg.Watchdog(SPEC, clock=clock)
    watchdog.observe("x", "WaitingForInput")
    clock.advance(121.0)
    (expiry,) = watchdog.check()
    assert built == [126.0]
    assert expiry.elapsed == 126.0  # measured from a reading after the factory ran


def test_default_hooks_are_built_with_the_watchdog_once_opentelemetry_is_imported():
    """No first-expiry delay: with the default hooks and OpenTelemetry already imported
    (as here), a new watchdog builds the hooks; a custom factory stays lazy."""
    from stallguard import _registry

    si.set_on_expire_hooks(None)
    assert not _registry.resolved()
    sg.Watchdog(SPEC, clock=FakeClock())
    assert _registry.resolved()

    si.set_on_expire_hooks([si.ExpiryHookFactory(lambda: lambda expiry: None)])
    sg.Watchdog(SPEC, clock=FakeClock())
    assert not _registry.resolved()  # (tests/test_instrumentation.py: lazily, once)
