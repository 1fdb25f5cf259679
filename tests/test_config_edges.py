"""Config entry points at the edges (issue 10, points 6 and 7 and the general rule): numbers
beyond a float, files that are not UTF-8, environment names that two states or two specs
could both claim, and bad arguments. Each must be a ConfigError naming where and what."""

from __future__ import annotations

import enum
from pathlib import Path

import pytest

import stallguard as sg

HUGE = "9" * 400  # an integer TOML and int() accept, float() does not


def write(tmp_path: Path, text: str | bytes, name: str = "config.toml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


# --------------------------------------------------------------------------- point 6


@pytest.mark.parametrize(
    ("body", "where"),
    [
        (f"[spec.s.deadlines]\nA = {HUGE}\n", "[spec.s.deadlines] A = 999"),
        (f"[spec.s.deadlines]\nA = {{ seconds = 1, stall = {HUGE} }}\n", "A.stall = 999"),
        (f"[spec.s]\nlifetime = {HUGE}\n[spec.s.deadlines]\nA = 1\n", "[spec.s] lifetime = 999"),
    ],
)
def test_a_toml_integer_beyond_a_float_names_file_key_and_value(
    tmp_path: Path, body: str, where: str
) -> None:
    path = write(tmp_path, body)
    with pytest.raises(sg.ConfigError) as caught:
        sg.load_config(path, env={})
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and where in message
    assert "too large" in message


@pytest.mark.parametrize("setting", ["DEADLINE_A", "STALL_A", "LIFETIME"])
def test_an_environment_number_beyond_a_float_names_variable_and_value(setting: str) -> None:
    doc = {"spec": {"s": {"deadlines": {"A": 10}}}}
    var = f"STALLGUARD_S_{setting}"
    with pytest.raises(sg.ConfigError) as caught:
        sg.load_config(doc, env={var: HUGE})
    message = str(caught.value)
    # the value is shown as written, shortened (never all its digits)
    shown = f'"{HUGE[:60]}..." (400 characters)'
    assert message.startswith(f"environment: {var} = {shown}: must be a positive"), message
    assert "too large" in message


def test_a_file_that_is_not_utf8_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, b"[spec.s.deadlines]\nA = 1 # caf\xe9\n")  # Latin-1
    with pytest.raises(sg.ConfigError) as caught:
        sg.load_config(path, env={})
    assert str(caught.value) == (
        f"{path}: not UTF-8 text (TOML files must be UTF-8): byte 0xe9 at offset 30 "
        "cannot be decoded; save it as UTF-8"
    )


def test_values_nested_too_deeply_and_unusable_paths(tmp_path: Path) -> None:
    path = write(tmp_path, "x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(sg.ConfigError, match="not valid TOML"):
        sg.load_config(path, env={})
    with pytest.raises(sg.ConfigError, match="not a usable file path"):
        sg.load_config("conf\0ig.toml", env={})
    with pytest.raises(sg.ConfigError, match="cannot read the config file"):
        sg.load_config(tmp_path, env={})  # a directory


# --------------------------------------------------------------------------- point 7


def test_two_states_one_environment_name_is_refused_naming_both() -> None:
    doc = {"spec": {"s": {"deadlines": {"Wait-Input": 10, "Wait_Input": 20}}}}
    assert sg.load_spec(doc, env={}).deadlines["Wait_Input"] == sg.Deadline(20)  # fine alone
    for setting in ("DEADLINE", "STALL"):
        var = f"STALLGUARD_S_{setting}_WAIT_INPUT"
        with pytest.raises(sg.ConfigError) as caught:
            sg.load_spec(doc, env={var: "5"})
        message = str(caught.value)
        assert message.startswith(f'environment: {var} = "5": ambiguous')
        assert "'Wait-Input' and 'Wait_Input'" in message


def test_a_terminal_and_a_live_state_sharing_a_name_are_refused_too() -> None:
    doc = {"spec": {"s": {"deadlines": {"Wait-Input": 10}, "terminal": ["Wait_Input"]}}}
    with pytest.raises(sg.ConfigError, match="ambiguous: states 'Wait-Input' and 'Wait_Input'"):
        sg.load_spec(doc, env={"STALLGUARD_S_DEADLINE_WAIT_INPUT": "5"})


@pytest.mark.parametrize(
    "var", ["STALLGUARD_KV_SENDER_DEADLINE_A", "STALLGUARD_KV_SENDER_DEADLNE_A"]
)
@pytest.mark.parametrize("name", ["kv-sender", "kv_sender"])
def test_two_specs_one_environment_prefix_is_refused_naming_both(name: str, var: str) -> None:
    doc = {
        "spec": {
            "kv-sender": {"deadlines": {"A": 1}},
            "kv_sender": {"deadlines": {"A": 2}},
        }
    }
    assert sg.load_spec(doc, name=name, env={}).name == name  # fine without overrides
    with pytest.raises(sg.ConfigError) as caught:
        sg.load_spec(doc, name=name, env={var: "9"})  # an override, or a typo
    message = str(caught.value)
    assert message.startswith(f"environment: {var}: ambiguous: specs ")
    assert "'kv-sender'" in message and "'kv_sender'" in message


def test_a_variable_two_specs_could_read_is_refused() -> None:
    # spec "kv" with a state "X" reads ..._KV_DEADLINE_X; so would spec "kv_deadline" (as
    # its setting "X"): the old code silently gave it to kv_deadline and ignored it for kv.
    doc = {"spec": {"kv": {"deadlines": {"X": 1}}, "kv_deadline": {"deadlines": {"Y": 1}}}}
    with pytest.raises(sg.ConfigError) as caught:
        sg.load_spec(doc, name="kv", env={"STALLGUARD_KV_DEADLINE_X": "5"})
    assert str(caught.value) == (
        "environment: STALLGUARD_KV_DEADLINE_X: ambiguous: it is setting DEADLINE_X of spec "
        "'kv' and setting X of spec 'kv_deadline'; rename one of the specs"
    )
    # not ambiguous: a variable only the longer spec can mean is left to it
    env = {"STALLGUARD_KV_DEADLINE_MODE": "report"}
    assert sg.load_config(doc, name="kv", env=env).mode == "enforce"
    assert sg.load_config(doc, name="kv_deadline", env=env).mode == "report"


# --------------------------------------------------------------------------- arguments


class States(enum.Enum):
    A = 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": 5}, "name must be a non-empty string, got 5"),
        ({"name": ["s"]}, "name must be a non-empty string, got ['s']"),
        ({"env": 5}, "env must be a mapping of variable names to values or None, got 5"),
        ({"env_prefix": ""}, "env_prefix must be a non-empty string, got ''"),
        ({"env_prefix": None}, "env_prefix must be a non-empty string, got None"),
        ({"states": int}, "states must be an enum.Enum subclass or None, got <class 'int'>"),
        ({"states": States.A}, "states must be an enum.Enum subclass or None, got <States.A: 1>"),
    ],
)
def test_load_config_refuses_bad_arguments_by_name(kwargs: dict, message: str) -> None:
    with pytest.raises(sg.ConfigError) as caught:
        sg.load_config({"spec": {"s": {"deadlines": {"A": 1}}}}, **kwargs)
    assert str(caught.value) == message


def test_parsers_refuse_bad_arguments_by_name() -> None:
    with pytest.raises(sg.ConfigError, match="name must be a non-empty string, got 3"):
        sg.parse_config_table({"deadlines": {"A": 1}}, name=3)  # type: ignore[arg-type]
    with pytest.raises(sg.ConfigError, match="source must be a non-empty string, got None"):
        sg.parse_deadlines({"A": 1}, source=None)  # type: ignore[arg-type]
    with pytest.raises(sg.ConfigError, match="prefix must be a non-empty string, got 7"):
        sg.parse_deadlines({"A": 1}, prefix=7)  # type: ignore[arg-type]
    with pytest.raises(sg.ConfigError, match="states must be an enum.Enum subclass"):
        sg.parse_deadlines({"A": 1}, states="A")  # type: ignore[arg-type]


def test_a_spec_name_that_is_not_a_string_names_the_source() -> None:
    with pytest.raises(sg.ConfigError) as caught:
        sg.load_config({"spec": {5: {"deadlines": {"A": 1}}}}, env={})
    assert str(caught.value).startswith("<dict>: [spec] 5 = {deadlines = {A = 1}}: a spec name")


def test_an_environment_value_that_is_not_a_string() -> None:
    doc = {"spec": {"s": {"deadlines": {"A": 1}}}}
    with pytest.raises(sg.ConfigError) as caught:
        sg.load_config(doc, env={"STALLGUARD_S_MODE": 1, 3: "x"})  # type: ignore[dict-item]
    assert str(caught.value) == (
        "environment: STALLGUARD_S_MODE = 1: an environment value must be a string"
    )


# --------------------------------------------------------------------------- issue 20

DIGITS_5000 = "9" * 5000  # more digits than int() reads (sys.get_int_max_str_digits())


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def test_a_toml_integer_of_5000_digits_names_the_file(tmp_path: Path) -> None:
    # was: a raw ValueError from int(), without the path
    path = write(tmp_path, f"[spec.s.deadlines]\nA = {DIGITS_5000}\n")
    with pytest.raises(sg.ConfigError) as caught:
        sg.load_config(path, env={})
    message = str(caught.value)
    assert message.startswith(f"{path}: not valid TOML: an integer of more than ")
    assert "999999" not in message and len(message) < 300


@pytest.mark.parametrize("key", ["deadlines", "terminal", "mode", "lifetime"])
def test_a_dict_value_nested_5000_deep_is_a_config_error(key: str) -> None:
    # was: RecursionError while formatting the message
    table: dict = {"deadlines": {"A": 1}}
    if key == "deadlines":
        table["deadlines"] = {"A": nested(5000)}
    else:
        table[key] = nested(5000)
    with pytest.raises(sg.ConfigError) as caught:
        sg.load_config({"spec": {"s": table}}, env={})
    message = str(caught.value)
    assert message.startswith("<dict>: [spec.s") and "[[[[...]]]]" in message
    assert len(message) < 300


@pytest.mark.parametrize("value", [10**5000, -(10**5000), 10**400], ids=["5001", "-5001", "401"])
def test_a_dict_integer_beyond_int_to_text_is_shown_by_its_size(value: int) -> None:
    # was: ValueError from repr() of an int of more than 4,300 digits
    with pytest.raises(sg.ConfigError) as caught:
        sg.load_config({"spec": {"s": {"deadlines": {"A": value}}}}, env={})
    message = str(caught.value)
    digits = 5001 if abs(value) > 10**4000 else 401
    assert message.startswith("<dict>: [spec.s.deadlines] A = ")
    assert f"... ({digits} digits): must be a positive, finite number" in message
    assert message.endswith("(too large)") and len(message) < 200


def test_a_deadline_beyond_int_to_text_is_a_config_error() -> None:
    with pytest.raises(sg.ConfigError, match="an integer of 5001 digits, which is too large"):
        sg.Deadline(10**5000)


@pytest.mark.parametrize("setting", ["DEADLINE_A", "MEMORY", "MODE", "LIFETIME"])
def test_an_environment_value_of_5000_characters_is_shortened(setting: str) -> None:
    doc = {"spec": {"s": {"deadlines": {"A": 10}}}}
    var = f"STALLGUARD_S_{setting}"
    with pytest.raises(sg.ConfigError) as caught:
        sg.load_config(doc, env={var: DIGITS_5000})
    message = str(caught.value)
    assert message.startswith(f'environment: {var} = "999'), message
    assert "(5000 characters)" in message and len(message) < 400


def test_huge_and_deep_values_in_messages_stay_short() -> None:
    table = {"deadlines": {"A": 1}, "mode": {"k" * 5000: list(range(10**4))}}
    with pytest.raises(sg.ConfigError) as caught:
        sg.load_config({"spec": {"s": table}}, env={})
    assert len(str(caught.value)) < 300
    many = {f"x{i}": 1 for i in range(10**4)}
    with pytest.raises(sg.ConfigError) as caught:
        sg.load_config(many, env={})
    assert "(10000 keys)" in str(caught.value) and len(str(caught.value)) < 300
