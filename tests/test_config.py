"""Config loading: TOML files, dicts, environment overrides, and the error messages."""

from __future__ import annotations

import enum
from pathlib import Path

import pytest

import stallguard as sg
from stallguard.testing import FakeClock

KV_SENDER = """
[spec.kv_sender]
terminal = ["Success", "Failed"]
lifetime = 900
mode = "report"

[spec.kv_sender.deadlines]
Bootstrapping = 300
WaitingForInput = 120.5
Transferring = { seconds = 120, stall = 30 }
Queued = "none"
"""


def write(tmp_path: Path, text: str, name: str = "config.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_load_config_from_toml(tmp_path: Path) -> None:
    config = sg.load_config(write(tmp_path, KV_SENDER), env={})
    spec = config.spec
    assert spec.name == "kv_sender"
    assert dict(spec.deadlines) == {
        "Bootstrapping": sg.Deadline(300),
        "WaitingForInput": sg.Deadline(120.5),
        "Transferring": sg.Deadline(120, stall=30),
        "Queued": sg.Deadline(),
    }
    assert list(spec.deadlines) == ["Bootstrapping", "WaitingForInput", "Transferring", "Queued"]
    assert spec.terminal == ("Success", "Failed")
    assert spec.lifetime == 900
    assert config.mode == "report"
    assert config.unknown_state == "raise" and config.memory == 65_536
    assert config.source == str(tmp_path / "config.toml")
    assert sg.load_spec(tmp_path / "config.toml", env={}) == spec


def test_config_builds_a_working_watchdog(tmp_path: Path) -> None:
    clock = FakeClock()
    wd = sg.load_config(write(tmp_path, KV_SENDER), env={}).watchdog(clock=clock)
    assert wd.mode == "report" and wd.spec.name == "kv_sender"
    wd.observe("r1", "Transferring")
    clock.advance(30)  # the stall window from the file
    [expiry] = wd.check()
    assert (expiry.reason, expiry.deadline, expiry.mode) == ("stall", 30.0, "report")


def test_load_config_from_a_dict_with_python_values() -> None:
    config = sg.load_config(
        {
            "spec": {
                "rx": {
                    "deadlines": {"Waiting": None, "Receiving": sg.Deadline(5, stall=1)},
                    "terminal": ["Done"],
                    "memory": 10,
                    "unknown_state": "ignore",
                }
            }
        },
        env=None,
    )
    assert dict(config.spec.deadlines) == {
        "Waiting": sg.Deadline(),
        "Receiving": sg.Deadline(5, stall=1),
    }
    assert (config.memory, config.unknown_state, config.mode) == (10, "ignore", "enforce")
    assert config.source == "<dict>"


def test_several_specs_need_a_name(tmp_path: Path) -> None:
    text = KV_SENDER + "\n[spec.kv_receiver.deadlines]\nWaiting = 10\n"
    path = write(tmp_path, text)
    with pytest.raises(sg.ConfigError, match=r"several specs \(kv_sender, kv_receiver\)"):
        sg.load_config(path, env={})
    assert sg.load_spec(path, name="kv_receiver", env={}).deadlines == {"Waiting": sg.Deadline(10)}
    with pytest.raises(sg.ConfigError, match=r"has no \[spec.nope\] table; its specs: kv_sender"):
        sg.load_config(path, name="nope", env={})


def test_enum_states() -> None:
    class KV(enum.Enum):
        Failed = 0
        Bootstrapping = 1
        Success = 4

    doc = {"spec": {"kv": {"deadlines": {"Bootstrapping": 3}, "terminal": ["Success", "Failed"]}}}
    spec = sg.load_spec(doc, env={}, states=KV)
    assert list(spec.deadlines) == [KV.Bootstrapping]
    assert spec.terminal == (KV.Success, KV.Failed)
    doc["spec"]["kv"]["terminal"] = ["Succes"]
    with pytest.raises(sg.ConfigError) as caught:
        sg.load_spec(doc, env={}, states=KV)
    assert str(caught.value) == (
        '<dict>: [spec.kv] terminal = "Succes": not a member of KV '
        "(members: Failed, Bootstrapping, Success)"
    )


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            "Transferring = -1",
            "config.toml: [spec.kv.deadlines] Transferring = -1: must be a positive, finite "
            'number of seconds, or "none" for no deadline',
        ),
        ("Transferring = 0", "[spec.kv.deadlines] Transferring = 0: must be a positive"),
        ("Transferring = inf", "[spec.kv.deadlines] Transferring = inf: must be a positive"),
        ("Transferring = nan", "[spec.kv.deadlines] Transferring = nan: must be a positive"),
        ("Transferring = true", "[spec.kv.deadlines] Transferring = true: must be a positive"),
        (
            'Transferring = "2m"',
            '[spec.kv.deadlines] Transferring = "2m": must be a positive',
        ),
        (
            "Transferring = { seconds = 1, stall = -2 }",
            "[spec.kv.deadlines] Transferring.stall = -2: must be a positive",
        ),
        (
            "Transferring = { seconds = 1, stal = 2 }",
            "[spec.kv.deadlines] Transferring.stal = 2: unknown key (did you mean 'stall'?); "
            "allowed keys: seconds, stall",
        ),
    ],
)
def test_bad_deadlines_name_file_key_and_value(tmp_path: Path, line: str, message: str) -> None:
    path = write(tmp_path, f"[spec.kv]\n[spec.kv.deadlines]\n{line}\n")
    with pytest.raises(sg.ConfigError) as caught:
        sg.load_config(path, env={})
    assert message in str(caught.value)
    assert str(caught.value).startswith(f"{path}: ")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            'mode = "enforced"\n',
            '[spec.kv] mode = "enforced": must be one of "enforce", "report"',
        ),
        ('unknown_state = "drop"\n', '[spec.kv] unknown_state = "drop": must be one of'),
        ("memory = 0\n", "[spec.kv] memory = 0: must be a positive integer"),
        ("memory = 1.5\n", "[spec.kv] memory = 1.5: must be a positive integer"),
        ("lifetime = -5\n", "[spec.kv] lifetime = -5: must be a positive, finite number"),
        ('terminal = "Done"\n', '[spec.kv] terminal = "Done": must be an array of state names'),
        ('terminal = [""]\n', '[spec.kv] terminal = "": a state must be a non-empty string'),
        (
            "deadline = 3\n",
            "[spec.kv] deadline = 3: unknown key (did you mean 'deadlines'?); allowed keys: "
            "deadlines, lifetime, memory, mode, terminal, unknown_state",
        ),
        (
            'terminal = ["Transferring"]\n',
            "[spec.kv]: spec 'kv': state 'Transferring' is both terminal and in deadlines",
        ),
    ],
)
def test_bad_spec_keys_name_file_key_and_value(tmp_path: Path, body: str, message: str) -> None:
    path = write(tmp_path, f"[spec.kv]\n{body}[spec.kv.deadlines]\nTransferring = 5\n")
    with pytest.raises(sg.ConfigError) as caught:
        sg.load_config(path, env={})
    assert str(caught.value).startswith(f"{path}: ")
    assert message in str(caught.value)


def test_structural_errors(tmp_path: Path) -> None:
    with pytest.raises(sg.ConfigError, match=r"no deadlines table; add \[spec.kv.deadlines\]"):
        sg.load_config(write(tmp_path, '[spec.kv]\nterminal = ["Done"]\n'), env={})
    with pytest.raises(sg.ConfigError, match=r"no \[spec.<name>\] table \(found: specs\)"):
        sg.load_config(write(tmp_path, "[specs.kv.deadlines]\nA = 1\n"), env={})
    with pytest.raises(sg.ConfigError, match=r"declares no non-terminal state"):
        sg.load_config(write(tmp_path, "[spec.kv.deadlines]\n"), env={})
    with pytest.raises(sg.ConfigError, match=r"\[spec\] kv = 3: must be a table"):
        sg.load_config({"spec": {"kv": 3}}, env={})
    with pytest.raises(sg.ConfigError, match=r"not valid TOML"):
        sg.load_config(write(tmp_path, "[spec.kv\n"), env={})
    missing = tmp_path / "missing.toml"
    with pytest.raises(sg.ConfigError, match=rf"{missing}: cannot read the config file"):
        sg.load_config(missing, env={})
    with pytest.raises(sg.ConfigError, match=r"source must be a TOML file path or a mapping"):
        sg.load_config(42, env={})  # type: ignore[arg-type]


def test_parse_deadlines_for_an_adapter_table() -> None:
    assert sg.parse_deadlines(
        {"Bootstrapping": 30, "Queued": "none"}, source="sglang.toml", prefix="prefill.deadlines"
    ) == {"Bootstrapping": sg.Deadline(30), "Queued": sg.Deadline()}
    with pytest.raises(sg.ConfigError) as caught:
        sg.parse_deadlines({"Transferring": -1}, source="sglang.toml", prefix="prefill.deadlines")
    assert str(caught.value).startswith(
        "sglang.toml: [prefill.deadlines] Transferring = -1: must be a positive"
    )
    with pytest.raises(
        sg.ConfigError, match=r"sglang.toml: prefill.deadlines = 5: must be a table"
    ):
        sg.parse_deadlines(5, source="sglang.toml", prefix="prefill.deadlines")  # type: ignore[arg-type]
    config = sg.parse_config_table(
        {"deadlines": {"Transferring": 5}, "mode": "report"},
        name="prefill",
        source="sglang.toml",
        prefix="prefill",
    )
    assert (config.spec.name, config.mode) == ("prefill", "report")
    with pytest.raises(sg.ConfigError, match=r"^sglang.toml: \[prefill\] mode = 1: must be one"):
        sg.parse_config_table(
            {"deadlines": {"A": 1}, "mode": 1}, name="p", source="sglang.toml", prefix="prefill"
        )


# --------------------------------------------------------------------------- environment


def test_environment_overrides(tmp_path: Path) -> None:
    env = {
        "STALLGUARD_KV_SENDER_DEADLINE_TRANSFERRING": "60",
        "STALLGUARD_KV_SENDER_STALL_TRANSFERRING": "none",
        "STALLGUARD_KV_SENDER_DEADLINE_QUEUED": "7.5",
        "STALLGUARD_KV_SENDER_MODE": "enforce",
        "STALLGUARD_KV_SENDER_LIFETIME": "None",
        "STALLGUARD_KV_SENDER_MEMORY": " 12 ",
        "STALLGUARD_KV_SENDER_UNKNOWN_STATE": "ignore",
        "STALLGUARD_OTHER_MODE": "bogus",  # another spec, not in this file: not ours
        "PATH": "/usr/bin",
    }
    config = sg.load_config(write(tmp_path, KV_SENDER), env=env)
    assert config.spec.deadlines["Transferring"] == sg.Deadline(60)
    assert config.spec.deadlines["Queued"] == sg.Deadline(7.5)
    assert config.spec.deadlines["Bootstrapping"] == sg.Deadline(300)
    assert config.spec.lifetime is None
    assert (config.mode, config.memory, config.unknown_state) == ("enforce", 12, "ignore")


def test_environment_defaults_to_os_environ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STALLGUARD_KV_SENDER_MODE", "enforce")
    assert sg.load_config(write(tmp_path, KV_SENDER)).mode == "enforce"
    assert sg.load_config(tmp_path / "config.toml", env=None).mode == "report"
    monkeypatch.setenv("APP_KV_SENDER_MODE", "enforce")
    monkeypatch.delenv("STALLGUARD_KV_SENDER_MODE")
    assert sg.load_config(tmp_path / "config.toml", env_prefix="APP").mode == "enforce"


def test_environment_prefix_of_one_spec_inside_another() -> None:
    doc = {
        "spec": {
            "kv": {"deadlines": {"A": 1}},
            "kv-sender": {"deadlines": {"A": 1}},
        }
    }
    env = {"STALLGUARD_KV_SENDER_DEADLINE_A": "9", "STALLGUARD_KV_DEADLINE_A": "3"}
    assert sg.load_spec(doc, name="kv", env=env).deadlines["A"] == sg.Deadline(3)
    assert sg.load_spec(doc, name="kv-sender", env=env).deadlines["A"] == sg.Deadline(9)


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        (
            "STALLGUARD_KV_SENDER_DEADLINE_TRANSFERRING",
            "-1",
            'environment: STALLGUARD_KV_SENDER_DEADLINE_TRANSFERRING = "-1": must be a positive, '
            'finite number of seconds, or "none" for no deadline',
        ),
        (
            "STALLGUARD_KV_SENDER_DEADLINE_TRANSFERRING",
            "2m",
            'STALLGUARD_KV_SENDER_DEADLINE_TRANSFERRING = "2m": must be a positive',
        ),
        (
            "STALLGUARD_KV_SENDER_DEADLINE_TRANSFER",
            "5",
            'STALLGUARD_KV_SENDER_DEADLINE_TRANSFER = "5": spec '
            "'kv_sender' has no state "
            "TRANSFER; its states here are BOOTSTRAPPING, QUEUED, TRANSFERRING, WAITINGFORINPUT",
        ),
        (
            "STALLGUARD_KV_SENDER_DEADLINE_SUCCESS",
            "5",
            "SUCCESS is a terminal state of spec 'kv_sender'; it has no deadline",
        ),
        (
            "STALLGUARD_KV_SENDER_MODE",
            "Report",
            'STALLGUARD_KV_SENDER_MODE = "Report": must be one of "enforce", "report"',
        ),
        (
            "STALLGUARD_KV_SENDER_MEMORY",
            "lots",
            'STALLGUARD_KV_SENDER_MEMORY = "lots": must be a positive integer',
        ),
        (
            "STALLGUARD_KV_SENDER_DEADLNE_QUEUED",
            "5",
            'STALLGUARD_KV_SENDER_DEADLNE_QUEUED = "5": unknown setting DEADLNE_QUEUED; the '
            "settings of spec 'kv_sender' are STALLGUARD_KV_SENDER_MODE",
        ),
    ],
)
def test_bad_environment_names_variable_and_value(
    tmp_path: Path, var: str, value: str, message: str
) -> None:
    with pytest.raises(sg.ConfigError) as caught:
        sg.load_config(write(tmp_path, KV_SENDER), env={var: value})
    assert message in str(caught.value)
    assert str(caught.value).startswith("environment: ")


def test_environment_adds_a_stall_window_and_keeps_the_deadline() -> None:
    doc = {"spec": {"kv": {"deadlines": {"A": 1}, "terminal": ["B"]}}}
    spec = sg.load_spec(doc, env={"STALLGUARD_KV_STALL_A": "0.5"})
    assert spec.deadlines["A"] == sg.Deadline(1, stall=0.5)
