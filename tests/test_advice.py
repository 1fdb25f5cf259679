"""stallguard.advise and Watchdog.advice: the rule of docs/advice.md, tried on random
distributions against the same rule computed on the exact samples."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stallguard as sg
from stallguard._advice import read_prometheus, round_up
from stallguard._stats import LADDER, RESOLUTION, StatsRecorder, sample_quantile
from stallguard.instrumentation import set_on_expire_hooks
from stallguard.testing import FakeClock

SPEC = sg.Spec("adv", {"Wait": 120, "Move": None}, terminal=["Success", "Failed"])

durations = st.floats(min_value=-3, max_value=5).map(lambda e: 10.0**e)
rates = st.sampled_from([0.5, 0.1, 0.01, 0.001])
margins = st.sampled_from([1.0, 1.5, 2.0, 3.0])
floors = st.sampled_from([0.0, 1.0, 10.0, 30.0])


def statistics(values: list[float], state: str = "Wait") -> sg.Statistics:
    rec = StatsRecorder(SPEC)
    for v in values:
        rec.left(state, v)
    return rec.freeze("report")


def exact_rule(values: list[float], rate: float, margin: float, floor: float) -> float | None:
    return round_up(max(sample_quantile(values, 1 - rate) * margin, floor))


@settings(max_examples=300, deadline=None)
@given(st.lists(durations, min_size=1, max_size=400), rates, margins, floors)
def test_suggestion_is_the_exact_rule_within_the_histogram_resolution(values, rate, margin, floor):
    """The suggestion is never below the rule applied to the exact samples, and never
    above the rule applied to the exact quantile times RESOLUTION; the stays it would
    have failed are counted exactly."""
    advice = sg.advise(
        statistics(values), false_timeout_rate=rate, margin=margin, floor=floor, min_samples=1
    )
    wait = advice.states["Wait"]
    exact = exact_rule(values, rate, margin, floor)
    high = round_up(max(sample_quantile(values, 1 - rate) * RESOLUTION * margin, floor))
    assert wait.count == len(values)
    if exact is None:
        assert wait.suggested is None or high is None
        return
    assert wait.suggested is not None
    assert exact <= wait.suggested <= (high if high is not None else math.inf)
    assert wait.suggested in LADDER
    assert wait.over_suggested == sum(1 for v in values if v > wait.suggested)
    assert wait.over_deadline == sum(1 for v in values if v > 120)
    assert sample_quantile(values, 0.5) <= wait.p50 <= sample_quantile(values, 0.5) * RESOLUTION
    assert wait.max == max(values)


@settings(max_examples=100, deadline=None)
@given(st.lists(durations, min_size=1, max_size=200), rates)
def test_suggestion_fails_at_most_the_rate_of_stays(values, rate):
    """With margin 1 and no floor the suggestion sits at or above the 1 - rate quantile,
    so it fails at most a share *rate* of the recorded stays."""
    advice = sg.advise(
        statistics(values), false_timeout_rate=rate, margin=1, floor=0, min_samples=1
    )
    wait = advice.states["Wait"]
    if wait.suggested is not None:
        assert wait.over_suggested <= rate * len(values)


def test_known_distribution_reads_its_quantiles():
    """Uniform 0..10 s in 10 ms steps: p50 = 5 s, p99 = 9.9 s, p99.9 = 9.99 s."""
    values = [i / 100 for i in range(1, 1001)]
    wait = sg.advise(statistics(values), min_samples=1000).states["Wait"]
    for got, true in ((wait.p50, 5.0), (wait.p99, 9.9), (wait.p999, 9.99)):
        assert true <= got <= true * RESOLUTION
    assert wait.suggested == 20.0  # 9.99 x 2 -> 20 s, above the 10 s floor
    assert wait.over_suggested == 0
    assert "p99.9" in wait.reason and "20s" in wait.reason


def test_not_enough_data():
    advice = sg.advise(statistics([1.0] * 9_999))
    wait = advice.states["Wait"]
    assert advice.min_samples == 10_000  # 10 / 0.1 %
    assert not wait.enough_data and wait.suggested is None
    assert wait.reason == "not enough data: 9999 stays recorded, 10000 needed"
    assert advice.states["Move"].reason.startswith("not enough data: 0 stays")
    assert sg.advise(statistics([1.0] * 10_000)).states["Wait"].suggested == 10.0
    assert sg.advise(statistics([1.0] * 50), min_samples=50).states["Wait"].enough_data


def test_toml_lines_are_an_adapters_deadline_table():
    """What both adapters' advise commands print: a suggestion per state, in the order
    asked, whole seconds as integers; a comment for a state without one; nothing for a
    state the statistics do not have. The lines are TOML that gives those numbers."""
    import tomllib

    advice = sg.advise(statistics([0.3] * 20), min_samples=10, floor=0.5, margin=1)
    lines = advice.toml_lines(["Nope", "Move", "Wait"])
    assert lines[0].startswith("# Move: no suggestion (not enough data: 0 stays")
    wait = advice.states["Wait"].suggested
    assert wait is not None and lines[1:] == [f"Wait = {wait!r}"]
    assert tomllib.loads("\n".join(lines)) == {"Wait": wait}
    whole = sg.advise(statistics([1.0] * 20), min_samples=10).toml_lines(["Wait"])
    assert whole == ["Wait = 10"] and tomllib.loads(whole[0]) == {"Wait": 10}


def test_floor_and_beyond_a_week():
    assert sg.advise(statistics([0.01] * 10), min_samples=1).states["Wait"].suggested == 10.0
    advice = sg.advise(statistics([0.01] * 10), min_samples=1, floor=0)
    assert advice.states["Wait"].suggested == 0.02
    far = sg.advise(statistics([400_000.0] * 10), min_samples=1).states["Wait"]
    assert far.suggested is None and "beyond one week" in far.reason


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"false_timeout_rate": 0}, "false_timeout_rate must be in \\(0, 0.5\\], got 0"),
        ({"false_timeout_rate": 0.9}, "false_timeout_rate"),
        ({"false_timeout_rate": "1%"}, "false_timeout_rate must be a number, got '1%'"),
        ({"margin": 0.5}, "margin must be in \\[1, inf\\], got 0.5"),
        ({"margin": math.inf}, "margin must be finite"),
        ({"floor": -1}, "floor must be in"),
        ({"min_samples": 0}, "min_samples must be a positive int, got 0"),
        ({"min_samples": True}, "min_samples"),
    ],
)
def test_bad_parameters_name_the_parameter(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sg.advise(statistics([1.0]), **kwargs)


def test_growing_tail_by_trend_and_not_when_stationary():
    rng = random.Random(5)
    steady = [rng.uniform(0.5, 1.5) for _ in range(6000)]
    calm = sg.advise(statistics(steady), min_samples=1).states["Wait"]
    assert not calm.growing and calm.warnings == ()
    early = statistics(steady[:3000])
    calm_since = sg.advise(statistics(steady), min_samples=1, baseline=early).states["Wait"]
    assert not calm_since.growing
    worse = steady[:3000] + [rng.uniform(5, 15) for _ in range(3000)]
    rising = sg.advise(statistics(worse), min_samples=1, baseline=early).states["Wait"]
    assert rising.growing
    assert any("the tail is growing" in w for w in rising.warnings)
    assert not sg.advise(statistics(worse), min_samples=1).states["Wait"].growing  # no baseline
    with pytest.raises(ValueError, match="baseline: state 'Wait' is not an earlier copy"):
        sg.advise(early, baseline=statistics(worse))


def test_watchdog_advice_flags_live_requests_and_would_be_false_positives():
    set_on_expire_hooks([])
    clock = FakeClock()
    wd = sg.Watchdog(SPEC, clock=clock, mode="report", statistics=True)
    for key in range(200):  # healthy: 1 s in Wait
        wd.observe(key, "Wait")
        clock.advance(1)
        wd.observe(key, "Success")
    wd.observe("slow", "Wait")  # overstays 120 s, then succeeds: a would-be false positive
    clock.advance(130)
    wd.check()
    wd.observe("slow", "Success")
    wd.observe("stuck", "Wait")  # still there
    clock.advance(310)
    wd.check()
    advice = wd.advice(min_samples=100)
    wait = advice.states["Wait"]
    assert wait.count == 201 and wait.fired == 2 and wait.fired_completed == 1
    assert wait.over_deadline == 1  # "slow" left after 130 s
    # p99.9 of 201 stays is the largest (rank 201): 130 s x 2 = 260 s -> 300 s
    assert wait.quantile_seconds == 130 and wait.suggested == 300.0
    assert wait.oldest == 310 and wait.live_over == 1 and wait.growing
    assert any("then completed normally" in w for w in wait.warnings)
    assert any("older than the suggested" in w for w in wait.warnings)
    table = advice.table()
    assert table.splitlines()[0].split()[:3] == ["state", "n", "p50"]
    assert "Wait" in table and "WARNING" in table


def test_enforce_mode_warns_that_stays_were_cut():
    set_on_expire_hooks([])
    clock = FakeClock()
    wd = sg.Watchdog(SPEC, clock=clock, statistics=True)
    wd.observe(1, "Wait")
    clock.advance(121)
    wd.check()
    wait = wd.advice(min_samples=1).states["Wait"]
    assert wait.fired == 1 and wait.fired_completed is None  # enforce: cannot complete
    assert any("cut at the current deadline" in w for w in wait.warnings)


# --------------------------------------------------------------------------- Prometheus


def exposition(stats: sg.Statistics, name: str, labels: str) -> str:
    """A Prometheus text exposition of *stats* at the LADDER bounds, as an exporter with
    those buckets writes it."""
    lines = [f"# TYPE {name} histogram"]
    for label, s in stats.states.items():
        d = s.distribution
        for bound in (*LADDER, math.inf):
            le = "+Inf" if bound == math.inf else repr(bound)
            below = d.count - (d.count_above(bound) if bound != math.inf else 0)
            lines.append(f'{name}_bucket{{{labels},state="{label}",le="{le}"}} {below}.0')
        lines.append(f'{name}_sum{{{labels},state="{label}"}} {d.total}')
        lines.append(f'{name}_count{{{labels},state="{label}"}} {d.count}.0')
        lines.append(f'deadline{{{labels},state="{label}"}} {s.deadline or 0}')
    return "\n".join(lines) + "\n"


@settings(max_examples=100, deadline=None)
@given(st.lists(durations, min_size=1, max_size=300), rates)
def test_prometheus_round_trip_suggests_no_shorter_deadline(values, rate):
    """A scrape has coarser buckets (LADDER): its suggestion is never shorter than the
    in-process one, and counts above any ladder value agree exactly. Two ranks' series
    are summed."""
    stats = statistics(values)
    text = exposition(stats, "x:state_seconds", 'rank="0"') + exposition(
        stats, "x:state_seconds", 'rank="1"'
    )
    scraped = sg.statistics_from_prometheus(
        text, histogram="x:state_seconds", deadline_gauge="deadline", spec="adv"
    )
    assert scraped.states["Wait"].count == 2 * len(values)
    assert scraped.states["Wait"].deadline == 120.0
    assert scraped.states["Move"].deadline is None
    doubled = statistics(values + values)
    fine = sg.advise(doubled, false_timeout_rate=rate, min_samples=1).states["Wait"]
    coarse = sg.advise(scraped, false_timeout_rate=rate, min_samples=1).states["Wait"]
    if fine.suggested is not None and coarse.suggested is not None:
        assert fine.suggested <= coarse.suggested
        assert coarse.over_suggested == doubled.states["Wait"].distribution.count_above(
            coarse.suggested
        )
    for value in LADDER:
        assert scraped.states["Wait"].distribution.count_above(value) == 2 * sum(
            1 for v in values if v > value
        )


def test_read_prometheus_labels_escapes_and_errors():
    text = (
        "# HELP a x\n"
        'a_total{q="in\\"flight",b="x\\\\y",c="line\\nbreak"} 3 1700000000\n'
        "b 1e3\n"
        'c{le="+Inf"} +Inf\n'
    )
    samples = read_prometheus(text)
    assert samples[0] == ("a_total", {"q": 'in"flight', "b": "x\\y", "c": "line\nbreak"}, 3.0)
    assert samples[1] == ("b", {}, 1000.0)
    assert samples[2][2] == math.inf
    with pytest.raises(ValueError, match="line 1 is not a Prometheus sample"):
        read_prometheus("{oops} 1\n")
    with pytest.raises(ValueError, match=r"line 2 is not a Prometheus sample: 'a\{b=1\} 2'"):
        read_prometheus("a 1\na{b=1} 2\n")
    with pytest.raises(ValueError, match="line 1 is not a Prometheus sample: 'a abc'"):
        read_prometheus("a abc\n")
    # what the hand-written parser before prometheus_client's refused: exemplars
    # (OpenMetrics), UTF-8 quoted names, timestamps
    om = (
        "# TYPE h histogram\n"
        'h_bucket{state="A",le="1.0"} 3 # {trace_id="ab"} 0.5\n'
        'h_bucket{state="A",le="+Inf"} 4\n'
        'h_count{state="A"} 4\nh_sum{state="A"} 2.5\n# EOF\n'
    )
    assert [s[2] for s in read_prometheus(om)] == [3.0, 4.0, 4.0, 2.5]
    utf8 = '{"sglang:h_bucket",state="A",le="1"} 3 1700000000000\n'
    assert read_prometheus(utf8) == [("sglang:h_bucket", {"state": "A", "le": "1"}, 3.0)]
    with pytest.raises(ValueError, match="no h_bucket series"):
        sg.statistics_from_prometheus("a 1\n", histogram="h")


# --------------------------------------------------------------------------- issue 20

BUCKETS = 'h_bucket{state="A",le="1"} 1\nh_bucket{state="A",le="+Inf"} 2\n'


def test_a_plus_inf_bucket_bound_is_normal_and_nonfinite_values_are_read():
    # +Inf, -Inf and NaN are valid exposition values: where they can mean something,
    # they are taken as such
    text = BUCKETS + 'h_sum{state="A"} +Inf\ng{state="A"} +Inf\ng{state="A"} NaN\n'
    stats = sg.statistics_from_prometheus(text, histogram="h", deadline_gauge="g")
    a = stats.states["A"]
    assert a.distribution.bounds == (1.0, math.inf) and a.distribution.counts == (1, 1)
    assert a.deadline is None  # a +Inf deadline gauge: no deadline
    nan_gauge = BUCKETS + 'g{state="A"} NaN\ng{state="A"} 30\n'
    assert (
        sg.statistics_from_prometheus(nan_gauge, histogram="h", deadline_gauge="g")
        .states["A"]
        .deadline
        == 30.0
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # was: OverflowError (round(inf))
        ('h_bucket{state="A",le="5"} +Inf\n', 'line 3: h_bucket{state="A",le="5"} +Inf: a count'),
        # was: ValueError from round(nan), naming nothing
        ('h_bucket{state="A",le="5"} NaN\n', 'line 3: h_bucket{state="A",le="5"} NaN: a count'),
        ('h_bucket{state="A",le="5"} -1\n', 'line 3: h_bucket{state="A",le="5"} -1.0: a count'),
        ('f_total{state="A"} NaN\n', 'line 3: f_total{state="A"} NaN: a count must be a finite'),
        ('f_total{state="A"} -Inf\n', 'line 3: f_total{state="A"} -Inf: a count'),
        ('c_total{state="A"} +Inf\n', 'line 3: c_total{state="A"} +Inf: a count'),
        # was: accepted, a NaN bucket bound
        ('h_bucket{state="A",le="NaN"} 1\n', 'line 3: h_bucket{state="A",le="NaN"}: le=\'NaN\''),
        ('h_bucket{state="A",le="-Inf"} 0\n', "le='-Inf' is not a bucket bound"),
        # was: "could not convert string to float: 'soon'", no line
        ('h_bucket{state="A",le="soon"} 1\n', 'line 3: h_bucket{state="A",le="soon"}: le=\'soon\''),
    ],
)
def test_meaningless_values_are_refused_naming_line_series_and_value(extra, message):
    with pytest.raises(ValueError) as caught:
        sg.statistics_from_prometheus(
            BUCKETS + extra, histogram="h", fired_counter="f", completed_counter="c"
        )
    assert message in str(caught.value)


def test_counts_that_sum_beyond_a_float_are_refused():
    text = 'h_bucket{state="A",le="+Inf",r="0"} 1e308\nh_bucket{state="A",le="+Inf",r="1"} 1e308\n'
    with pytest.raises(ValueError, match="summed over the series are too large"):
        sg.statistics_from_prometheus(text, histogram="h")


def reported(fired: int, then: dict[str, int]) -> sg.Statistics:
    dist = sg.Distribution((1.0, math.inf), (5, 0), 5.0, None)
    state = sg.StateStatistics(
        state="Wait",
        deadline=1.0,
        distribution=dist,
        fired=fired,
        fired_then=then,
        completed=("Success",),
    )
    return sg.Statistics(spec="s", mode="report", states={"Wait": state})


def test_completed_as_a_string_is_one_state():
    # was: iterated as characters ("S", "u", ...): would-be false positives read 0
    stats = reported(3, {"Success": 2, "Failed": 1})
    assert sg.advise(stats, completed="Success").states["Wait"].fired_completed == 2
    assert sg.advise(stats, completed=["Success"]).states["Wait"].fired_completed == 2
    assert sg.advise(stats, completed="Failed").states["Wait"].fired_completed == 1


@pytest.mark.parametrize("completed", [5, [5], ("Success", None)])
def test_completed_that_is_not_labels_is_a_type_error_naming_it(completed):
    with pytest.raises(TypeError, match="^completed must"):
        sg.advise(reported(1, {"Success": 1}), completed=completed)


@pytest.mark.parametrize(
    "bounds",
    [(1.0, math.nan, math.inf), (math.nan, math.inf), (-math.inf, 1.0, math.inf), ("1", math.inf)],
)
def test_distribution_bounds_must_be_finite_numbers_but_the_last(bounds):
    # was: (1, nan, inf) accepted (every comparison with nan is false)
    with pytest.raises(ValueError, match="Distribution bounds must be finite numbers"):
        sg.Distribution(bounds, (0,) * len(bounds))
    assert sg.Distribution((1, 10**400, math.inf), (0, 0, 0)).count == 0  # ints are finite


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"margin": 10**400}, "margin must be finite, got an integer of 401 digits"),
        ({"false_timeout_rate": 10**400}, "false_timeout_rate must be in (0, 0.5]"),
        ({"floor": -(10**5000)}, "floor must be in [0, "),
        ({"min_samples": -(10**5000)}, "min_samples must be a positive int, got an integer"),
    ],
    ids=["margin", "rate", "floor", "min_samples"],
)
def test_parameters_beyond_a_float_are_value_errors_naming_them(kwargs, message):
    # was: OverflowError from math.isnan(), ValueError from repr()
    with pytest.raises(ValueError) as caught:
        sg.advise(reported(0, {}), **kwargs)
    assert str(caught.value).startswith(message)
