"""stallguard.Quarantine: a failed request's memory is released only with a proof, never
by a deadline; an overdue hold is escalated exactly once and stays held.

The promises (docs/quarantine.md), each tried against random sequences (hypothesis,
stateful, a FakeClock) and against threads racing holds, releases and checks:

* a held key leaves the quarantine only through ``release(key, proof=...)``;
* every hold past the deadline is returned by exactly one ``check()`` (and handed to
  ``on_overdue`` once), and it stays held;
* ``snapshot()`` adds up what is held, per peer, exactly;
* a key held again after its release is a new stay, with its own deadline.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import stallguard
from stallguard import PROOFS, ConfigError, Quarantine
from stallguard.testing import FakeClock, record_expiries

KEYS = st.sampled_from(["a", "b", "c", "d"])
PEERS = st.sampled_from(["P0", "P1"])
DEADLINE = 5.0


def test_exported() -> None:
    for name in ("Quarantine", "QuarantineSnapshot", "Hold", "PeerHolds", "PROOFS"):
        assert name in stallguard.__all__


def test_hold_is_never_freed_by_its_deadline() -> None:
    clock = FakeClock()
    seen: list[Any] = []
    q: Quarantine[str] = Quarantine("q", deadline=DEADLINE, clock=clock, on_overdue=seen.append)
    q.hold("r", peer="P", units=4, nbytes=32768)
    clock.advance(DEADLINE - 0.001)
    assert q.check() == []
    clock.advance(0.001)
    [overdue] = q.check()
    assert overdue.key == "r" and overdue.overdue and overdue.units == 4
    assert [h.key for h in seen] == ["r"]
    clock.advance(1000)
    assert q.check() == []  # once
    assert "r" in q and q.get("r") is not None and q.get("r").overdue  # type: ignore[union-attr]
    snap = q.snapshot()
    assert (snap.holds, snap.units, snap.nbytes, snap.overdue, snap.escalated) == (
        1,
        4,
        32768,
        1,
        1,
    )
    released = q.release("r", proof="transfer_done")
    assert released is not None and released.key == "r"
    assert "r" not in q and q.release("r", proof="transfer_done") is None
    assert q.snapshot().released == {"transfer_done": 1}


def test_overdue_hold_is_reported_never_enforced() -> None:
    clock = FakeClock()
    q: Quarantine[str] = Quarantine("vllm_kv_quarantine", deadline=1.0, clock=clock)
    with record_expiries() as seen:
        q.hold("r", peer="P", units=2, nbytes=10, attributes={"vllm.request_id": "r"})
        clock.advance(1.0)
        q.check()
    [e] = seen
    assert e.mode == "report" and e.state == "Quarantined" and e.spec == "vllm_kv_quarantine"
    assert e.attributes["stallguard.quarantine.peer"] == "P"
    assert e.attributes["stallguard.quarantine.units"] == 2
    assert e.attributes["stallguard.quarantine.bytes"] == 10
    assert e.attributes["stallguard.quarantine.action"] == "holding"
    assert e.attributes["vllm.request_id"] == "r"


def test_overdue_is_logged_at_error(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    q: Quarantine[str] = Quarantine("q", deadline=1.0, clock=clock, unit="pages")
    q.hold("r", peer="P", units=3, nbytes=99)
    clock.advance(2.0)
    with caplog.at_level("ERROR", logger="stallguard.quarantine"):
        q.check()
    [rec] = [r for r in caplog.records if r.name == "stallguard.quarantine"]
    assert rec.levelname == "ERROR"
    assert "3 pages (99 bytes)" in rec.getMessage() and "peer P" in rec.getMessage()


def test_on_overdue_error_is_counted_and_the_hold_stays() -> None:
    clock = FakeClock()

    def boom(_hold: Any) -> None:
        raise RuntimeError("teardown failed")

    q: Quarantine[str] = Quarantine("q", deadline=1.0, clock=clock, on_overdue=boom)
    q.hold("r", peer="P")
    clock.advance(1.0)
    assert [h.key for h in q.check()] == ["r"]
    assert q.callback_errors == 1 and "r" in q


def test_hold_twice_keeps_the_first() -> None:
    clock = FakeClock()
    q: Quarantine[str] = Quarantine("q", deadline=DEADLINE, clock=clock)
    first = q.hold("r", peer="P", units=1)
    clock.advance(1)
    assert q.hold("r", peer="Q", units=9) is first
    clock.advance(DEADLINE - 1)
    assert [h.key for h in q.check()] == ["r"]  # from the first hold


def test_no_deadline_never_escalates() -> None:
    clock = FakeClock()
    q: Quarantine[str] = Quarantine("q", deadline=None, clock=clock)
    q.hold("r", peer="P")
    clock.advance(1e9)
    assert q.check() == [] and "r" in q and q.deadline is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "", "deadline": 1}, "name must be a non-empty str"),
        ({"name": "q", "deadline": -1}, "Quarantine deadline"),
        ({"name": "q", "deadline": float("nan")}, "Quarantine deadline"),
        ({"name": "q", "deadline": "5"}, "Quarantine deadline"),
        ({"name": "q", "deadline": 1, "on_overdue": 3}, "on_overdue must be a callable"),
        ({"name": "q", "deadline": 1, "unit": ""}, "unit must be a non-empty str"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Quarantine(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"peer": 1}, "peer must be a str"),
        ({"peer": "P", "units": -1}, "units must be a non-negative int"),
        ({"peer": "P", "units": True}, "units must be a non-negative int"),
        ({"peer": "P", "nbytes": 1.5}, "nbytes must be a non-negative int"),
    ],
)
def test_bad_holds_are_named(kwargs: dict[str, Any], match: str) -> None:
    q: Quarantine[str] = Quarantine("q", deadline=1.0, clock=FakeClock())
    with pytest.raises(ConfigError, match=match):
        q.hold("r", **kwargs)
    assert "r" not in q


def test_release_needs_a_known_proof() -> None:
    q: Quarantine[str] = Quarantine("q", deadline=1.0, clock=FakeClock())
    q.hold("r", peer="P")
    with pytest.raises(ConfigError, match="proof must be one of"):
        q.release("r", proof="timeout")
    assert "r" in q
    for proof in PROOFS:
        q.hold("r", peer="P")
        assert q.release("r", proof=proof) is not None


class QuarantineMachine(RuleBasedStateMachine):
    """Random holds, releases, clock moves and checks against a model."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(10.0)
        self.escalated: list[str] = []
        self.q: Quarantine[str] = Quarantine(
            "q",
            deadline=DEADLINE,
            clock=self.clock,
            on_overdue=lambda h: self.escalated.append(h.key),
        )
        # key -> (peer, units, nbytes, since, overdue)
        self.model: dict[str, list[Any]] = {}
        self.released: dict[str, int] = {}
        self.returned: list[tuple[str, float]] = []  # (key, since) returned by check

    @rule(key=KEYS, peer=PEERS, units=st.integers(0, 8), nbytes=st.integers(0, 1 << 20))
    def hold(self, key: str, peer: str, units: int, nbytes: int) -> None:
        self.q.hold(key, peer=peer, units=units, nbytes=nbytes)
        if key not in self.model:
            self.model[key] = [peer, units, nbytes, self.clock(), False]

    @rule(key=KEYS, proof=st.sampled_from(sorted(PROOFS)))
    def release(self, key: str, proof: str) -> None:
        got = self.q.release(key, proof=proof)
        assert (got is not None) == (key in self.model)
        if key in self.model:
            del self.model[key]
            self.released[proof] = self.released.get(proof, 0) + 1

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.5, 5.0, 7.0]))
    def advance(self, dt: float) -> None:
        self.clock.advance(dt)

    @rule()
    def check(self) -> None:
        now = self.clock()
        expect = {k for k, v in self.model.items() if not v[4] and v[3] + DEADLINE <= now}
        got = self.q.check()
        assert {h.key for h in got} == expect
        for h in got:
            assert h.overdue
            self.model[h.key][4] = True
            self.returned.append((h.key, float(self.model[h.key][3])))

    @precondition(lambda self: bool(self.model))
    @invariant()
    def snapshot_adds_up(self) -> None:
        snap = self.q.snapshot()
        assert snap.holds == len(self.model)
        assert snap.units == sum(v[1] for v in self.model.values())
        assert snap.nbytes == sum(v[2] for v in self.model.values())
        assert snap.overdue == sum(bool(v[4]) for v in self.model.values())
        for peer, per in snap.by_peer.items():
            mine = [v for v in self.model.values() if v[0] == peer]
            assert per.holds == len(mine) and per.units == sum(v[1] for v in mine)

    @invariant()
    def held_exactly_the_model(self) -> None:
        assert {h.key for h in self.q.holds()} == set(self.model)
        assert self.q.snapshot().released == self.released

    @invariant()
    def each_stay_escalated_at_most_once(self) -> None:
        assert len(self.returned) == len(set(self.returned))
        assert [k for k, _ in self.returned] == self.escalated


TestQuarantineMachine = QuarantineMachine.TestCase
TestQuarantineMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


def test_threads_racing_holds_releases_and_checks() -> None:
    """Holders, releasers and a checker on four threads: every key held is released
    exactly once by a proof, each stay escalated at most once, nothing left."""
    clock = FakeClock()
    escalated: list[str] = []
    lock = threading.Lock()

    def on_overdue(h: Any) -> None:
        with lock:
            escalated.append(h.key)

    q: Quarantine[int] = Quarantine("q", deadline=1.0, clock=clock, on_overdue=on_overdue)
    n = 3000
    held = threading.Event()
    released: list[int] = []

    def holder() -> None:
        for k in range(n):
            q.hold(k, peer=f"P{k % 3}", units=1, nbytes=8)
        held.set()

    def releaser() -> None:
        k = 0
        while k < n:
            if q.release(k, proof="transfer_done") is not None:
                released.append(k)
                k += 1
            elif held.is_set() and k not in q:
                raise AssertionError(f"{k} neither held nor released")

    def checker() -> None:
        while not (held.is_set() and len(q) == 0):
            clock.advance(0.5)
            q.check()

    threads = [threading.Thread(target=f) for f in (holder, releaser, checker)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert released == list(range(n))
    assert len(escalated) == len(set(escalated))
    snap = q.snapshot()
    assert snap.holds == 0 and snap.released == {"transfer_done": n}
    assert snap.escalated == len(escalated)
