"""Suggested deadlines from time-in-state statistics: the rule of docs/advice.md.

Per state, with *rate* the acceptable false-timeout rate (the operator's one knob):

1. not enough data: fewer than *min_samples* recorded stays (default ⌈10 / rate⌉, so
   at least ten stays lie beyond the quantile read) -> no suggestion;
2. ``q`` = the ``1 - rate`` quantile of the recorded stays (p99.9 for 0.1 %), estimated
   from above (never below the true sample quantile);
3. suggestion = ``max(q x margin, floor)``, rounded up to the next value of
   :data:`stallguard._stats.LADDER` (1, 2, 5 x 10^k s below 10 s; 15 s, 20 s, 30 s, 45 s,
   1 min, 90 s, 2, 3, 4, 5, 7.5, 10, 15, 20, 30, 45 min, 1 h... one week). Beyond a
   week: no suggestion.

It also reports how many recorded stays the suggestion would have failed (exact: every
ladder value is a bucket bound) and flags a tail that is still growing:

* *trend* (given a *baseline*, an earlier copy of the same statistics): the p99 of the
  stays recorded since the baseline is more than 1.5 times the baseline's p99, beyond
  the histogram's resolution (the recent p99's lower bound exceeds 1.5 x the baseline
  p99's upper bound), with at least 100 values on each side;
* *live*: with a snapshot, a request still in the state is older than every recorded
  stay, or older than the suggestion.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import attrs

from ._details import Mode, Snapshot
from ._spec import state_label
from ._stats import LADDER, Distribution, StateStatistics, Statistics
from ._validate import _show, is_count, is_real

__all__ = [
    "Advice",
    "StateAdvice",
    "advise",
    "format_seconds",
    "read_prometheus",
    "round_up",
    "statistics_from_prometheus",
]

#: the recent p99 must exceed this factor times the earlier p99 to flag a growing tail
GROWTH_FACTOR = 1.5
#: values needed on each side of the window for the trend test
TREND_MIN = 100


def round_up(seconds: float) -> float | None:
    """The smallest :data:`~stallguard._stats.LADDER` value ≥ *seconds*, or None beyond
    one week."""
    for value in LADDER:
        if value >= seconds:
            return value
    return None


def format_seconds(seconds: float | None) -> str:
    """A short human duration: ``"450ms"``, ``"2.5s"``, ``"120s"``, ``"—"`` for None."""
    if seconds is None:
        return "—"
    if math.isinf(seconds):
        return "inf"
    if seconds < 1:
        return f"{seconds * 1000:.3g}ms"
    if seconds < 10_000:
        return f"{seconds:.4g}s"
    return f"{seconds:.0f}s"


@attrs.frozen
class StateAdvice:
    """The advice for one state (see :func:`advise` for the rule).

    Attributes:
        state: the state's label.
        count: recorded stays (requests that left the state).
        p50, p99, p999, max: quantiles of the stays in seconds, estimated from above
            (see :class:`~stallguard.Distribution`); *max* is exact from a watchdog, a
            bucket bound from a scrape. None without data.
        quantile: the quantile the rule reads, ``1 - false_timeout_rate``.
        quantile_seconds: its value (None without data).
        deadline: the current state deadline (None: none, or unknown).
        fired: requests the current deadline fired on (enforce) or would have (report);
            None when unknown.
        fired_completed: of those, report mode: how many then completed normally (would-be
            false positives). None when unknown or in enforce mode.
        over_deadline: recorded stays longer than the current deadline (None without a
            deadline). In enforce mode stays are cut at the deadline, so this counts the
            expired ones; in report mode, the ones that overstayed and then left.
        suggested: the suggested deadline in seconds, or None (see *reason*).
        over_suggested: recorded stays longer than *suggested* (what it would have failed).
        enough_data: whether *count* reached *min_samples*.
        min_samples: the sample count the rule needs.
        growing: whether the tail is still growing (trend or live; see *warnings*).
        oldest: with a snapshot: age of the oldest request now in the state.
        live_over: with a snapshot: requests now in the state older than *suggested*.
        reason: how the suggestion was reached, or why there is none.
        warnings: human-readable warnings.
    """

    state: str
    count: int
    p50: float | None
    p99: float | None
    p999: float | None
    max: float | None
    quantile: float
    quantile_seconds: float | None
    deadline: float | None
    fired: int | None
    fired_completed: int | None
    over_deadline: int | None
    suggested: float | None
    over_suggested: int | None
    enough_data: bool
    min_samples: int
    growing: bool
    oldest: float | None
    live_over: int | None
    reason: str
    warnings: tuple[str, ...] = ()


def _advice_states(value: Mapping[str, StateAdvice]) -> Mapping[str, StateAdvice]:
    return MappingProxyType(dict(value))


@attrs.frozen
class Advice:
    """Suggested deadlines per state (:func:`advise`, :meth:`stallguard.Watchdog.advice`).

    Attributes:
        spec: the spec's name.
        mode: the watchdog's mode (None if unknown).
        false_timeout_rate, margin, floor, min_samples: the rule's parameters.
        states: per state label, its :class:`StateAdvice`.
    """

    spec: str
    mode: Mode | None
    false_timeout_rate: float
    margin: float
    floor: float
    min_samples: int
    states: Mapping[str, StateAdvice] = attrs.field(converter=_advice_states)

    @property
    def deadlines(self) -> dict[str, float]:
        """The suggested deadlines, for the states that have one."""
        return {s.state: s.suggested for s in self.states.values() if s.suggested is not None}

    def toml_lines(self, states: Iterable[str]) -> list[str]:
        """*states*' suggestions as TOML lines of an adapter's deadline table, in that
        order: ``State = seconds`` (an integer when whole), a ``# State: no suggestion
        (why)`` comment for a state without one, nothing for a state this advice does
        not have (it keeps its configured deadline either way)."""
        lines = []
        for state in states:
            s = self.states.get(state)
            if s is None:
                continue
            if s.suggested is None:
                lines.append(f"# {state}: no suggestion ({s.reason})")
            else:
                lines.append(f"{state} = {toml_number(s.suggested)}")
        return lines

    def table(self) -> str:
        """The advice as a fixed-width text table, with warnings below it."""
        head = (
            "state",
            "n",
            "p50",
            "p99",
            "p99.9",
            "max",
            "deadline",
            "fired",
            "then ok",
            "suggested",
            "would fail",
        )
        rows = [head, *(_row(s) for s in self.states.values())]
        notes = [note for s in self.states.values() for note in _notes(s)]
        lines = _aligned(rows)
        rule = (
            f"rule: p{_pct(1 - self.false_timeout_rate)} x {self.margin:g}, at least "
            f"{format_seconds(self.floor)}, rounded up; needs {self.min_samples} stays"
        )
        return "\n".join([*lines, "", rule, *notes])


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """*rows* as lines of left-aligned columns, two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]


def _row(s: StateAdvice) -> tuple[str, ...]:
    """*s*'s row of :meth:`Advice.table`."""
    return (
        s.state,
        str(s.count),
        format_seconds(s.p50),
        format_seconds(s.p99),
        format_seconds(s.p999),
        format_seconds(s.max),
        format_seconds(s.deadline),
        _count_cell(s.fired),
        _count_cell(s.fired_completed),
        format_seconds(s.suggested),
        _count_cell(s.over_suggested),
    )


def _notes(s: StateAdvice) -> list[str]:
    """*s*'s lines below :meth:`Advice.table`: its reason, then its warnings."""
    return [f"{s.state}: {s.reason}", *(f"{s.state}: WARNING: {w}" for w in s.warnings)]


def _count_cell(count: int | None) -> str:
    return "—" if count is None else str(count)


def _pct(q: float) -> str:
    return f"{q * 100:.6g}"


def _check(name: str, value: Any, low: float, high: float, *, low_open: bool) -> float:
    number = _real(name, value)
    ok = (number > low if low_open else number >= low) and number <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low:g}, {high:g}], got {_show(value)}")
    return number


def _real(name: str, value: Any) -> float:
    """Parameter *name*'s *value* as a float (an int beyond a float: infinite), if it is
    a number and not NaN."""
    if not is_real(value):
        raise ValueError(f"{name} must be a number, got {_show(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond a float: out of every range here
        number = math.inf if value > 0 else -math.inf
    if math.isnan(number):
        raise ValueError(f"{name} must be a number, got {_show(value)}")
    return number


def _completed(completed: Iterable[str] | str | None) -> tuple[str, ...] | None:
    """*completed* as a tuple of state labels; a single string is one state (iterating
    it would count its characters)."""
    if completed is None:
        return None
    if isinstance(completed, str):
        return (completed,)
    try:
        labels = tuple(completed)
    except TypeError:
        raise TypeError(
            "completed must be a terminal state label or an iterable of them, got "
            f"{_show(completed)} ({type(completed).__name__})"
        ) from None
    for label in labels:
        if not isinstance(label, str):
            raise TypeError(
                f"completed must hold state labels (strings), got {_show(label)} "
                f"({type(label).__name__}) in it"
            )
    return labels


def advise(
    statistics: Statistics,
    *,
    false_timeout_rate: float = 0.001,
    margin: float = 2.0,
    floor: float = 10.0,
    min_samples: int | None = None,
    completed: Iterable[str] | str | None = None,
    snapshot: Snapshot[Any] | None = None,
    baseline: Statistics | None = None,
) -> Advice:
    """Suggest a deadline per state from *statistics* (the rule is in the module
    docstring and docs/advice.md).

    Args:
        statistics: from :meth:`stallguard.Watchdog.statistics` or
            :func:`statistics_from_prometheus`.
        false_timeout_rate: the share of healthy stays a deadline may fail, in (0, 0.5];
            0.001 reads p99.9.
        margin: factor ≥ 1 applied to that quantile.
        floor: the shortest deadline to suggest, seconds ≥ 0 (default 10 s: a watchdog
            catches wedged requests; it is not a latency SLO).
        min_samples: stays needed for a suggestion; default ⌈10 / false_timeout_rate⌉.
        completed: terminal state labels that count as normal completion for the
            would-be false positives (one label may be given as a plain string); default:
            what the statistics say (the spec's first terminal state).
        snapshot: a :class:`~stallguard.Snapshot` with requests, to flag requests that
            are in a state now and older than its suggestion or than any recorded stay.
        baseline: an earlier copy of the same statistics (an earlier
            :meth:`~stallguard.Watchdog.statistics` or scrape): flags a state whose tail
            grew since then (the *trend* test above).

    Raises:
        ValueError: naming the parameter, for a value out of range.
        TypeError: naming *completed*, if it is neither a string nor an iterable of
            strings.
    """
    rate = _check("false_timeout_rate", false_timeout_rate, 0.0, 0.5, low_open=True)
    given_margin = margin
    margin = _check("margin", margin, 1.0, math.inf, low_open=False)
    if math.isinf(margin):
        raise ValueError(f"margin must be finite, got {_show(given_margin)}")
    floor = _check("floor", floor, 0.0, LADDER[-1], low_open=False)
    need = _min_samples(min_samples, rate)
    done = _completed(completed)
    ages = _ages(snapshot)
    states = {
        label: _advise_state(
            s,
            statistics.mode,
            rate,
            margin,
            floor,
            need,
            done,
            ages.get(label),
            snapshot,
            _earlier(s, baseline),
        )
        for label, s in statistics.states.items()
    }
    return Advice(
        spec=statistics.spec,
        mode=statistics.mode,
        false_timeout_rate=rate,
        margin=margin,
        floor=floor,
        min_samples=need,
        states=states,
    )


def _min_samples(min_samples: int | None, rate: float) -> int:
    """The stays a suggestion needs: *min_samples*, by default ⌈10 / rate⌉."""
    if min_samples is None:
        return math.ceil(round(10 / rate, 9))
    if not is_count(min_samples, 1):
        raise ValueError(f"min_samples must be a positive int, got {_show(min_samples)}")
    return min_samples


def _ages(snapshot: Snapshot[Any] | None) -> dict[str, list[float]]:
    """The ages of *snapshot*'s requests, per state label."""
    ages: dict[str, list[float]] = {}
    for request in snapshot.requests if snapshot is not None else ():
        ages.setdefault(state_label(request.state), []).append(request.age)
    return ages


def _fired_completed(
    s: StateStatistics, mode: Mode | None, completed: tuple[str, ...] | None, warnings: list[str]
) -> int | None:
    """Report mode: how many requests the deadline fired on then completed (None:
    unknown, or enforce mode, where a failed request cannot complete)."""
    fired_completed = _count_fired_completed(s, mode, completed)
    if fired_completed and s.fired:
        warnings.append(
            f"the current deadline fired on {s.fired} request(s), {fired_completed} of which "
            "then completed normally: enforcing it would have failed them"
        )
    return fired_completed


def _count_fired_completed(
    s: StateStatistics, mode: Mode | None, completed: tuple[str, ...] | None
) -> int | None:
    if mode == "enforce" or s.fired is None:
        return None  # enforce: a failed request cannot complete, nothing to count
    if s.fired_then:
        labels = s.completed if completed is None else completed
        return sum(s.fired_then.get(label, 0) for label in labels)
    return 0 if s.completed else None


def _suggestion(
    n: int, need: int, q: float, q_seconds: float | None, margin: float, floor: float
) -> tuple[float | None, str]:
    """The suggested deadline (None: none) and the reason for it."""
    if n < need:
        return None, f"not enough data: {n} stays recorded, {need} needed"
    if q_seconds is None or math.isinf(q_seconds):
        return None, f"p{_pct(q)} lies beyond the largest bucket: no suggestion"
    raw = max(q_seconds * margin, floor)
    suggested = round_up(raw)
    if suggested is None:
        return None, f"p{_pct(q)} x {margin:g} = {format_seconds(raw)}: beyond one week"
    floored = " (the floor)" if floor >= q_seconds * margin else ""
    return suggested, (
        f"p{_pct(q)} ≤ {format_seconds(q_seconds)}; x {margin:g} = "
        f"{format_seconds(q_seconds * margin)}; at least {format_seconds(floor)}"
        f"{floored}; rounded up: {format_seconds(suggested)}"
    )


def _live(
    s: StateStatistics, live: list[float], suggested: float | None, warnings: list[str]
) -> tuple[float | None, int | None, bool]:
    """The tracked requests' ages against the suggestion and the recorded stays:
    ``(oldest, how many are older than the suggestion, whether the tail grows)``."""
    oldest = max(live) if live else None
    live_over = _over_suggestion(s, live, suggested, oldest, warnings)
    beyond = not live_over and _beyond_recorded(s, oldest, warnings)
    return oldest, live_over, bool(live_over) or beyond


def _over_suggestion(
    s: StateStatistics,
    live: list[float],
    suggested: float | None,
    oldest: float | None,
    warnings: list[str],
) -> int | None:
    """How many of the *live* ages are above the suggestion (None: no suggestion)."""
    if suggested is None:
        return None
    live_over = sum(1 for age in live if age > suggested)
    if live_over:
        warnings.append(
            f"{live_over} request(s) in {s.state} now are older than the suggested "
            f"{format_seconds(suggested)} (oldest {format_seconds(oldest)})"
        )
    return live_over


def _beyond_recorded(s: StateStatistics, oldest: float | None, warnings: list[str]) -> bool:
    """Whether the *oldest* live request is older than every recorded stay."""
    top = s.distribution.max
    if oldest is None or top is None or not oldest > top:
        return False
    warnings.append(
        f"a request in {s.state} now ({format_seconds(oldest)}) is older than every "
        f"recorded stay (max {format_seconds(top)}): the tail is still growing"
    )
    return True


def _advise_state(
    s: StateStatistics,
    mode: Mode | None,
    rate: float,
    margin: float,
    floor: float,
    need: int,
    completed: tuple[str, ...] | None,
    ages: list[float] | None,
    snapshot: Snapshot[Any] | None,
    earlier: Distribution | None,
) -> StateAdvice:
    dist = s.distribution
    n = dist.count
    q = 1 - rate
    q_seconds = dist.quantile(q)
    warnings: list[str] = []
    fired_completed = _fired_completed(s, mode, completed, warnings)
    suggested, reason = _suggestion(n, need, q, q_seconds, margin, floor)
    growing = _trend(dist, earlier, warnings)
    oldest = live_over = None
    if snapshot is not None:
        oldest, live_over, tail = _live(s, ages or [], suggested, warnings)
        growing = growing or tail
    _warn_cut(s, mode, warnings)
    return StateAdvice(
        state=s.state,
        count=n,
        p50=dist.quantile(0.5),
        p99=dist.quantile(0.99),
        p999=dist.quantile(0.999),
        max=dist.quantile(1.0),
        quantile=q,
        quantile_seconds=q_seconds,
        deadline=s.deadline,
        fired=s.fired,
        fired_completed=fired_completed,
        over_deadline=_count_above(dist, s.deadline),
        suggested=suggested,
        over_suggested=_count_above(dist, suggested),
        enough_data=n >= need,
        min_samples=need,
        growing=growing,
        oldest=oldest,
        live_over=live_over,
        reason=reason,
        warnings=tuple(warnings),
    )


def _warn_cut(s: StateStatistics, mode: Mode | None, warnings: list[str]) -> None:
    """Enforce mode: warn that the stays the deadline failed were cut short."""
    if mode == "enforce" and s.fired:
        warnings.append(
            f"enforce mode: {s.fired} stay(s) were cut at the current deadline when it "
            "failed them; how long they would have lasted is unknown (learn it in report "
            "mode)"
        )


def _count_above(dist: Distribution, seconds: float | None) -> int | None:
    """The recorded stays longer than *seconds* (None: no deadline to count against)."""
    return None if seconds is None else dist.count_above(seconds)


def _earlier(s: StateStatistics, baseline: Statistics | None) -> Distribution | None:
    """The baseline's distribution for *s*'s state, if it is an earlier copy of it."""
    if baseline is None:
        return None
    before = baseline.states.get(s.state)
    if before is None:
        return None
    dist, old = s.distribution, before.distribution
    if not _could_precede(old, dist):
        raise ValueError(
            f"baseline: state {s.state!r} is not an earlier copy of the same statistics "
            "(different buckets, or more values than now)"
        )
    return old


def _could_precede(old: Distribution, dist: Distribution) -> bool:
    """Whether *old* can be an earlier copy of *dist*: the same buckets, none fuller."""
    return old.bounds == dist.bounds and all(
        b <= a for a, b in zip(dist.counts, old.counts, strict=True)
    )


def _trend(dist: Distribution, earlier: Distribution | None, warnings: list[str]) -> bool:
    if earlier is None:
        return False
    recent = dist - earlier
    if earlier.count < TREND_MIN or recent.count < TREND_MIN:
        return False
    before = earlier.quantile_range(0.99)
    after = recent.quantile_range(0.99)
    assert before is not None and after is not None
    if after[0] > GROWTH_FACTOR * before[1]:
        warnings.append(
            f"the tail is growing: p99 of the latest {recent.count} stays is above "
            f"{format_seconds(after[0])}, against at most {format_seconds(before[1])} for "
            f"the {earlier.count} in the baseline"
        )
        return True
    return False


# --------------------------------------------------------------------------- Prometheus


def _parser(text: str) -> Any:
    """prometheus_client's parser for *text*: OpenMetrics (a saved OpenMetrics scrape
    ends with ``# EOF``) or the Prometheus text format (a saved ``/metrics`` scrape,
    ``/federate`` output)."""
    try:
        if text.rstrip().endswith("# EOF"):
            from prometheus_client.openmetrics.parser import text_string_to_metric_families
        else:
            from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        raise ValueError(
            "reading a Prometheus exposition needs prometheus_client "
            "(pip install prometheus-client; SGLang and vLLM install it)"
        ) from None
    return text_string_to_metric_families


def read_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a Prometheus text exposition or an OpenMetrics one (ending with
    ``# EOF``), read by prometheus_client's parsers: ``(name, labels, value)``.
    Comments, blank lines, timestamps and exemplars are skipped; UTF-8 metric names
    (``{"sglang:x_bucket",le="1"}``) are read; ``+Inf``, ``-Inf`` and ``NaN`` values are
    the floats they name.

    Raises:
        ValueError: naming the line, for a line that is not a sample.
    """
    return [(name, labels, value) for _, name, labels, value in _samples(text)]


def _sample_lines(text: str) -> list[int]:
    """The line numbers of *text*'s sample lines (not blank, not a comment)."""
    return [number for number, line in enumerate(text.splitlines(), 1) if _is_sample(line)]


def _is_sample(line: str) -> bool:
    """Whether *line* of an exposition is a sample (not blank, not a comment)."""
    return bool(line.strip()) and not line.lstrip().startswith("#")


def _bad_line(text: str, parse: Any, error: Exception) -> ValueError:
    """The error for a text the parser refused, naming its first bad line."""
    header = [line for line in text.splitlines() if line.lstrip().startswith("#")]
    om = text.rstrip().endswith("# EOF")
    for number, line in enumerate(text.splitlines(), 1):
        if not _is_sample(line):
            continue
        try:
            list(parse("\n".join([*header, line, "# EOF"] if om else [line]) + "\n"))
        except Exception as e:
            return ValueError(f"line {number} is not a Prometheus sample: {_short(line)} ({e})")
    return ValueError(f"not a Prometheus exposition: {error}")


def _samples(text: str) -> Iterable[tuple[int | None, str, dict[str, str], float]]:
    """``(line number, name, labels, value)`` for each sample of *text* (the number is
    None when the samples cannot be matched to lines one to one)."""
    if not isinstance(text, str):
        raise TypeError(f"a Prometheus exposition is text, got {type(text).__name__}")
    parse = _parser(text)
    try:
        samples = [s for family in parse(text) for s in family.samples]
    except Exception as e:  # the parsers raise ValueError, and others on odd input
        raise _bad_line(text, parse, e) from None
    lines = _sample_lines(text)
    numbers: list[int | None] = list(lines) if len(lines) == len(samples) else [None] * len(samples)
    for number, sample in zip(numbers, samples, strict=True):
        yield number, str(sample.name), dict(sample.labels), float(sample.value)


def _short(text: str) -> str:
    """repr(text), cut to a readable length for a message."""
    shown = repr(text)
    return shown if len(shown) <= 80 else f"{shown[:77]}... ({len(text)} characters)"


def _series(name: str, labels: Mapping[str, str]) -> str:
    """``name{a="x",...}`` as the exposition writes it (shortened), for messages."""
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    text = f"{name}{{{inner}}}" if inner else name
    return text if len(text) <= 120 else f"{text[:117]}..."


def _at(number: int | None) -> str:
    return f"line {number}: " if number is not None else ""


def _bucket_bound(number: int | None, name: str, labels: Mapping[str, str]) -> float:
    """The ``le`` of a bucket sample: a number or ``+Inf`` (``NaN`` and ``-Inf`` bound
    nothing)."""
    text = labels["le"]
    try:
        bound = float(text)
    except ValueError:
        bound = math.nan
    if math.isnan(bound) or bound == -math.inf:
        raise ValueError(
            f"{_at(number)}{_series(name, labels)}: le={_short(text)} is not a bucket "
            'bound; a bucket\'s le is a number, or "+Inf" for the last one'
        )
    return bound


def _count_value(number: int | None, name: str, labels: Mapping[str, str], value: float) -> float:
    """A sample that counts something (a bucket, a counter): finite and not negative."""
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{_at(number)}{_series(name, labels)} {exposed(value)}: a count must be a "
            "finite number >= 0 (NaN and infinite counts mean nothing)"
        )
    return value


def exposed(value: float) -> str:
    """*value* as the exposition writes it (``+Inf``, ``-Inf``, ``NaN``)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def _whole(total: float, what: str) -> int:
    """A summed count as an int (sums of huge counts can overflow a float)."""
    if not math.isfinite(total):
        raise ValueError(f"{what}: the counts summed over the series are too large ({total!r})")
    return round(total)


def statistics_from_prometheus(
    text: str,
    *,
    histogram: str,
    spec: str = "",
    where: Mapping[str, str] | None = None,
    state_label: str = "state",
    deadlines: Mapping[str, float | None] | None = None,
    deadline_gauge: str | None = None,
    fired_counter: str | None = None,
    completed_counter: str | None = None,
) -> Statistics:
    """Time-in-state statistics from a Prometheus text exposition.

    The series of *histogram* (``<histogram>_bucket`` with ``le``, ``<histogram>_sum``)
    whose labels include *where* are summed per value of *state_label* (over every other
    label, e.g. ranks). Quantiles then have the scrape's bucket resolution, estimated
    from above (see :meth:`Distribution.quantile`); the maximum is unknown.

    Args:
        histogram: the histogram's metric name (without ``_bucket``).
        spec: the name to give the statistics.
        where: labels a series must carry to count (e.g. ``{"backend": "nixl"}``).
        state_label: the label naming the state.
        deadlines: the current deadline per state, if known; else read from
            *deadline_gauge* (a gauge per state, in seconds; the maximum across series).
        fired_counter: a counter per state of requests the deadline fired on (summed).
        completed_counter: a counter per state of reported requests that then completed
            normally (summed).

    ``+Inf``, ``-Inf`` and ``NaN`` are valid exposition values: ``le="+Inf"`` is the
    last bucket (required); a ``NaN`` gauge is ignored and a ``+Inf`` one means no
    deadline; a sum may be anything. What cannot mean anything is refused, naming the
    line, the series and the value: an ``le`` that is ``NaN``, ``-Inf`` or not a number,
    and a bucket or counter value that is ``NaN``, infinite or negative.

    Raises:
        ValueError: if the text has no bucket of *histogram* matching *where*, or
            inconsistent buckets, or a line that is not a sample, or a value above that
            cannot mean anything (the message names the line, the series, the value).
    """
    where = dict(where or {})
    scrape = _Scrape(histogram, deadline_gauge, fired_counter, completed_counter)
    for number, name, labels, value in _samples(text):
        if all(labels.get(k) == v for k, v in where.items()) and state_label in labels:
            scrape.add(labels[state_label], number, name, labels, value)
    if not scrape.buckets:
        raise ValueError(
            f"no {histogram}_bucket series with labels {where!r} and a {state_label!r} "
            "label in the text"
        )
    states = {
        state: scrape.statistics(state, per, deadlines)
        for state, per in sorted(scrape.buckets.items())
    }
    return Statistics(spec=spec, mode=None, states=states)


def _counter_names(counter: str | None) -> tuple[str, ...]:
    """The names a counter's samples may have (none for no counter)."""
    return () if counter is None else (counter, f"{counter}_total")


@attrs.define
class _Scrape:
    """The samples of a histogram (*histogram*) and of the gauge and counters that go
    with it, summed per state (:func:`statistics_from_prometheus`)."""

    histogram: str
    deadline_gauge: str | None
    fired_counter: str | None
    completed_counter: str | None
    buckets: dict[str, dict[float, float]] = attrs.Factory(dict)
    sums: dict[str, float] = attrs.Factory(dict)
    gauges: dict[str, float] = attrs.Factory(dict)
    fired: dict[str, float] = attrs.Factory(dict)
    done: dict[str, float] = attrs.Factory(dict)
    fired_names: tuple[str, ...] = attrs.field(init=False)
    done_names: tuple[str, ...] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.fired_names = _counter_names(self.fired_counter)
        self.done_names = _counter_names(self.completed_counter)

    def add(
        self, state: str, number: int | None, name: str, labels: Mapping[str, str], value: float
    ) -> None:
        """Add the sample on line *number* to *state*'s figures, if it is one of them."""
        if name == f"{self.histogram}_bucket" and "le" in labels:
            per = self.buckets.setdefault(state, {})
            _add(
                per, _bucket_bound(number, name, labels), _count_value(number, name, labels, value)
            )
        elif name == f"{self.histogram}_sum":
            _add(self.sums, state, value)
        elif name == self.deadline_gauge:
            if not math.isnan(value):  # NaN: no value (max() would keep it or not by order)
                self.gauges[state] = max(self.gauges.get(state, 0.0), value)
        elif name in self.fired_names:
            _add(self.fired, state, _count_value(number, name, labels, value))
        elif name in self.done_names:
            _add(self.done, state, _count_value(number, name, labels, value))

    def distribution(self, state: str, per: Mapping[float, float]) -> Distribution:
        """*state*'s buckets (*per*: cumulative count by ``le``) and sum, as a
        distribution."""
        bounds = tuple(sorted(per))
        if bounds[-1] != math.inf:
            raise ValueError(f'{self.histogram} for state {state!r} has no le="+Inf" bucket')
        cumulative = [_whole(per[b], f"{self.histogram} for state {state!r}") for b in bounds]
        counts = [c - p for c, p in zip(cumulative, [0, *cumulative[:-1]], strict=True)]
        if any(c < 0 for c in counts):
            raise ValueError(f"{self.histogram} for state {state!r}: buckets are not cumulative")
        return Distribution(bounds, tuple(counts), self.sums.get(state, math.nan), None)

    def statistics(
        self, state: str, per: Mapping[float, float], deadlines: Mapping[str, float | None] | None
    ) -> StateStatistics:
        """*state*'s statistics (*per*: its buckets); its deadline is *deadlines*' if
        given, else the gauge's."""
        completed = self.completed_counter
        return StateStatistics(
            state=state,
            deadline=self.deadline(state) if deadlines is None else deadlines.get(state),
            distribution=self.distribution(state, per),
            fired=self.fired_count(state),
            fired_then=self.fired_then(state),
            completed=("completed",) if completed else (),
        )

    def fired_count(self, state: str) -> int | None:
        """*state*'s expiries, summed (None: no counter of them was named)."""
        if self.fired_counter is None:
            return None
        return _whole(self.fired.get(state, 0.0), self.fired_counter)

    def fired_then(self, state: str) -> dict[str, int]:
        """*state*'s reported requests that then completed, summed, as
        ``StateStatistics.fired_then`` holds them (empty: no counter of them)."""
        completed = self.completed_counter
        if not completed:
            return {}
        return {"completed": _whole(self.done.get(state, 0.0), completed)}

    def deadline(self, state: str) -> float | None:
        """*state*'s deadline as the gauge says (0, the exporters' "none", and +Inf say
        there is none)."""
        g = self.gauges.get(state)
        return g if g is not None and 0 < g < math.inf else None


def _add(sums: dict[Any, float], key: object, value: float) -> None:
    sums[key] = sums.get(key, 0.0) + value


def toml_number(seconds: float) -> str:
    """*seconds* as a TOML value: an integer when whole (``30``), else the float's
    shortest exact spelling (``1.25``)."""
    return str(int(seconds)) if seconds == int(seconds) else repr(seconds)
