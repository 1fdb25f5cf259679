"""The pd_wedge demo's derived deadlines (examples/pd_wedge/_calibrate.py), without SGLang:
the rule that turns a warm-up measurement into the deadlines the guarded processes get."""

from __future__ import annotations

import pytest

from examples.pd_wedge import _calibrate
from examples.pd_wedge._config import DEFAULT, QUICK
from examples.pd_wedge._driver import RunResult, explain_false_positive, false_positive


def test_an_idle_machine_runs_the_profile_as_written():
    profile, record = _calibrate.derive(QUICK, "prefill", [0.05, 0.08, 0.12], [0.04, 0.06])
    assert profile is QUICK and record["scale"] == 1.0 and not record["capped"]
    assert record["rtt_ms"]["max"] == 120.0 and record["max_pass_gap_ms"] == 60.0


def test_a_slow_round_trip_scales_every_deadline_and_the_window():
    # 0.45 s healthy round trip: 5 x 0.45 = 2.25 s against a shortest deadline of 1 s
    profile, record = _calibrate.derive(DEFAULT, "decode", [0.1, 0.45], [0.05])
    assert record["scale"] == 2.5
    assert profile.deadlines == {k: round(v * 2.5, 1) for k, v in DEFAULT.deadlines.items()}
    assert profile.decode_deadline("prealloc", "Bootstrapping") == pytest.approx(3.8)
    assert profile.mooncake_waiting == pytest.approx(3.8)
    assert profile.window == pytest.approx(6.5)
    assert profile.window > max(profile.deadlines.values())
    assert profile.advice_floor == 2.5 and profile.loop_interval == DEFAULT.loop_interval
    assert profile.rate == DEFAULT.rate
    assert min(profile.deadlines.values()) >= _calibrate.RTT_HEADROOM * 0.45


def test_loop_gaps_count_too_and_the_scale_is_capped():
    _, record = _calibrate.derive(QUICK, "prefill", [0.05], [0.6])  # 4 x 0.6 = 2.4
    assert record["scale"] == 2.5
    _, record = _calibrate.derive(QUICK, "prefill", [5.0], [0.05])
    assert record["scale"] == _calibrate.MAX_SCALE and record["capped"]
    assert "WARNING" in _calibrate.describe(record)


def test_pass_gaps():
    assert _calibrate.pass_gaps([3.0, 1.0, 1.5]) == [0.5, 1.5]
    assert _calibrate.pass_gaps([1.0]) == []


def test_a_false_positive_is_explained_with_its_phase_time_and_deadline():
    _, record = _calibrate.derive(QUICK, "decode", [0.1], [0.05])
    r = RunResult("nixl", "prefill-freeze", "with", side="decode", calibration=record, t0=100.0)
    false_positive(
        r, "with-7", "B", 100.2, 101.6, "stallguard", "stallguard: ...",
        phase="prealloc Bootstrapping", since=100.25, deadline=1.2,
    )  # fmt: skip
    text = explain_false_positive(r, r.false_positives[0])
    assert text.startswith("FALSE POSITIVE nixl/prefill-freeze (decode side, with)")
    assert "with-7 (to prefill B, sent at 0.20s)" in text
    assert "in prealloc Bootstrapping after 1.35s there (deadline 1.2s" in text
    assert "warm-up round trip max 100.0 ms" in text
    assert not r.ok()


def test_an_on_time_release_allows_for_the_clock_read_inside_a_slow_call():
    """The harness stamps a call's start; the adapter reads its clock inside the call. A
    deadline due 20 ms before a call's stamp may still be ahead of the adapter's read when
    the call took 30 ms: the next call's release is on time then, not on an idle machine."""
    calls = [10.0, 10.04, 10.08]
    idle = RunResult("nixl", "freeze", "with")
    idle.measure_slack([0.001, 0.002])
    idle.forced(10.04, 9.98, calls)
    assert idle.late_releases == 1 and idle.clock_slack_ms == 5.0
    loaded = RunResult("nixl", "freeze", "with")
    loaded.measure_slack([0.001, 0.03])
    loaded.forced(10.04, 9.98, calls)
    assert loaded.late_releases == 0 and loaded.clock_slack_ms == 30.0
    loaded.forced(10.08, 9.98, calls)  # a whole call late is still late
    assert loaded.late_releases == 1
