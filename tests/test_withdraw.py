"""An enforcement hook that returns ``stallguard.CONCLUDED`` withdraws its expiry: the
request had ended when its deadline fired (its owner concluded it meanwhile, a race the
watchdog cannot see), so nothing was failed and nobody must be told otherwise.

Random sequences (withdrawals mixed with failing and interrupting hooks, both modes):
tests/test_stateful.py.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest

import stallguard as sg
from stallguard.testing import FakeClock, record_expiries

SPEC = sg.Spec(name="kv", deadlines={"Waiting": 10}, terminal=["Done"])


pytestmark = pytest.mark.usefixtures("no_hooks")


def setup(on_expire: Any, **kwargs: Any) -> tuple[sg.Watchdog[str], FakeClock, list]:
    clock = FakeClock()
    wd: sg.Watchdog[str] = sg.Watchdog(SPEC, clock=clock, on_expire=on_expire, **kwargs)
    heard: list[str] = []
    wd.add_listener(on_expire=lambda e: heard.append(e.key))
    return wd, clock, heard


def concluded_for(*keys: str):
    """An enforcement hook that finds *keys* concluded (and fails the others)."""
    failed: list[str] = []

    def enforce(expiry: sg.Expiry[str]) -> Any:
        if expiry.key in keys:
            return sg.CONCLUDED
        failed.append(expiry.key)
        return None

    return enforce, failed


def test_a_withdrawn_expiry_reaches_nobody_and_is_not_counted():
    enforce, failed = concluded_for("a")
    wd, clock, heard = setup(enforce, statistics=True)
    wd.observe("a", "Waiting")
    wd.observe("b", "Waiting")
    clock.advance(10)
    with record_expiries() as recorded:  # an instrumentation hook
        got = wd.check()
    assert [e.key for e in got] == ["b"]
    assert failed == ["b"] and heard == ["b"]
    assert [e.key for e in recorded] == ["b"]
    assert not wd.expired("a") and wd.expired("b")
    snap = wd.snapshot()
    assert snap.expired == 1 and snap.tracked == 0 and snap.withdrawn == 1
    assert wd.statistics().states["Waiting"].fired == 1
    # remembered as concluded: a late event for it does not re-track it
    wd.observe("a", "Waiting")
    assert "a" not in wd and wd.snapshot().late_events == 1


def test_only_enforcement_hooks_withdraw():
    wd, clock, heard = setup(lambda e: None)
    wd.add_listener(on_expire=lambda e: sg.CONCLUDED)  # a listener's return is ignored
    wd.observe("a", "Waiting")
    clock.advance(10)
    assert [e.key for e in wd.check()] == ["a"] and wd.expired("a") and heard == ["a"]


def test_report_mode_has_no_enforcement_to_withdraw():
    wd, clock, heard = setup(lambda e: sg.CONCLUDED, mode="report")
    wd.observe("a", "Waiting")
    clock.advance(10)
    assert [e.key for e in wd.check()] == ["a"] and heard == ["a"]


def test_the_hooks_before_the_withdrawing_one_have_run():
    calls: list[str] = []
    wd, clock, heard = setup([lambda e: calls.append("first"), lambda e: sg.CONCLUDED])
    wd.observe("a", "Waiting")
    clock.advance(10)
    assert wd.check() == [] and calls == ["first"] and heard == []


class Stop(BaseException):
    pass


def test_an_interrupted_check_does_not_bring_a_withdrawn_expiry_back():
    enforce, failed = concluded_for("a")
    wd, clock, heard = setup(enforce)
    stops = ["c"]

    def interrupt(expiry: sg.Expiry[str]) -> None:
        if expiry.key in stops:
            stops.remove(expiry.key)
            raise Stop()

    wd.add_listener(on_expire=interrupt)
    for key in ("a", "b", "c", "d"):
        wd.observe(key, "Waiting")
    clock.advance(10)
    with pytest.raises(Stop):
        wd.check()
    got = wd.check()  # the interrupted check's expiries, but the withdrawn one
    assert [e.key for e in got] == ["b", "c", "d"]
    assert failed == ["b", "c", "d"] and heard == ["b", "c", "d"]
    assert wd.snapshot().expired == 3 and wd.snapshot().withdrawn == 1
    assert not wd.expired("a")


def test_the_sentinel():
    assert repr(sg.CONCLUDED) == "stallguard.CONCLUDED"
    assert pickle.loads(pickle.dumps(sg.CONCLUDED)) is sg.CONCLUDED
