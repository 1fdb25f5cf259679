"""``Watchdog(describe=...)``: span attributes computed only for the keys that expire.

The promises (random sequences in tests/test_stateful.py, which also arms ``describe`` to
raise): called once per expiry, before every hook, never for a key that does not expire;
annotated attributes win; a failing ``describe`` loses nothing.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

import stallguard as sg
from stallguard.testing import FakeClock

SPEC = sg.Spec(name="kv", deadlines={"Waiting": 10}, terminal=["Done"])


pytestmark = pytest.mark.usefixtures("no_hooks")


def watchdog(describe: Any, **kwargs: Any) -> tuple[sg.Watchdog[str], FakeClock, list]:
    clock = FakeClock()
    seen: list[sg.Expiry[str]] = []
    wd: sg.Watchdog[str] = sg.Watchdog(
        SPEC, clock=clock, on_expire=seen.append, describe=describe, **kwargs
    )
    return wd, clock, seen


def test_called_only_for_expiring_keys_and_merged_under_annotations():
    calls: list[str] = []

    def describe(key: str) -> dict[str, Any]:
        calls.append(key)
        return {"rid": key, "room": 7, "queue": "inflight"}

    wd, clock, seen = watchdog(describe)
    for key in ("a", "b", "c"):
        wd.observe(key, "Waiting")
    wd.annotate("a", attributes={"room": 99})  # annotated: wins over describe
    wd.observe("c", "Done")
    clock.advance(5)
    assert wd.check() == [] and calls == []  # nothing due: never called
    clock.advance(5)
    got = wd.check()
    assert sorted(calls) == ["a", "b"]  # c concluded: never described
    assert {e.key: dict(e.attributes) for e in got} == {
        "a": {"rid": "a", "room": 99, "queue": "inflight"},
        "b": {"rid": "b", "room": 7, "queue": "inflight"},
    }
    assert [e.attributes for e in seen] == [e.attributes for e in got]  # before the hook


def test_report_mode_describes_each_report():
    calls: list[str] = []
    wd, clock, _ = watchdog(lambda key: calls.append(key) or {"rid": key}, mode="report")
    wd.observe("a", "Waiting")
    clock.advance(10)
    [expiry] = wd.check()
    assert expiry.attributes == {"rid": "a"} and calls == ["a"]
    clock.advance(10)
    assert wd.check() == [] and calls == ["a"]  # reported once per deadline


def test_runs_outside_the_lock():
    wd: sg.Watchdog[str]

    def describe(key: str) -> dict[str, Any]:
        return {"tracked": len(wd), "requests": len(wd.snapshot().requests)}

    wd, clock, _ = watchdog(describe)
    wd.observe("a", "Waiting")
    wd.observe("b", "Waiting")
    clock.advance(10)
    assert [dict(e.attributes) for e in wd.check()] == [{"tracked": 0, "requests": 0}] * 2


@pytest.mark.parametrize(
    ("describe", "message"),
    [
        (lambda key: 1 / 0, "ZeroDivisionError"),
        (lambda key: ["rid", key], "must return a mapping"),
        (lambda key: {1: key}, "attribute names must be strings"),
    ],
)
def test_a_failing_describe_loses_nothing(describe, message, caplog):
    wd, clock, seen = watchdog(describe)
    wd.annotate("a", attributes={"x": 1})  # (untracked: dropped)
    wd.observe("a", "Waiting")
    wd.annotate("a", attributes={"kept": True})
    clock.advance(10)
    with caplog.at_level(logging.ERROR, logger="stallguard"):
        [expiry] = wd.check()
    assert seen == [expiry] and expiry.attributes == {"kept": True}
    assert wd.snapshot().hook_errors == 1
    assert message in caplog.text and "describe" in caplog.text


class Stop(BaseException):
    pass


def test_an_interrupting_describe_is_carried_like_a_hook():
    calls: list[str] = []

    def describe(key: str) -> dict[str, Any]:
        calls.append(key)
        if len(calls) == 1:
            raise Stop()
        return {"rid": key}

    wd, clock, seen = watchdog(describe)
    wd.observe("a", "Waiting")
    wd.observe("b", "Waiting")
    clock.advance(10)
    with pytest.raises(Stop):
        wd.check()
    got = wd.check()  # delivers both: a without its description, b with it
    assert sorted(e.key for e in got) == ["a", "b"]
    assert sorted(e.key for e in seen) == ["a", "b"]  # each enforced once
    assert {e.key: dict(e.attributes) for e in got} == {"a": {}, "b": {"rid": "b"}}
    assert calls == ["a", "b"]


def test_not_callable_is_a_config_error():
    with pytest.raises(sg.ConfigError, match="describe must be a callable, got 'rid'"):
        sg.Watchdog(SPEC, describe="rid")  # type: ignore[arg-type]
