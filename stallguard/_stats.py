"""Time-in-state statistics: how long requests really stay in each state.

A watchdog records, for every request that *leaves* a state (a state change, a terminal
state, ``forget()``, an enforced expiry), the seconds it spent there, into a fixed
histogram per state. It also counts the requests a deadline fired on (enforce) or would
have fired on (report), and, in report mode, how those requests ended; and every expiry
delivered, by mode, state and reason (``forced``, ``reported``): each once, less the
enforced ones an enforcement hook withdrew. Both modes record.
:func:`stallguard.advise` turns the result into suggested deadlines (see docs/advice.md).

The histogram (docs/advice.md#the-histogram):

* Fixed bucket upper bounds ``BOUNDS``: 1 ms to one week, log-spaced at
  ``2 ** (1/24)``, with every value of ``LADDER`` (the round numbers deadlines are
  suggested in, and the SGLang adapter's Prometheus buckets) inserted as an exact bound,
  plus an underflow bucket (≤ 1 ms) and an overflow bucket (> 1 week). Adjacent bounds
  differ by at most a factor ``RESOLUTION`` (≈ 1.044).
* A bucket holds the values ``bounds[i-1] < v <= bounds[i]`` (Prometheus ``le``).
  Recording is one ``bisect`` over ~760 floats and a few additions: O(1), with memory
  fixed per state whatever the number of requests.
* A quantile is reported as the upper bound of the bucket holding it (clamped to the
  exact maximum): never below the true sample quantile and at most 4.4 % above it, for
  values between 1 ms and one week. Below 1 ms it is reported as 1 ms.

Threads: :class:`StatsRecorder` has no lock of its own. The watchdog calls it while it
holds its own lock and takes the frozen copy (:meth:`StatsRecorder.freeze`) under that
same lock, so a copy is always consistent.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Hashable, Iterable, Mapping
from itertools import pairwise
from types import MappingProxyType
from typing import Any

import attrs

from ._details import Mode
from ._spec import Spec, State, state_label
from ._validate import is_real

__all__ = [
    "BOUNDS",
    "FORGOTTEN",
    "LADDER",
    "RESOLUTION",
    "Distribution",
    "StateStatistics",
    "Statistics",
    "StatsRecorder",
]

#: Smallest and largest finite bucket bound, in seconds (1 ms and one week).
LOW = 1e-3
HIGH = 7 * 86_400.0

#: The round numbers deadlines are suggested in (seconds): 1, 2, 5 x 10^k below ten
#: seconds, then the steps people write for timeouts (15 s, 30 s, 45 s, 1 min, 90 s, 2,
#: 3, 4, 5, 7.5, 10, 15, 20, 30, 45 min, 1 h...) up to one week. Each is an exact bucket
#: bound of ``BOUNDS``, so "how many observed stays are longer than this" is exact.
LADDER: tuple[float, ...] = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    45.0,
    60.0,
    90.0,
    120.0,
    180.0,
    240.0,
    300.0,
    450.0,
    600.0,
    900.0,
    1200.0,
    1800.0,
    2700.0,
    3600.0,
    5400.0,
    7200.0,
    10800.0,
    14400.0,
    21600.0,
    43200.0,
    86400.0,
    172800.0,
    345600.0,
    604800.0,
)

#: Label under which :attr:`StateStatistics.fired_then` counts reported requests that
#: were ``forget()``-ten (aborted) instead of reaching a terminal state.
FORGOTTEN = "forgotten"

_STEP = 2.0 ** (1.0 / 24.0)


def _bounds() -> tuple[float, ...]:
    """Log-spaced points from LOW to HIGH at _STEP; each LADDER value replaces the log
    point nearest to it, so adjacent bounds differ by _STEP ** 0.5 to _STEP ** 1.5."""
    n = math.ceil(math.log(HIGH / LOW) / math.log(_STEP))
    points = [LOW * _STEP**k for k in range(n)]
    for value in LADDER:
        nearest = min(range(len(points)), key=lambda k: abs(math.log(points[k] / value)))
        points[nearest] = value
    bounds = sorted(set(points) | set(LADDER))
    return (*bounds, math.inf)


#: Bucket upper bounds in seconds, increasing; the last is ``inf`` (overflow).
BOUNDS: tuple[float, ...] = _bounds()
#: The largest ratio between adjacent finite bounds: a quantile is reported at most this
#: factor above the true value (between 1 ms and one week).
RESOLUTION: float = max(b / a for a, b in pairwise(BOUNDS[:-1]))
if not (RESOLUTION <= _STEP**1.5 + 1e-12 and set(LADDER) <= set(BOUNDS)):  # pragma: no cover
    raise ImportError(f"stallguard._stats: bad bucket layout (resolution {RESOLUTION})")

_N = len(BOUNDS)


def _rank(q: float, n: int) -> int:
    """1-based rank of the *q* quantile among *n* values: the smallest r with
    r >= q * n (at least 1). Rounded to 9 digits first, so that 0.999 * 1000 is 999."""
    return max(1, math.ceil(round(q * n, 9)))


def sample_quantile(values: Iterable[float], q: float) -> float:
    """The exact *q* quantile of *values* by the rule :meth:`Distribution.quantile`
    estimates: the r-th smallest value, r = ⌈q·n⌉ (at least 1). For tests and for
    comparing with the histogram."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("sample_quantile() of no values")
    return ordered[_rank(q, len(ordered)) - 1]


def _check_q(q: float) -> float:
    if not is_real(q) or not 0 <= q <= 1:
        raise ValueError(f"quantile q must be a number between 0 and 1, got {q!r}")
    return float(q)


@attrs.frozen
class Distribution:
    """A histogram of seconds: how many values fell in each bucket.

    Attributes:
        bounds: bucket upper bounds in seconds, strictly increasing, finite but the
            last, which is ``inf`` (``nan`` is refused: it bounds nothing). A
            bucket holds the values ``bounds[i-1] < v <= bounds[i]``.
        counts: values per bucket (not cumulative), one per bound.
        total: the sum of the values (``nan`` when unknown).
        max: the largest value, or None when unknown (a Prometheus scrape).
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float = 0.0
    max: float | None = None

    def __attrs_post_init__(self) -> None:
        if len(self.bounds) != len(self.counts) or not self.bounds:
            raise ValueError(
                f"Distribution needs one count per bound, got {len(self.counts)} counts "
                f"for {len(self.bounds)} bounds"
            )
        if self.bounds is not BOUNDS:  # (the standard layout is known to be valid)
            _check_bounds(self.bounds)
        if min(self.counts) < 0:
            raise ValueError(f"Distribution counts must be >= 0, got {self.counts!r}")

    @property
    def count(self) -> int:
        """How many values were recorded."""
        return sum(self.counts)

    def quantile_range(self, q: float) -> tuple[float, float] | None:
        """``(low, high)`` with ``low < v <= high`` for the true *q* quantile ``v`` (the
        r-th smallest value, r = ⌈q·n⌉), or None without values."""
        q = _check_q(q)
        n = self.count
        if n == 0:
            return None
        i = self._bucket(_rank(q, n))
        low = self.bounds[i - 1] if i else 0.0
        high = self.bounds[i]
        if self.max is not None and self.max < high:
            high = self.max
        return low, high

    def _bucket(self, rank: int) -> int:
        """The index of the bucket holding the *rank*-th smallest value."""
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank:
                return i
        raise AssertionError("unreachable")  # pragma: no cover

    def quantile(self, q: float) -> float | None:
        """The *q* quantile (0 ≤ q ≤ 1), estimated from above: the upper bound of its
        bucket, clamped to :attr:`max` when known. Never below the true value; at most
        ``RESOLUTION`` times it with ``BOUNDS``. ``inf`` if it lies in an
        overflow bucket whose maximum is unknown; None without values."""
        found = self.quantile_range(q)
        return None if found is None else found[1]

    def count_above(self, seconds: float) -> int:
        """How many values may be longer than *seconds*: every bucket whose upper bound
        exceeds it. Exact when *seconds* is a bound (every ``LADDER`` value is one of
        ``BOUNDS``); otherwise it also counts the bucket straddling *seconds*."""
        i = bisect_left(self.bounds, seconds)
        if i < len(self.bounds) and self.bounds[i] == seconds:
            i += 1
        return sum(self.counts[i:])

    def _check_same_bounds(self, other: Distribution, what: str) -> None:
        if other.bounds != self.bounds:
            raise ValueError(f"cannot {what} distributions with different bounds")

    def __sub__(self, other: Distribution) -> Distribution:
        """The values recorded since *other* (an earlier copy of the same histogram)."""
        self._check_same_bounds(other, "subtract")
        counts = tuple(a - b for a, b in zip(self.counts, other.counts, strict=True))
        if any(c < 0 for c in counts):
            raise ValueError("cannot subtract a later distribution from an earlier one")
        return Distribution(self.bounds, counts, self.total - other.total, None)

    def __add__(self, other: Distribution) -> Distribution:
        """Both distributions' values together (same bounds)."""
        self._check_same_bounds(other, "add")
        counts = tuple(a + b for a, b in zip(self.counts, other.counts, strict=True))
        top = None if self.max is None or other.max is None else max(self.max, other.max)
        return Distribution(self.bounds, counts, self.total + other.total, top)


def _check_bounds(bounds: tuple[float, ...]) -> None:
    """Refuse bucket bounds that are not finite numbers, strictly increasing, then inf."""
    if bounds[-1] != math.inf:
        raise ValueError(f"Distribution bounds must end with inf, got {bounds[-1]!r}")
    for i, b in enumerate(bounds[:-1]):
        if not _finite_number(b):
            raise ValueError(
                f"Distribution bounds must be finite numbers before the last (inf), "
                f"got {b!r} at index {i}"
            )
    if any(b <= a for a, b in pairwise(bounds)):
        raise ValueError("Distribution bounds must be strictly increasing")


def _finite_number(b: object) -> bool:
    """Whether *b* is an int (not a bool) or a finite float."""
    if isinstance(b, bool):
        return False
    return isinstance(b, int) or (isinstance(b, float) and math.isfinite(b))


def _counts(value: Mapping[str, int]) -> Mapping[str, int]:
    return MappingProxyType(dict(value))


def _states(value: Mapping[str, StateStatistics]) -> Mapping[str, StateStatistics]:
    return MappingProxyType(dict(value))


def _empty() -> Distribution:
    return Distribution(BOUNDS, (0,) * _N)


@attrs.frozen
class StateStatistics:
    """What one state's requests did, as recorded by a watchdog (or read from a scrape).

    Attributes:
        state: the state's label.
        deadline: its current state deadline in seconds, or None.
        distribution: seconds spent in the state by the requests that left it.
        fired: requests a deadline (the state deadline, a progress window or the
            lifetime) fired on in this state: expired (enforce) or first reported
            (report; a request counts once, in the state of its first report). None when
            unknown.
        fired_then: report mode: how the requests counted in *fired* ended, by terminal
            state label, or ``FORGOTTEN`` for ``forget()``. Requests still tracked
            are not in it.
        completed: the terminal state labels that count as normal completion (the
            watchdog's rule: the spec's first terminal state).
        forced: enforce mode: the expiries in this state, by reason (``state``,
            ``stall`` or ``lifetime``, as :attr:`~stallguard.Expiry.reason`): each
            expiry once, less those an enforcement hook withdrew (returned
            :data:`~stallguard.CONCLUDED`). A reason that never fired is absent.
        reported: report mode: the expiries in this state, by reason: each once (a
            request may be reported once per deadline, so more than once: unlike
            *fired*, which counts requests).
    """

    state: str
    deadline: float | None
    distribution: Distribution = attrs.field(factory=_empty)
    fired: int | None = 0
    fired_then: Mapping[str, int] = attrs.field(factory=dict, converter=_counts)
    completed: tuple[str, ...] = ()
    forced: Mapping[str, int] = attrs.field(factory=dict, converter=_counts)
    reported: Mapping[str, int] = attrs.field(factory=dict, converter=_counts)

    @property
    def count(self) -> int:
        """How many stays in this state were recorded (requests that left it)."""
        return self.distribution.count

    @property
    def fired_completed(self) -> int:
        """How many would-be false positives there were, i.e. requests whose deadline
        fired (in report mode) and that then reached a terminal state in
        :attr:`completed`."""
        return sum(self.fired_then.get(label, 0) for label in self.completed)


@attrs.frozen
class Statistics:
    """Time-in-state statistics of one watchdog (:meth:`stallguard.Watchdog.statistics`)
    or of a metrics scrape (:func:`stallguard.statistics_from_prometheus`).

    Attributes:
        spec: the spec's name.
        mode: the watchdog's mode when copied (None when unknown).
        states: per non-terminal state label, its :class:`StateStatistics`.
    """

    spec: str
    mode: Mode | None
    states: Mapping[str, StateStatistics] = attrs.field(converter=_states)


class _Hist:
    """One state's mutable histogram and counters (lock held by the caller)."""

    __slots__ = ("counts", "fired", "forced", "label", "max", "reported", "then", "total")

    def __init__(self, label: str) -> None:
        self.label = label
        self.counts = [0] * _N
        self.total = 0.0
        self.max = -1.0  # no value yet
        self.fired = 0
        self.then: dict[str, int] = {}
        #: expiries by reason, enforce and report mode
        self.forced: dict[str, int] = {}
        self.reported: dict[str, int] = {}

    def add(
        self,
        seconds: float,
        _bisect: Any = bisect_left,  # bound as defaults: no global lookups (hot path)
        _bounds: tuple[float, ...] = BOUNDS,
    ) -> None:
        """One stay of *seconds* (the watchdog calls this on every state leave)."""
        self.counts[_bisect(_bounds, seconds)] += 1
        self.total += seconds
        if seconds > self.max:
            self.max = seconds


class StatsRecorder:
    """Records time in state and deadline firings for one watchdog.

    Not thread-safe on its own: call it with the watchdog's lock held (the watchdog
    does). Memory: one fixed histogram per non-terminal state, plus one dict entry per
    request that was reported in report mode and is still tracked.

    Args:
        spec: the spec whose non-terminal states are recorded.
        completed: terminal states that count as normal completion for
            :attr:`StateStatistics.fired_completed`; default: the spec's first terminal
            state (``Success`` in ``terminal=["Success", "Failed"]``), none if it has none.

    Which watchdog event calls which method:

    * a request leaves a non-terminal state (state change, terminal state, ``forget()``,
      enforced expiry, or any state stay the watchdog tracked without a deadline FIFO):
      :meth:`left` ``(state, seconds in it)``;
    * a deadline fires (each :class:`~stallguard.Expiry`): :meth:`fired`; an
      enforcement hook withdraws it: :meth:`unfired`;
    * a tracked request reaches a terminal state: :meth:`ended` ``(key, terminal)``;
      ``forget()`` of a tracked request: :meth:`ended` ``(key, None)``.
    """

    def __init__(self, spec: Spec, *, completed: Iterable[State] | None = None) -> None:
        self.spec = spec
        self._hists: dict[Any, _Hist] = {}
        for state in spec.deadlines:
            self._hists[state] = _Hist(state_label(state))
        self._labels = {state: state_label(state) for state in spec.terminal}
        self.completed = self._completed(completed)
        # report mode: key -> the histogram of the state of its first report
        self._reported: dict[Hashable, _Hist] = {}

    def _completed(self, completed: Iterable[State] | None) -> tuple[str, ...]:
        """The labels of the terminal states that count as normal completion."""
        spec = self.spec
        if completed is None:
            return (state_label(spec.terminal[0]),) if spec.terminal else ()
        done = tuple(state_label(s) for s in completed)
        unknown = [label for label in done if label not in self._labels.values()]
        if unknown:
            raise ValueError(
                f"completed={unknown!r}: not terminal states of spec {spec.name!r} "
                f"(terminal: {list(self._labels.values())!r})"
            )
        return done

    def left(self, state: State, seconds: float) -> None:
        """A request left non-terminal *state* after *seconds* in it."""
        self._hists[state].add(seconds)

    def hist(self, state: State) -> _Hist:
        """*state*'s histogram, for a watchdog to call :meth:`_Hist.add` on directly
        (one call less per state change than :meth:`left`)."""
        return self._hists[state]

    def fired(self, key: Hashable, state: State, enforce: bool, reason: str) -> None:
        """*key*'s deadline of *reason* fired while it was in *state* (one expiry).
        The expiry is counted by reason. Enforce: the request is counted (it is gone).
        Report: the request is counted once (its first report), and remembered until
        :meth:`ended` tells how it ended."""
        h = self._hists[state]
        reported = self._reported
        if enforce:
            h.fired += 1
            h.forced[reason] = h.forced.get(reason, 0) + 1
            if reported:
                reported.pop(key, None)
        else:
            h.reported[reason] = h.reported.get(reason, 0) + 1
            if key not in reported:
                reported[key] = h
                h.fired += 1

    def unfired(self, state: State, reason: str) -> None:
        """An enforced expiry in *state* for *reason* was withdrawn (the request had
        concluded): neither the request nor the expiry counts."""
        h = self._hists[state]
        h.fired -= 1
        left = h.forced[reason] - 1
        if left:
            h.forced[reason] = left
        else:
            del h.forced[reason]

    def ended(self, key: Hashable, terminal: State | None) -> None:
        """Tracked *key* reached *terminal* (None: it was forgotten)."""
        if not self._reported:
            return
        h = self._reported.pop(key, None)
        if h is not None:
            label = FORGOTTEN if terminal is None else self._labels[terminal]
            h.then[label] = h.then.get(label, 0) + 1

    @property
    def reported(self) -> int:
        """Requests reported in report mode and still tracked (memory held)."""
        return len(self._reported)

    def freeze(self, mode: Mode | None) -> Statistics:
        """A frozen copy (call with the same lock held as the recording)."""
        states: dict[str, StateStatistics] = {}
        for state, h in self._hists.items():
            dist = Distribution(BOUNDS, tuple(h.counts), h.total, h.max if h.max >= 0 else None)
            states[h.label] = StateStatistics(
                state=h.label,
                deadline=self.spec.deadlines[state].seconds,
                distribution=dist,
                fired=h.fired,
                fired_then=dict(h.then),
                completed=self.completed,
                forced=h.forced,
                reported=h.reported,
            )
        return Statistics(spec=self.spec.name, mode=mode, states=states)
