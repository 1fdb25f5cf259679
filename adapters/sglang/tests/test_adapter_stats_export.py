"""The adapter's time-in-state export is exact at every bucket bound: what
prometheus_client serves equals the in-process histogram, however the stays arrive
between exports (in-process registry; the multiprocess path is test_adapter_advice.py)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from stallguard_sglang._kvpoll import KVPOLL
from stallguard_sglang._stats_export import STATE_SECONDS, LaneStats

import stallguard as sg
from stallguard._stats import LADDER
from stallguard.testing import FakeClock

SPEC = sg.Spec(
    "sglang.inflight.nixl",
    {"Bootstrapping": 300, "WaitingForInput": 300, "Transferring": 300},
    terminal=("Success", "Failed"),
)
durations = st.floats(min_value=-5, max_value=6).map(lambda e: 10.0**e)  # 10 µs to 11 days
stays = st.lists(st.tuples(st.sampled_from([1, 2, 3]), durations), max_size=60)
LABELS = {"queue": "inflight", "backend": "exporttest", "tp_rank": "0"}


def served() -> dict[tuple[str, str, str], float]:
    """(sample name, state, le) -> value, of the histogram's series for LABELS only."""
    from stallguard_sglang import _stats_export

    out = {}
    for family in _stats_export._created["seconds"].collect():
        for sample in family.samples:
            labels = sample.labels
            if all(labels.get(k) == v for k, v in LABELS.items()):
                out[sample.name, labels["state"], labels.get("le", "")] = sample.value
    return out


@settings(max_examples=40, deadline=None)
@given(st.lists(stays, min_size=1, max_size=4))
def test_export_equals_the_recorder_at_every_bound(batches):
    """Stays recorded by the lane's watchdog (every state change it observes) reach the
    served histogram exactly, however they are batched between exports."""
    clock = FakeClock()
    wd: sg.Watchdog[int] = sg.Watchdog(SPEC, clock=clock, mode="report", statistics=True)
    lane = LaneStats(wd, "inflight", "exporttest", 0, clock)
    lane.export()  # creates the metrics on first use
    before = served()
    key = 0
    for batch in batches:
        for state, seconds in batch:
            key += 1
            wd.observe(key, KVPOLL[state])
            clock.advance(seconds)
            wd.observe(key, "Success")
        lane.export()
    after = served()
    stats = wd.statistics()
    for label, s in stats.states.items():
        d = s.distribution
        for bound in (*LADDER, math.inf):
            le = "+Inf" if bound == math.inf else str(float(bound))
            key_ = (f"{STATE_SECONDS}_bucket", label, le)
            expected = d.count - (d.count_above(bound) if bound != math.inf else 0)
            assert after.get(key_, 0) - before.get(key_, 0) == expected, (label, bound)
        key_ = (f"{STATE_SECONDS}_sum", label, "")
        added = after.get(key_, 0) - before.get(key_, 0)
        assert math.isclose(added, d.total, rel_tol=1e-9, abs_tol=1e-9)


def failures(kind: str, backend: str) -> dict[tuple[str, str], float]:
    """(state, reason) -> value of the adapter's forced/reported counter for *backend*."""
    from stallguard_sglang import _metrics

    counters = _metrics.failure_counters()
    assert counters is not None
    out = {}
    for family in counters[kind].collect():
        for sample in family.samples:
            labels = sample.labels
            if sample.name.endswith("_total") and labels.get("backend") == backend:
                assert labels["queue"] == "inflight"
                out[labels["state"], labels["reason"]] = sample.value
    return out


@settings(max_examples=30, deadline=None)
@given(
    mode=st.sampled_from(["enforce", "report"]),
    rounds=st.lists(st.tuples(st.integers(0, 3), st.booleans()), min_size=1, max_size=6),
)
def test_the_counters_are_the_cores_counts_current_after_each_check(mode, rounds):
    """sglang:stallguard_forced_failures_total / _stalls_reported_total are the core's
    counts of expiries by state and reason (a withdrawn one not counted), exported at
    once after a check that expired something, each expiry once."""
    clock = FakeClock()
    spec = sg.Spec(
        "sglang.inflight.counts",
        {"Bootstrapping": 1, "Transferring": sg.Deadline(seconds=5, stall=2)},
        terminal=("Success", "Failed"),
    )
    backend = f"counts-{mode}-{id(rounds)}"
    wd: sg.Watchdog[int] = sg.Watchdog(
        spec,
        clock=clock,
        mode=mode,
        statistics=True,
        on_expire=lambda e: sg.CONCLUDED if e.key % 2 else None,  # odd keys withdrawn
    )
    lane = LaneStats(wd, "inflight", backend, 0, clock)
    kind = "forced" if mode == "enforce" else "reported"
    delivered: dict[tuple[str, str], float] = {}
    key = 0
    for n, transferring in rounds:
        for _ in range(n):
            key += 1
            wd.observe(key, "Transferring" if transferring else "Bootstrapping")
        clock.advance(3)
        lane.tick(clock())  # the export period is used up: only an expiry exports now
        expired = wd.check()
        for e in expired:
            delivered[e.state_label, e.reason] = delivered.get((e.state_label, e.reason), 0) + 1
        lane.tick(clock(), expired)
        assert failures(kind, backend) == delivered  # current after the check
        lane.tick(clock(), expired)  # again: nothing new, nothing added
        assert failures(kind, backend) == delivered
    other = "reported" if kind == "forced" else "forced"
    assert failures(other, backend) == {}
