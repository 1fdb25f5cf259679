"""Spec and Deadline validation: invalid specs cannot be built, and the error says why."""

from __future__ import annotations

import enum
import math

import pytest

import stallguard as sg


class Phase(enum.Enum):
    BOOT = 1
    WAIT = 2
    DONE = 3


def test_numbers_none_and_deadline_objects_normalise_to_deadline():
    spec = sg.Spec(
        "kv",
        {"a": 3, "b": 1.5, "c": None, "d": sg.Deadline(5, stall=2), "e": {"stall": 4}},
        terminal=["ok"],
    )
    assert spec.deadlines["a"] == sg.Deadline(seconds=3.0)
    assert spec.deadlines["b"].seconds == 1.5
    assert spec.deadlines["c"] == sg.Deadline() and not spec.deadlines["c"].bounded
    assert spec.deadlines["d"] == sg.Deadline(seconds=5.0, stall=2.0)
    assert spec.deadlines["e"] == sg.Deadline(stall=4.0)
    assert spec.states == ("a", "b", "c", "d", "e", "ok")


def test_enum_states_and_labels():
    spec = sg.Spec("e", {Phase.BOOT: 1, Phase.WAIT: None}, terminal=[Phase.DONE])
    assert spec.states == (Phase.BOOT, Phase.WAIT, Phase.DONE)
    assert [sg.state_label(s) for s in spec.states] == ["BOOT", "WAIT", "DONE"]
    assert spec.state("WAIT") is Phase.WAIT


def test_single_terminal_string_is_one_state():
    assert sg.Spec("s", {"a": 1}, terminal="done").terminal == ("done",)


def test_spec_is_frozen_and_deadlines_read_only():
    spec = sg.Spec("s", {"a": 1})
    with pytest.raises(AttributeError):
        spec.name = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.deadlines["a"] = 2  # type: ignore[index]


def test_evolve_revalidates():
    spec = sg.Spec("s", {"a": 1})
    assert spec.evolve(lifetime=10).lifetime == 10.0
    with pytest.raises(sg.ConfigError, match="lifetime"):
        spec.evolve(lifetime=-1)


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (-1, "-1"),
        (0, "0"),
        (math.nan, "nan"),
        (math.inf, "inf"),
        (-math.inf, "inf"),
        (True, "True"),
        ("10", "'10'"),
    ],
)
def test_bad_seconds_name_field_and_value(value, needle):
    with pytest.raises(sg.ConfigError) as info:
        sg.Spec("s", {"Transferring": value})
    message = str(info.value)
    assert "deadlines['Transferring']" in message
    assert needle in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("field", ["seconds", "stall"])
def test_bad_deadline_object_fields(field):
    with pytest.raises(sg.ConfigError, match=f"Deadline.{field}.*-3"):
        sg.Deadline(**{field: -3})


def test_bad_lifetime():
    with pytest.raises(sg.ConfigError, match="lifetime.*0"):
        sg.Spec("s", {"a": 1}, lifetime=0)


def test_empty_spec():
    with pytest.raises(sg.ConfigError, match="no non-terminal state"):
        sg.Spec("s", {}, terminal=["done"])


def test_terminal_and_deadlined():
    with pytest.raises(sg.ConfigError, match="'Success' is both terminal and in deadlines"):
        sg.Spec("s", {"Success": 3}, terminal=["Success"])


def test_terminal_and_deadlined_via_enum_and_label():
    with pytest.raises(sg.ConfigError, match="'BOOT' is both terminal"):
        sg.Spec("s", {Phase.BOOT: 3}, terminal=["BOOT"])


def test_duplicate_terminal():
    with pytest.raises(sg.ConfigError, match="terminal lists state 'done' twice"):
        sg.Spec("s", {"a": 1}, terminal=["done", "done"])


def test_duplicate_state_in_pairs_and_enum_name_collision():
    with pytest.raises(sg.ConfigError, match="declares state 'a' twice"):
        sg.Spec("s", [("a", 1), ("a", 2)])
    with pytest.raises(sg.ConfigError, match="declares state 'BOOT' twice"):
        sg.Spec("s", {Phase.BOOT: 1, "BOOT": 2})


def test_unhashable_state():
    with pytest.raises(sg.ConfigError, match=r"unhashable state \['x'\]"):
        sg.Spec("s", {"a": 1}, terminal=[["x"]])


def test_int_state_points_at_guard_mapping():
    with pytest.raises(sg.ConfigError, match="guard\\(state=...\\)"):
        sg.Spec("s", {3: 1})


@pytest.mark.parametrize("name", ["", "  ", None, 3])
def test_bad_name(name):
    with pytest.raises(sg.ConfigError, match="name must be a non-empty string"):
        sg.Spec(name, {"a": 1})


def test_deadlines_not_a_mapping():
    with pytest.raises(sg.ConfigError, match="deadlines must be a mapping"):
        sg.Spec("s", "a")


def test_unknown_deadline_field():
    with pytest.raises(sg.ConfigError, match="unknown fields \\['sconds'\\]"):
        sg.Spec("s", {"a": {"sconds": 1}})


def test_state_lookup_unknown_label():
    with pytest.raises(sg.ConfigError, match="no state 'nope'"):
        sg.Spec("s", {"a": 1}).state("nope")
