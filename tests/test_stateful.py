"""A stateful property test: one watchdog driven through random sequences of every
operation, checked against a small reference model after every step.

The reference model scans every request on every check (obviously correct, far too slow
for production). Hypothesis drives both with the same operations: observe (known and
unknown states, a terminal state at first sight, repeated states, ``at=``), heartbeat,
forget with and without ``remember``, annotate, ``check`` with and without ``now``,
clock moves, and an enforcement hook, an expiry listener, a leave listener and
``describe`` that raise an ``Exception`` or a ``BaseException`` when armed to.

After every step it asserts the documented guarantees:

* exactly once: each state entry's overdue deadline is delivered once, never twice;
* nothing concluded (terminal, forgotten, expired) ever expires, and late events never
  resurrect a request;
* nothing overdue is missed: every check returns exactly what the model says is due
  (plus what an interrupted check could not deliver);
* nothing overdue survives a check: after ``check(now)`` (interrupted or not) no live
  entry anywhere in any deadline FIFO is due at *now* (not only the heads);
* each FIFO is in time order (what "only the head can be due" rests on);
* every leave notification reaches the listeners exactly once: at once, or (after an
  interruption) by the next check;
* ``len()``, ``in``, ``state_of()`` and ``snapshot()`` agree with the model;
* with ``statistics=True``, the core counts each expiry once, by mode, state and reason:
  after every check that was not interrupted, ``StateStatistics.forced`` (enforce) or
  ``.reported`` (report) equal the expiries the checks returned (withdrawn ones
  excluded), the other mode's counts are empty, and a ``StatisticsExporter`` exported
  at random moments has added exactly those to its counters, once (plus, the one
  documented excess, an expiry exported while an interrupted delivery carried it and
  withdrawn after: counters only rise);
* remembered keys stay bounded by ``memory``.

``HYPOTHESIS_PROFILE=long`` (tests/conftest.py) runs many more examples locally.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from typing import Any

import pytest
from _profiles import at_least
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import stallguard as sg
from stallguard.adapters import StatisticsExporter
from stallguard.instrumentation import set_on_expire_hooks
from stallguard.testing import FakeClock

SPEC = sg.Spec(
    "stateful",
    {"a": 3, "b": 5, "c": sg.Deadline(seconds=8, stall=2), "d": None},
    terminal=["ok", "err"],
    lifetime=12,
)
STATES = ["a", "b", "c", "d", "ok", "err"]
KEYS = st.integers(0, 5)
LAGS = st.sampled_from([None, None, 0.0, 0.5, 1.5])


class FakeCounter:
    """prometheus_client's ``Counter`` as the exporter uses it: ``labels(**l).inc(n)``."""

    def __init__(self) -> None:
        self.values: Counter[tuple[tuple[str, str], ...]] = Counter()

    def labels(self, **labels: str) -> Any:
        counter = self

        class Child:
            def inc(self, n: float = 1) -> None:
                assert n > 0
                counter.values[tuple(sorted(labels.items()))] += int(n)

        return Child()

    def by_state_reason(self) -> Counter[tuple[str, str]]:
        out: Counter[tuple[str, str]] = Counter()
        for labels, n in self.values.items():
            got = dict(labels)
            assert got.pop("lane") == "l0"
            out[got["state"], got["reason"]] += n
        return out


class FakeHistogram:
    def labels(self, **labels: str) -> Any:
        return self

    def observe(self, value: float) -> None:
        pass


class Interrupt(BaseException):
    """What an enforcement action raises to simulate KeyboardInterrupt / SystemExit."""


class Model:
    """The documented behaviour, by brute force."""

    def __init__(self, mode: str, memory: int, spec: sg.Spec) -> None:
        self.mode = mode
        self.memory = memory
        self.spec = spec
        self.live: dict[int, dict[str, Any]] = {}
        # concluded keys, oldest first: True = expired (enforce), False = concluded
        self.gone: OrderedDict[int, bool] = OrderedDict()
        self.reported: set[tuple[int, str]] = set()
        self.late = 0
        self.seq = 0  # counts entries made on the watchdog's clocks (their FIFO order)
        self.leaves: Counter[tuple[str, float]] = Counter()  # every leave notification due

    def bury(self, key: int, expired: bool) -> None:
        if key in self.gone:
            return
        self.gone[key] = expired
        if len(self.gone) > self.memory:
            self.gone.popitem(last=False)

    def observe(self, key: int, state: str, t: float) -> None:
        terminal = state in self.spec.terminal
        rec = self.live.get(key)
        if rec is None:
            if terminal and self.gone.get(key) is True:
                self.late += 1  # the end of a request that was failed: too late
            elif terminal:
                self.bury(key, False)  # the terminal-first-sight rule
            elif key in self.gone:
                self.late += 1
            else:
                self.seq += 1
                self.live[key] = {
                    "state": state,
                    "entered": t,
                    "beat": t,
                    "born": t,
                    "s_state": self.seq,
                    "s_beat": self.seq,
                    "s_born": self.seq,
                }
            return
        if rec["state"] == state:
            return
        self.leaves[rec["state"], max(t, rec["entered"]) - rec["entered"]] += 1
        if terminal:
            del self.live[key]
            self.bury(key, False)
            self.reported -= {(key, "state"), (key, "stall"), (key, "lifetime")}
            return
        self.seq += 1
        rec.update(state=state, entered=max(t, rec["entered"]), beat=max(t, rec["entered"]))
        rec.update(s_state=self.seq, s_beat=self.seq)
        self.reported -= {(key, "state"), (key, "stall")}

    def heartbeat(self, key: int, t: float) -> bool:
        rec = self.live.get(key)
        if rec is None:
            return False
        if t > rec["beat"]:  # a renewal that renews nothing re-arms nothing
            rec["beat"] = t
            self.seq += 1
            rec["s_beat"] = self.seq
            self.reported.discard((key, "stall"))
        return True

    def forget(self, key: int, remember: bool, now: float) -> bool:
        rec = self.live.pop(key, None)
        tracked = rec is not None
        if rec is not None:
            self.leaves[rec["state"], now - rec["entered"]] += 1
        self.reported -= {(key, "state"), (key, "stall"), (key, "lifetime")}
        if remember:
            self.bury(key, False)
        else:
            self.gone.pop(key, None)
        return tracked

    def due(self, rec: dict[str, Any]) -> list[tuple[float, str, float, tuple[int, int, int]]]:
        """(due, reason, since, order): *order* is where the watchdog meets the entry in
        one check (clock by clock: state deadlines in spec order, progress windows, the
        lifetime; within a clock, in the order entries were made). Ties between a
        request's deadlines go to the most specific reason, as documented."""
        deadline = self.spec.deadlines[rec["state"]]
        slot = list(self.spec.deadlines).index(rec["state"])
        out = []
        if deadline.seconds is not None:
            out.append(
                (
                    rec["entered"] + deadline.seconds,
                    "state",
                    rec["entered"],
                    (0, slot, rec["s_state"]),
                )
            )
        if deadline.stall is not None:
            out.append(
                (rec["beat"] + deadline.stall, "stall", rec["beat"], (1, slot, rec["s_beat"]))
            )
        if self.spec.lifetime is not None:
            out.append(
                (rec["born"] + self.spec.lifetime, "lifetime", rec["born"], (2, 0, rec["s_born"]))
            )
        return sorted(out, key=lambda d: (d[0], d[3]))

    def check(self, now: float) -> set[tuple[int, str, float]]:
        result = set()
        expired = []
        for key, rec in list(self.live.items()):
            overdue = [d for d in self.due(rec) if d[0] <= now]
            if not overdue:
                continue
            if self.mode == "enforce":
                due, reason, since, order = overdue[0]
                result.add((key, reason, since))
                expired.append(((due, order), key))
            else:
                for _, reason, since, _order in overdue:
                    if (key, reason) not in self.reported:
                        self.reported.add((key, reason))
                        result.add((key, reason, since))
        # the watchdog remembers expired keys in the order it finds them (a full memory
        # forgets the oldest first)
        for _, key in sorted(expired):
            rec = self.live.pop(key)
            self.leaves[rec["state"], now - rec["entered"]] += 1
            self.bury(key, True)
        return result


class WatchdogMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.last_at = -math.inf
        # what the enforcement action should do on its next call: None, "error", "interrupt"
        self.arm: str | None = None
        self.delivered: list[tuple[int, str, float]] = []  # every expiry the action saw
        self.carried: set[tuple[int, str, float]] = set()  # due, not yet returned
        # describe=: what it should do on its next call (None, "error", "interrupt"), the
        # keys it was called for, and the attributes each delivered expiry carried
        self.describe_arm: str | None = None
        self.described: list[int] = []
        self.failed_describe = 0
        self.attributes: list[tuple[int, dict[str, Any]]] = []
        # the enforcement hook: whether its next call finds the request concluded (and
        # returns stallguard.CONCLUDED), and the expiries it withdrew so
        self.withdraw_next = False
        self.withdrawn: list[tuple[int, str, float]] = []
        self.withdrawn_state: dict[tuple[int, str, float], str] = {}
        # carried expiries an export may have counted before they were withdrawn
        self.carried_at_export: set[tuple[int, str, float]] = set()
        self.withdrawn_undescribed = 0
        # the enforcement hook and the leave listener: what each should do on its next
        # call (None, "error", "interrupt"); the leave notifications heard (by a
        # listener after the one that raises)
        self.enforce_arm: str | None = None
        self.leave_arm: str | None = None
        self.heard: Counter[tuple[str, float]] = Counter()
        self.checked_at: float | None = None  # the latest check's now
        # (state label, reason) of every expiry a check returned (statistics=True)
        self.returned: Counter[tuple[str, str]] = Counter()
        self.forced_counter = FakeCounter()
        self.reported_counter = FakeCounter()
        self.exporter = StatisticsExporter(
            FakeHistogram(),
            labels={"lane": "l0"},
            forced=self.forced_counter,
            reported=self.reported_counter,
        )

    @initialize(
        mode=st.sampled_from(["enforce", "report"]),
        memory=st.sampled_from([1, 3, 64]),
        lifetime=st.sampled_from([None, 12]),
        describe=st.booleans(),
        statistics=st.booleans(),
    )
    def start(
        self, mode: str, memory: int, lifetime: float | None, describe: bool, statistics: bool
    ) -> None:
        set_on_expire_hooks([])  # no logging or spans: the listeners see everything
        spec = SPEC.evolve(lifetime=lifetime)
        self.model = Model(mode, memory, spec)
        self.memory = memory

        def record(expiry: sg.Expiry[int]) -> None:
            self.delivered.append((expiry.key, expiry.reason, expiry.entered_at))
            self.attributes.append((expiry.key, dict(expiry.attributes)))

        def describe_key(key: int) -> dict[str, Any]:
            self.described.append(key)
            arm, self.describe_arm = self.describe_arm, None
            if arm == "error":
                self.failed_describe += 1
                raise ValueError("describe failed")
            if arm == "interrupt":
                self.failed_describe += 1
                raise Interrupt()
            return {"described": key, "k": -1}  # "k": annotate's wins

        def action(expiry: sg.Expiry[int]) -> None:
            arm, self.arm = self.arm, None
            if arm == "error":
                raise ValueError("enforcement action failed")
            if arm == "interrupt":
                raise Interrupt()

        def enforce(expiry: sg.Expiry[int]) -> Any:
            arm, self.enforce_arm = self.enforce_arm, None
            if arm == "error":
                raise ValueError("enforcement hook failed")
            if arm == "interrupt":
                raise Interrupt()
            if self.withdraw_next:
                self.withdraw_next = False
                self.withdrawn.append((expiry.key, expiry.reason, expiry.entered_at))
                self.withdrawn_state[self.withdrawn[-1]] = expiry.state_label
                if "described" not in expiry.attributes:
                    self.withdrawn_undescribed += 1
                return sg.CONCLUDED
            return None

        self.wd: sg.Watchdog[int] = sg.Watchdog(
            spec,
            on_expire=enforce,
            clock=self.clock,
            mode=mode,  # type: ignore[arg-type]
            memory=memory,
            unknown_state="raise",
            describe=describe_key if describe else None,
            statistics=statistics,
        )
        self.describing = describe
        # the recorder sees every expiry in both modes; the action may raise
        self.wd.add_listener(on_expire=record)
        self.wd.add_listener(on_expire=action)

        def leave_action(label: str, seconds: float) -> None:
            arm, self.leave_arm = self.leave_arm, None
            if arm == "error":
                raise ValueError("leave listener failed")
            if arm == "interrupt":
                raise Interrupt()

        def hear(label: str, seconds: float) -> None:
            self.heard[label, seconds] += 1

        # the raising one first: an interruption keeps the notification from the other
        self.wd.add_listener(on_leave=leave_action)
        self.wd.add_listener(on_leave=hear)

    # ------------------------------------------------------------------ operations

    def _time(self, lag: float | None) -> tuple[float | None, float]:
        """(at, t): changes applied late come in the order they happened."""
        if lag is None:
            self.last_at = self.clock()
            return None, self.clock()
        t = self.last_at = max(self.clock() - lag, self.last_at)
        return t, t

    @rule(key=KEYS, state=st.sampled_from(STATES), lag=LAGS, admit=st.booleans())
    def observe(self, key: int, state: str, lag: float | None, admit: bool) -> None:
        if admit:  # the change then goes onto the FIFOs (see admit_all)
            self.admit_all()
        at, t = self._time(lag)
        try:
            self.wd.observe(key, state, at=at)
        except Interrupt:  # from the leave listener: the change holds, the rest is carried
            assert self.interrupted_leave()
        self.model.observe(key, state, t)

    @rule(key=KEYS, state=st.sampled_from(["nope", 3, ("a",), ["unhashable"]]))
    def observe_unknown(self, key: int, state: Any) -> None:
        with pytest.raises(sg.UnknownStateError):
            self.wd.observe(key, state)

    @rule(key=KEYS, lag=LAGS, admit=st.booleans())
    def heartbeat(self, key: int, lag: float | None, admit: bool) -> None:
        if admit:
            self.admit_all()
        at, t = self._time(lag)
        assert self.wd.heartbeat(key, at=at) == self.model.heartbeat(key, t)

    @rule(key=KEYS, remember=st.booleans())
    def forget(self, key: int, remember: bool) -> None:
        tracked = self.model.forget(key, remember, self.clock())
        try:
            assert self.wd.forget(key, remember=remember) == tracked
        except Interrupt:
            assert tracked and self.interrupted_leave()

    def interrupted_leave(self) -> bool:
        """An Interrupt outside check() comes from the leave listener, armed for it."""
        return self.leave_arm is None  # (it disarmed itself)

    @rule(key=KEYS)
    def annotate(self, key: int) -> None:
        assert self.wd.annotate(key, attributes={"k": key}) == (key in self.model.live)

    @rule(seconds=st.sampled_from([0, 0.5, 1, 2, 2.5, 3, 5, 13]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def admit_all(self) -> None:
        """Deferred admission changes no outcome: every young request admitted now (as
        a check or next_deadline() does once one might be due) is expired, reported
        and snapshotted as before, and its later changes go onto the FIFOs."""
        with self.wd._lock:
            self.wd._young.settle(float("inf"))

    @precondition(lambda self: self.model.mode == "enforce")
    @rule()
    def next_deadline(self) -> None:
        """Exact, young requests included (enforce mode: every live deadline pending)."""
        dues = [d[0] for rec in self.model.live.values() for d in self.model.due(rec)]
        assert self.wd.next_deadline() == (min(dues) if dues else None)

    @rule(kind=st.sampled_from(["error", "interrupt"]))
    def arm_action(self, kind: str) -> None:
        self.arm = kind

    @rule(kind=st.sampled_from(["error", "interrupt"]))
    def arm_describe(self, kind: str) -> None:
        self.describe_arm = kind

    @rule()
    def arm_withdraw(self) -> None:
        self.withdraw_next = True

    @rule(kind=st.sampled_from(["error", "interrupt"]))
    def arm_enforce(self, kind: str) -> None:
        self.enforce_arm = kind

    @rule(kind=st.sampled_from(["error", "interrupt"]))
    def arm_leave(self, kind: str) -> None:
        self.leave_arm = kind

    @rule(explicit=st.booleans())
    def check(self, explicit: bool) -> None:
        now = self.clock()
        due = self.model.check(now)
        for key, _reason, _since in due:
            assert key not in self.model.gone or self.model.gone[key] or self.model.mode == "report"
        expected = due | self.carried
        before = len(self.delivered)
        withdrawn_before = len(self.withdrawn)
        self.checked_at = now
        try:
            got = self.wd.check(now) if explicit else self.wd.check()
        except Interrupt:
            # delivered up to the interruption; the rest comes with the next check
            assert self.wd._overdue(now) == []  # what was due was all taken
            self._withdrawn(withdrawn_before)
            self.carried = expected - set(self.withdrawn)
            new = self.delivered[before:]
            assert set(new) <= expected
            assert not set(new) & set(self.withdrawn)
            return
        assert self.wd._overdue(now) == []  # nothing overdue survives a check
        assert self.heard == self.model.leaves  # every leave notification, once
        self._withdrawn(withdrawn_before)
        returned = {(e.key, e.reason, e.entered_at) for e in got}
        assert len(returned) == len(got), f"an expiry returned twice: {got}"
        assert returned == expected - set(self.withdrawn)
        assert not set(self.delivered[before:]) & set(self.withdrawn)
        self.carried = set()
        self.returned.update((e.state_label, e.reason) for e in got)
        if self.wd.options.statistics:
            self._counted_once()
        if self.describing:  # describe ran once for every expiry, before every hook
            assert len(self.described) == len(self.delivered) + len(self.withdrawn)
            described = [key for key, attrs in self.attributes if "described" in attrs]
            undescribed = self.failed_describe - self.withdrawn_undescribed
            assert len(described) == len(self.attributes) - undescribed
        else:
            assert self.described == []
        for key, attrs in self.attributes:
            if "described" in attrs:
                assert attrs["described"] == key
                assert attrs["k"] in (key, -1)
            elif "k" in attrs:
                assert attrs["k"] == key  # annotated only

    def _counted_once(self) -> None:
        """The core's counts of expiries by state and reason are the expiries returned,
        in the watchdog's mode (nothing is carried over: every expiry counted was
        returned or withdrawn); the exporter adds them to its counters once."""
        stats = self.wd.statistics()
        counted = {"forced": Counter[tuple[str, str]](), "reported": Counter[tuple[str, str]]()}
        for label, st_ in stats.states.items():
            for kind in counted:
                for reason, n in getattr(st_, kind).items():
                    assert n > 0
                    counted[kind][label, reason] += n
        mine = "forced" if self.model.mode == "enforce" else "reported"
        other = "reported" if mine == "forced" else "forced"
        assert counted[mine] == self.returned
        assert not counted[other]
        self.exporter.export(stats)
        self.exporter.export(self.wd.statistics())  # again: nothing new, nothing added
        counter = self.forced_counter if mine == "forced" else self.reported_counter
        excess = counter.by_state_reason()
        excess.subtract(self.returned)
        exported_then_withdrawn = Counter(
            (self.withdrawn_state[w], w[1]) for w in self.withdrawn if w in self.carried_at_export
        )
        for key, n in excess.items():
            assert 0 <= n <= exported_then_withdrawn[key], (key, n)
        assert not (self.reported_counter if mine == "forced" else self.forced_counter).values

    @precondition(lambda self: self.wd.options.statistics)
    @rule()
    def export(self) -> None:
        """An export at any moment (also with expiries carried over) never adds more
        than the returned and carried expiries."""
        self.exporter.export(self.wd.statistics())
        self.carried_at_export |= self.carried
        total = sum(self.forced_counter.values.values()) + sum(
            self.reported_counter.values.values()
        )
        assert total <= self.returned.total() + len(self.carried_at_export)

    def _withdrawn(self, start: int) -> None:
        """The model learns the expiries the enforcement hook withdrew: concluded, not
        expired (remembered in the same place)."""
        for key, _reason, _since in self.withdrawn[start:]:
            assert self.model.mode == "enforce"
            if key in self.model.gone:
                self.model.gone[key] = False

    @precondition(lambda self: self.model.mode == "enforce")
    @rule(key=KEYS)
    def expired_flag(self, key: int) -> None:
        assert self.wd.expired(key) == (self.model.gone.get(key) is True)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def exactly_once(self) -> None:
        # each (key, reason, start) is a distinct state entry / window / life
        assert len(self.delivered) == len(set(self.delivered)), self.delivered

    @invariant()
    def agrees_with_model(self) -> None:
        model = self.model
        wd = self.wd
        assert len(wd) == len(model.live)
        for key in range(6):
            rec = model.live.get(key)
            assert (key in wd) == (rec is not None)
            assert wd.state_of(key) == (None if rec is None else rec["state"])
        snap = wd.snapshot()
        assert snap.tracked == len(model.live)
        assert {r.key: (r.state, r.entered_at) for r in snap.requests} == {
            k: (r["state"], r["entered"]) for k, r in model.live.items()
        }
        for label, summary in snap.states.items():
            assert summary.count == sum(1 for r in model.live.values() if r["state"] == label)
        assert snap.late_events == model.late
        assert snap.withdrawn == len(self.withdrawn)

    @invariant()
    def expired_flags(self) -> None:
        if self.model.mode == "enforce":  # (withdrawn expiries: concluded, not expired)
            for key in range(6):
                assert self.wd.expired(key) == (self.model.gone.get(key) is True), key

    @invariant()
    def memory_bounded(self) -> None:
        assert self.wd._remembered() <= self.memory

    @invariant()
    def fifos_in_time_order(self) -> None:
        assert self.wd._in_time_order()

    @invariant()
    def nothing_overdue_survives_a_check(self) -> None:
        # Every lag (LAGS) is shorter than every duration in SPEC, so nothing observed
        # since the latest check can be due at its time either.
        if self.checked_at is not None:
            assert self.wd._overdue(self.checked_at) == []

    @invariant()
    def leave_notifications_at_most_once(self) -> None:
        assert not self.heard - self.model.leaves, (self.heard, self.model.leaves)


WatchdogMachine.TestCase.settings = settings(
    max_examples=at_least(300),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestWatchdogStateful = WatchdogMachine.TestCase
