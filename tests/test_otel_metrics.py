"""OpenTelemetry metrics (enable_metrics), against the real SDK and its in-memory reader.

Every test passes its own MeterProvider (no global provider is set), uses spec names of
its own (the gauges read every live watchdog of the process), and moves a FakeClock.
"""

from __future__ import annotations

import gc
import itertools
import math
import weakref
from collections import Counter

import pytest
from _profiles import at_least
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import stallguard as sg
from stallguard import instrumentation as si
from stallguard.testing import FakeClock


@pytest.fixture(autouse=True)
def _restore():
    si.disable_metrics()
    yield
    si.disable_metrics()
    si.set_on_expire_hooks(None)


@pytest.fixture
def reader():
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    si.set_on_expire_hooks([])  # metrics only: no logging noise, no spans
    si.enable_metrics(provider)
    yield reader
    provider.shutdown()


def spec(name: str) -> sg.Spec:
    return sg.Spec(
        name=name,
        deadlines={"Bootstrapping": 300, "Transferring": sg.Deadline(120, stall=30)},
        terminal=["Success", "Failed"],
    )


def points(reader: InMemoryMetricReader, name: str, spec_name: str) -> dict:
    """attributes (without the spec) -> data point, for one metric and one spec."""
    found = {}
    data = reader.get_metrics_data()
    for resource_metrics in data.resource_metrics if data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            assert scope_metrics.scope.name == "stallguard"
            for metric in scope_metrics.metrics:
                if metric.name != name:
                    continue
                for point in metric.data.data_points:
                    attributes = dict(point.attributes)
                    if attributes.pop("stallguard.spec") == spec_name:
                        found[tuple(sorted(attributes.items()))] = point
    return found


def by_state(found: dict) -> dict:
    return {dict(k)["stallguard.state"]: v for k, v in found.items()}


def test_expiry_counter_by_spec_state_reason_mode(reader):
    clock = FakeClock()
    enforcing = sg.Watchdog(spec("m_count"), clock=clock)
    reporting = sg.Watchdog(spec("m_count"), clock=clock, mode="report")
    for watchdog in (enforcing, reporting):
        watchdog.observe("a", "Bootstrapping")
        watchdog.observe("b", "Bootstrapping")
        watchdog.observe("c", "Transferring")
    clock.advance(300)
    expiries = enforcing.check() + reporting.check()

    found = points(reader, si.METRIC_EXPIRIES, "m_count")
    counted = {
        (dict(k)["stallguard.mode"], dict(k)["stallguard.reason"], dict(k)["stallguard.state"]): (
            p.value
        )
        for k, p in found.items()
    }
    # error.type (OpenTelemetry's recording-errors convention) on the enforced ones only
    error_types = {
        (dict(k)["stallguard.mode"], dict(k)["stallguard.reason"]): dict(k).get("error.type")
        for k in found
    }
    assert error_types == {
        ("enforce", "state"): "state_deadline_exceeded",
        ("enforce", "stall"): "stall_window_exceeded",
        ("report", "state"): None,
        ("report", "stall"): None,
    }
    # Exactly what check() returned, grouped by mode, reason and state...
    assert counted == Counter((e.mode, e.reason, e.state_label) for e in expiries)
    # ...which, in enforce mode, is one expiry per request.
    assert {k: v for k, v in counted.items() if k[0] == "enforce"} == {
        ("enforce", "state", "Bootstrapping"): 2,
        ("enforce", "stall", "Transferring"): 1,
    }
    assert {k for k in counted if k[0] == "report"} >= {
        ("report", "state", "Bootstrapping"),
        ("report", "stall", "Transferring"),
    }


def test_counter_is_kept_when_hooks_are_replaced_or_disabled(reader):
    seen = []
    si.set_on_expire_hooks([seen.append])
    si.set_on_expire_hooks([])
    clock = FakeClock()
    watchdog = sg.Watchdog(spec("m_keep"), clock=clock)
    watchdog.observe("a", "Bootstrapping")
    clock.advance(300)
    watchdog.check()
    (point,) = points(reader, si.METRIC_EXPIRIES, "m_keep").values()
    assert point.value == 1
    assert seen == []


def test_state_duration_histogram(reader):
    clock = FakeClock()
    watchdog = sg.Watchdog(spec("m_hist"), clock=clock)
    watchdog.observe("a", "Bootstrapping")
    watchdog.observe("b", "Bootstrapping")
    watchdog.observe("c", "Bootstrapping")
    clock.advance(2)
    watchdog.observe("a", "Transferring")  # left Bootstrapping after 2 s
    clock.advance(0.5)
    watchdog.forget("b")  # left Bootstrapping after 2.5 s
    watchdog.heartbeat("a")
    clock.advance(25)
    watchdog.observe("a", "Success")  # left Transferring after 25.5 s
    clock.advance(275)
    assert [e.key for e in watchdog.check()] == ["c"]  # left Bootstrapping after 302.5 s

    found = by_state(points(reader, si.METRIC_STATE_DURATION, "m_hist"))
    boot, transferring = found["Bootstrapping"], found["Transferring"]
    assert (boot.count, boot.sum, boot.min, boot.max) == (3, 2 + 2.5 + 302.5, 2, 302.5)
    assert (transferring.count, transferring.sum) == (1, 25.5)
    bounds = list(si.DEFAULT_STATE_DURATION_BUCKETS)
    assert list(boot.explicit_bounds) == bounds
    expected = [0] * (len(bounds) + 1)
    for value in (2, 2.5, 302.5):
        expected[next((i for i, b in enumerate(bounds) if value <= b), len(bounds))] += 1
    assert list(boot.bucket_counts) == expected
    assert expected[bounds.index(2.5)] == 2  # (1, 2.5] holds 2 and 2.5


def test_custom_buckets():
    reader = InMemoryMetricReader()
    si.set_on_expire_hooks([])
    si.enable_metrics(MeterProvider(metric_readers=[reader]), state_duration_buckets=[1, 10, 100])
    clock = FakeClock()
    watchdog = sg.Watchdog(spec("m_buckets"), clock=clock)
    watchdog.observe("a", "Bootstrapping")
    clock.advance(50)
    watchdog.observe("a", "Failed")
    (point,) = points(reader, si.METRIC_STATE_DURATION, "m_buckets").values()
    assert list(point.explicit_bounds) == [1, 10, 100]
    assert list(point.bucket_counts) == [0, 0, 1, 0]


def test_gauges_sum_counts_and_max_ages_over_a_specs_watchdogs(reader):
    clock_one, clock_two = FakeClock(100), FakeClock(7000)
    one = sg.Watchdog(spec("m_gauge"), clock=clock_one)  # e.g. one per engine
    two = sg.Watchdog(spec("m_gauge"), clock=clock_two)
    other = sg.Watchdog(spec("m_gauge_other"), clock=clock_one)
    one.observe("a", "Bootstrapping")
    clock_one.advance(40)
    one.observe("b", "Bootstrapping")
    two.observe("c", "Bootstrapping")
    clock_two.advance(10)
    other.observe("z", "Transferring")
    clock_one.advance(5)

    requests = by_state(points(reader, si.METRIC_REQUEST_COUNT, "m_gauge"))
    ages = by_state(points(reader, si.METRIC_OLDEST_AGE, "m_gauge"))
    assert {s: p.value for s, p in requests.items()} == {"Bootstrapping": 3, "Transferring": 0}
    # oldest: "a", 45 s on one's clock ("c" is 10 s old on two's)
    assert {s: p.value for s, p in ages.items()} == {"Bootstrapping": 45, "Transferring": 0}
    other_requests = by_state(points(reader, si.METRIC_REQUEST_COUNT, "m_gauge_other"))
    assert {s: p.value for s, p in other_requests.items()} == {
        "Bootstrapping": 0,
        "Transferring": 1,
    }
    assert len(one) + len(two) == 3


def test_live_and_future_watchdogs_get_the_recorder():
    clock = FakeClock()
    before = sg.Watchdog(spec("m_live"), clock=clock)
    assert not before.listeners  # metrics are off by default
    reader = InMemoryMetricReader()
    si.set_on_expire_hooks([])
    si.enable_metrics(MeterProvider(metric_readers=[reader]))
    after = sg.Watchdog(spec("m_live"), clock=clock)
    for watchdog in (before, after):
        watchdog.observe("a", "Bootstrapping")
    clock.advance(3)
    for watchdog in (before, after):
        watchdog.observe("a", "Transferring")
    (point,) = points(reader, si.METRIC_STATE_DURATION, "m_live").values()
    assert (point.count, point.sum) == (2, 6)


def test_a_watchdog_made_while_metrics_are_on_is_freed(reader):
    """The metrics hold their watchdogs weakly: one dropped is freed (its recorder was
    once kept as the Listener, which holds its watchdog, so none ever was)."""
    gone = []
    watchdog = sg.Watchdog(spec("m_freed"))
    watchdog.observe("a", "Bootstrapping")
    assert watchdog.listeners
    ref = weakref.ref(watchdog, gone.append)
    del watchdog
    gc.collect()
    assert ref() is None and len(gone) == 1


def test_someone_elses_on_leave_listens_beside_the_metrics():
    clock = FakeClock()
    watchdog = sg.Watchdog(spec("m_foreign"), clock=clock)
    left = []
    theirs = watchdog.add_listener(on_leave=lambda state, seconds: left.append((state, seconds)))
    reader = InMemoryMetricReader()
    si.enable_metrics(MeterProvider(metric_readers=[reader]))
    watchdog.observe("a", "Bootstrapping")
    clock.advance(4)
    watchdog.observe("a", "Success")
    assert left == [("Bootstrapping", 4)]
    (point,) = points(reader, si.METRIC_STATE_DURATION, "m_foreign").values()
    assert (point.count, point.sum) == (1, 4)
    si.disable_metrics()
    assert watchdog.listeners == (theirs,)  # still theirs


def test_disable_metrics(reader):
    clock = FakeClock()
    watchdog = sg.Watchdog(spec("m_off"), clock=clock)
    watchdog.observe("a", "Bootstrapping")
    watchdog.observe("b", "Bootstrapping")
    clock.advance(300)
    watchdog.check()
    assert watchdog.listeners
    si.disable_metrics()
    si.disable_metrics()  # idempotent
    assert not watchdog.listeners
    assert not sg.Watchdog(spec("m_off"), clock=clock).listeners
    watchdog.observe("c", "Bootstrapping")
    clock.advance(300)
    watchdog.check()

    counted = points(reader, si.METRIC_EXPIRIES, "m_off")
    assert [p.value for p in counted.values()] == [2]  # the third was not counted
    (duration,) = points(reader, si.METRIC_STATE_DURATION, "m_off").values()
    assert duration.count == 2
    assert points(reader, si.METRIC_REQUEST_COUNT, "m_off") == {}  # observables: nothing
    assert points(reader, si.METRIC_REQUESTS, "m_off") == {}
    assert points(reader, si.METRIC_OLDEST_AGE, "m_off") == {}


def test_enable_again_moves_everything_to_the_new_provider(reader):
    clock = FakeClock()
    watchdog = sg.Watchdog(spec("m_again"), clock=clock)
    watchdog.observe("a", "Bootstrapping")
    new_reader = InMemoryMetricReader()
    si.enable_metrics(MeterProvider(metric_readers=[new_reader]))
    clock.advance(300)
    watchdog.check()
    assert points(reader, si.METRIC_EXPIRIES, "m_again") == {}
    assert points(reader, si.METRIC_STATE_DURATION, "m_again") == {}
    assert [p.value for p in points(new_reader, si.METRIC_EXPIRIES, "m_again").values()] == [1]
    (duration,) = points(new_reader, si.METRIC_STATE_DURATION, "m_again").values()
    assert duration.sum == 300


def test_enable_twice_on_one_provider_keeps_every_metric():
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    si.set_on_expire_hooks([])
    si.enable_metrics(provider)
    si.enable_metrics(provider)
    clock = FakeClock()
    watchdog = sg.Watchdog(spec("m_twice"), clock=clock)
    watchdog.observe("a", "Bootstrapping")
    watchdog.observe("b", "Bootstrapping")
    clock.advance(300)
    assert len(watchdog.check()) == 2
    watchdog.observe("c", "Transferring")
    clock.advance(1)
    assert [p.value for p in points(reader, si.METRIC_EXPIRIES, "m_twice").values()] == [2]
    (duration,) = points(reader, si.METRIC_STATE_DURATION, "m_twice").values()
    assert duration.count == 2  # each transition recorded once, not twice
    requests = by_state(points(reader, si.METRIC_REQUEST_COUNT, "m_twice"))
    assert {s: p.value for s, p in requests.items()} == {"Bootstrapping": 0, "Transferring": 1}
    ages = by_state(points(reader, si.METRIC_OLDEST_AGE, "m_twice"))
    assert ages["Transferring"].value == 1


def test_without_state_durations_on_leave_stays_free():
    reader = InMemoryMetricReader()
    si.set_on_expire_hooks([])
    si.enable_metrics(MeterProvider(metric_readers=[reader]), state_durations=False)
    clock = FakeClock()
    watchdog = sg.Watchdog(spec("m_nodur"), clock=clock)
    assert not watchdog.listeners
    watchdog.observe("a", "Bootstrapping")
    clock.advance(300)
    watchdog.check()
    assert points(reader, si.METRIC_STATE_DURATION, "m_nodur") == {}
    assert [p.value for p in points(reader, si.METRIC_EXPIRIES, "m_nodur").values()] == [1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"meter_provider": "prometheus"}, r"meter_provider=.*got 'prometheus'"),
        ({"state_durations": "yes"}, r"state_durations=.*got 'yes'"),
        ({"state_duration_buckets": []}, r"state_duration_buckets=.*got \[\]"),
        ({"state_duration_buckets": [5, 1]}, r"increasing.*got \[5, 1\]"),
        ({"state_duration_buckets": [-1, 1]}, r"non-negative.*got \[-1, 1\]"),
        ({"state_duration_buckets": ["1"]}, r"got \['1'\]"),
        ({"state_duration_buckets": 10}, r"got 10"),
        # issue 10, point 8: each of these used to pass, and the SDK then refused records
        ({"state_duration_buckets": [1, float("nan"), 3]}, r"got \[1, nan, 3\]: nan is not"),
        ({"state_duration_buckets": [1, float("inf")]}, r"got \[1, inf\]: inf is not a finite"),
        ({"state_duration_buckets": [1, 10**400]}, r"got \[1, 1000.*too large for a float"),
        ({"state_duration_buckets": "123"}, r"got '123': a str is not a sequence"),
        ({"state_duration_buckets": {1: 2}}, r"got \{1: 2\}: a dict is not a sequence"),
        ({"state_duration_buckets": [1, 1]}, r"got \[1, 1\]: 1 does not increase on 1.0"),
        ({"state_duration_buckets": None}, r"got None: a NoneType is not a sequence"),
    ],
)
def test_enable_metrics_rejects_bad_arguments(kwargs, message):
    with pytest.raises(sg.ConfigError, match=message):
        si.enable_metrics(**kwargs)
    assert not sg.Watchdog(spec("m_bad"), clock=FakeClock()).listeners  # nothing enabled


@settings(max_examples=at_least(200), deadline=None)
@given(
    buckets=st.lists(
        st.one_of(
            st.floats(allow_nan=True, allow_infinity=True),
            st.integers(min_value=-5, max_value=10**400),
            st.booleans(),
            st.text(max_size=2),
            st.none(),
        ),
        max_size=6,
    )
)
def test_any_bucket_list_is_taken_exactly_when_the_sdk_can_use_it(buckets: list) -> None:
    """Accepted buckets are finite, non-negative, strictly increasing floats and make a
    histogram that records; anything else is a ConfigError naming the argument."""
    try:
        taken = si._metrics._valid_buckets(buckets)
    except sg.ConfigError as exc:
        assert str(exc).startswith("enable_metrics(state_duration_buckets=...) must be")
        assert repr(buckets) in str(exc)
        return
    assert taken and all(math.isfinite(b) and b >= 0 for b in taken)
    assert all(a < b for a, b in itertools.pairwise(taken))
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    meter = provider.get_meter("bucket-check")
    histogram = meter.create_histogram("h", explicit_bucket_boundaries_advisory=list(taken))
    histogram.record(1.5)
    data = reader.get_metrics_data()
    [metric] = data.resource_metrics[0].scope_metrics[0].metrics
    [point] = metric.data.data_points
    assert point.count == 1 and list(point.explicit_bounds) == list(taken)
    provider.shutdown()


def test_request_count_is_an_up_down_counter_and_the_old_gauge_still_reports(reader):
    """OpenTelemetry's naming conventions: an additive count of things is an up-down
    counter named ``*.count``; the 0.1.0 gauge name reports the same values until 0.2."""
    from opentelemetry.sdk.metrics.export import Gauge, Sum

    clock = FakeClock()
    watchdog = sg.Watchdog(spec("m_kind"), clock=clock)
    for key in "abc":
        watchdog.observe(key, "Bootstrapping")
    watchdog.observe("c", "Transferring")

    assert si.METRIC_REQUEST_COUNT == "stallguard.request.count"
    data = reader.get_metrics_data()
    metrics = {
        m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
    }
    count = metrics["stallguard.request.count"]
    assert isinstance(count.data, Sum)
    assert count.data.is_monotonic is False  # up-down
    assert count.unit == "{request}"
    old = metrics["stallguard.requests"]
    assert isinstance(old.data, Gauge)
    assert "deprecated" in old.description.lower()
    for name in (si.METRIC_REQUEST_COUNT, si.METRIC_REQUESTS):
        values = {s: p.value for s, p in by_state(points(reader, name, "m_kind")).items()}
        assert values == {"Bootstrapping": 2, "Transferring": 1}


# --------------------------------------------------------------------------- properties

_STATES = ["Bootstrapping", "Transferring", "Success", "Failed"]
_steps = st.lists(
    st.one_of(
        st.tuples(st.just("observe"), st.integers(0, 5), st.sampled_from(_STATES)),
        st.tuples(st.just("heartbeat"), st.integers(0, 5), st.just("")),
        st.tuples(
            st.just("advance"), st.sampled_from([1.0, 10.0, 29.0, 31.0, 150.0, 301.0]), st.just("")
        ),
        st.tuples(st.just("check"), st.just(0), st.just("")),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=_steps, mode=st.sampled_from(["enforce", "report"]))
def test_property_error_type_and_request_count(steps, mode):
    """Whatever the sequence of observations, heartbeats and checks: every counted
    expiry carries ``error.type`` exactly when it was enforced, and then the one named
    for its reason; the request count (new and deprecated name alike) equals the
    watchdog's own per-state count at every collection."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    si.set_on_expire_hooks([])
    si.enable_metrics(provider, state_durations=False)
    try:
        clock = FakeClock()
        watchdog = sg.Watchdog(spec("m_prop"), clock=clock, mode=mode)
        for op, arg, state in steps:
            if op == "observe":
                watchdog.observe(arg, state)
            elif op == "heartbeat" and arg in watchdog:
                watchdog.heartbeat(arg)
            elif op == "advance":
                clock.advance(arg)
            elif op == "check":
                watchdog.check()
            expected = {
                label: summary.count
                for label, summary in watchdog.snapshot(requests=False).states.items()
            }
            for name in (si.METRIC_REQUEST_COUNT, si.METRIC_REQUESTS):
                found = by_state(points(reader, name, "m_prop"))
                assert {s: p.value for s, p in found.items()} == expected
        for key, point in points(reader, si.METRIC_EXPIRIES, "m_prop").items():
            attributes = dict(key)
            assert attributes["stallguard.mode"] == mode
            if mode == "enforce":
                assert attributes["error.type"] == si.ERROR_TYPES[attributes["stallguard.reason"]]
            else:
                assert "error.type" not in attributes
            assert point.value >= 1
    finally:
        si.disable_metrics()
        provider.shutdown()
