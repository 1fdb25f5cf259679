"""Each expiry counted once, in the core, with its reason (issue 23).

``StateStatistics.forced`` (enforce mode) and ``.reported`` (report mode) count the
expiries a watchdog delivered, by state and reason (``state``, ``stall``,
``lifetime``): each once, less the enforced ones an enforcement hook withdrew
(``stallguard.CONCLUDED``). ``StatisticsExporter(forced=, reported=)`` adds them to
Prometheus counters, and ``expiries_since`` hands them to an adapter that ships counts
elsewhere, each once. The same guarantees under interrupted deliveries:
tests/test_stateful.py.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from _profiles import at_least
from hypothesis import given, settings
from hypothesis import strategies as st

import stallguard as sg
from stallguard.adapters import StatisticsExporter, expiries_since
from stallguard.testing import FakeClock

pytestmark = pytest.mark.usefixtures("no_hooks")

SPEC = sg.Spec(
    "counts",
    {"a": 1, "b": sg.Deadline(seconds=3, stall=1), "c": None},
    terminal=["ok", "err"],
    lifetime=4,
)


class FakeCounter:
    """prometheus_client's ``Counter`` as the exporter uses it."""

    def __init__(self) -> None:
        self.values: Counter[tuple[tuple[str, str], ...]] = Counter()

    def labels(self, **labels: str) -> Any:
        values = self.values

        class Child:
            def inc(self, n: float = 1) -> None:
                assert n > 0
                values[tuple(sorted(labels.items()))] += int(n)

        return Child()

    def by_state_reason(self) -> Counter[tuple[str, str]]:
        return Counter({(dict(k)["state"], dict(k)["reason"]): n for k, n in self.values.items()})


class FakeHistogram:
    def labels(self, **labels: str) -> Any:
        return self

    def observe(self, value: float) -> None:  # (no _buckets: the exporter observes)
        pass


def counted(stats: sg.Statistics, kind: str) -> Counter[tuple[str, str]]:
    out: Counter[tuple[str, str]] = Counter()
    for label, s in stats.states.items():
        for reason, n in getattr(s, kind).items():
            assert n > 0  # a reason that never fired (or was all withdrawn) is absent
            out[label, reason] += n
    return out


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("observe"), st.integers(0, 4), st.sampled_from(["a", "b", "c", "ok", "err"])
        ),
        st.tuples(st.just("heartbeat"), st.integers(0, 4)),
        st.tuples(st.just("forget"), st.integers(0, 4)),
        st.tuples(st.just("advance"), st.sampled_from([0.5, 1.0, 2.0])),
        st.tuples(st.just("check")),
        st.tuples(st.just("export")),
        st.tuples(st.just("withdraw")),
    ),
    max_size=80,
)


@settings(max_examples=at_least(300), deadline=None)
@given(mode=st.sampled_from(["enforce", "report"]), ops=OPS)
def test_each_expiry_counted_once_by_mode_state_and_reason(mode: str, ops: list[Any]) -> None:
    clock = FakeClock()
    withdraw = []

    def enforce(expiry: sg.Expiry[int]) -> object:
        if withdraw:
            withdraw.pop()
            return sg.CONCLUDED
        return None

    wd: sg.Watchdog[int] = sg.Watchdog(
        SPEC,
        on_expire=enforce,
        clock=clock,
        mode=mode,
        statistics=True,  # type: ignore[arg-type]
    )
    forced, reported = FakeCounter(), FakeCounter()
    exporter = StatisticsExporter(
        FakeHistogram(), labels={"lane": "l0"}, forced=forced, reported=reported
    )
    shipped: Counter[tuple[str, str, str]] = Counter()
    sent: dict[tuple[str, str, str], int] = {}
    returned: Counter[tuple[str, str]] = Counter()
    for op in ops:
        name, *args = op
        if name == "observe":
            wd.observe(args[0], args[1])
        elif name == "heartbeat":
            wd.heartbeat(args[0])
        elif name == "forget":
            wd.forget(args[0])
        elif name == "advance":
            clock.advance(args[0])
        elif name == "check":
            returned.update((e.state_label, e.reason) for e in wd.check())
        elif name == "export":
            exporter.export(wd.statistics())
            shipped.update(expiries_since(wd.statistics(), sent))
        else:
            withdraw.append(True)
    clock.advance(10)
    returned.update((e.state_label, e.reason) for e in wd.check())
    stats = wd.statistics()
    mine, other = ("forced", "reported") if mode == "enforce" else ("reported", "forced")
    assert counted(stats, mine) == returned
    assert not counted(stats, other)
    exporter.export(stats)
    exporter.export(wd.statistics())  # nothing new: nothing added
    assert (forced if mode == "enforce" else reported).by_state_reason() == returned
    assert not (reported if mode == "enforce" else forced).values
    shipped.update(expiries_since(stats, sent))
    assert expiries_since(stats, sent) == {}
    assert Counter({(s, r): n for (k, s, r), n in shipped.items() if k == mine}) == returned
    assert all(k == mine for k, _, _ in shipped)
    # the requests counted (fired) never exceed the expiries counted
    for label, s in stats.states.items():
        assert (s.fired or 0) <= sum(getattr(s, mine).values()), label


def test_report_mode_counts_every_deadline_of_a_request() -> None:
    """A request reported for its state deadline, its progress window and its lifetime
    counts three expiries (and one request in ``fired``)."""
    clock = FakeClock()
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock, mode="report", statistics=True)
    wd.observe("r", "b")
    clock.advance(5)
    assert sorted(e.reason for e in wd.check()) == ["lifetime", "stall", "state"]
    b = wd.statistics().states["b"]
    assert b.reported == {"lifetime": 1, "stall": 1, "state": 1}
    assert b.forced == {} and b.fired == 1


def test_a_withdrawn_expiry_is_not_counted() -> None:
    clock = FakeClock()
    wd: sg.Watchdog[str] = sg.Watchdog(
        SPEC,
        on_expire=lambda e: sg.CONCLUDED if e.key == "w" else None,
        clock=clock,
        statistics=True,
    )
    wd.observe("w", "a")
    wd.observe("f", "a")
    clock.advance(1)
    assert [e.key for e in wd.check()] == ["f"]
    a = wd.statistics().states["a"]
    assert a.forced == {"state": 1} and a.reported == {} and a.fired == 1


class Interrupt(BaseException):
    pass


def test_an_export_during_an_interrupted_delivery_is_not_taken_back() -> None:
    """The one documented excess: an enforced expiry exported while an interrupted
    delivery carried it, then withdrawn, stays on the counter (counters only rise); the
    core's own count drops."""
    clock = FakeClock()
    calls = []

    def describe(key: str) -> dict[str, str]:
        calls.append(key)
        if len(calls) == 1:
            raise Interrupt()  # before the enforcement hook is reached
        return {}

    wd: sg.Watchdog[str] = sg.Watchdog(
        SPEC, on_expire=lambda e: sg.CONCLUDED, clock=clock, statistics=True, describe=describe
    )
    forced = FakeCounter()
    exporter = StatisticsExporter(FakeHistogram(), labels={"lane": "l0"}, forced=forced)
    wd.observe("w", "a")
    clock.advance(1)
    with pytest.raises(Interrupt):
        wd.check()
    exporter.export(wd.statistics())
    assert forced.by_state_reason() == {("a", "state"): 1}
    assert wd.check() == []  # the carried expiry is withdrawn
    assert wd.statistics().states["a"].forced == {}
    exporter.export(wd.statistics())
    assert forced.by_state_reason() == {("a", "state"): 1}


def test_failure_labels_default_to_the_histogram_labels() -> None:
    clock = FakeClock()
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock, mode="report", statistics=True)
    reported = FakeCounter()
    StatisticsExporter(FakeHistogram(), labels={"lane": "l0"}, reported=reported)
    exporter = StatisticsExporter(
        FakeHistogram(),
        labels={"lane": "l0", "extra": "x"},
        reported=reported,
        failure_labels={"queue": "q"},
        reason_label="why",
    )
    wd.observe("r", "a")
    clock.advance(1)
    wd.check()
    exporter.export(wd.statistics())
    assert dict(reported.values) == {(("queue", "q"), ("state", "a"), ("why", "state")): 1}
