"""Per-key ``STALLGUARD_SGLANG_*`` overrides and the ``STALLGUARD_SGLANG_MODE`` switch
(docs/sglang.md, "Environment overrides"): applied over the file (or the defaults), each
value read by the file's rules, every bad one a ConfigError naming the variable and the
value; hypothesis tries adversarial values and names."""

from __future__ import annotations

import math
import string
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stallguard_sglang import apply_environment, load_config, parse_config

from stallguard import ConfigError, Deadline

ON = {"STALLGUARD_SGLANG": "1"}


def test_deadline_and_stall_overrides_keep_the_other_field(tmp_path: Path) -> None:
    path = tmp_path / "sg.toml"
    path.write_text(
        "[prefill.deadlines]\nTransferring = { seconds = 120, stall = 15 }\n"
        "[decode.transfer]\nWaitingForInput = 30\n"
    )
    config = load_config(
        {
            "STALLGUARD_SGLANG_CONFIG": str(path),
            "STALLGUARD_SGLANG_PREFILL_DEADLINE_TRANSFERRING": "60",
            "STALLGUARD_SGLANG_PREFILL_NIXL_DEADLINE_BOOTSTRAPPING": " none ",
            "STALLGUARD_SGLANG_DECODE_TRANSFER_STALL_WAITINGFORINPUT": "7.5",
            "STALLGUARD_SGLANG_DECODE_QUARANTINE": "90",
            "STALLGUARD_SGLANG_BOOTSTRAP_QUEUE_DEADLINE": "45",
            "STALLGUARD_SGLANG_ACTIVATION": "auto",  # not an override: left alone
        }
    )
    assert config is not None
    assert config.prefill.deadlines["Transferring"] == Deadline(seconds=60, stall=15)
    assert config.prefill.backends["nixl"] == {"Bootstrapping": Deadline(seconds=None)}
    assert config.decode.transfer["WaitingForInput"] == Deadline(seconds=30, stall=7.5)
    assert config.decode.quarantine == 90 and config.bootstrap_queue.deadline == 45
    assert config.source.startswith(str(path) + " + environment (")
    assert "STALLGUARD_SGLANG_DECODE_QUARANTINE" in config.source


def test_without_overrides_the_config_is_the_files() -> None:
    assert load_config(ON) == parse_config({}, source="STALLGUARD_SGLANG=1")


def test_overrides_need_the_adapter_enabled() -> None:
    assert load_config({"STALLGUARD_SGLANG_PREFILL_MODE": "report"}) is None
    assert load_config({"STALLGUARD_SGLANG": "0", "STALLGUARD_SGLANG_MODE": "report"}) is None


def test_mode_switch_flips_every_guarding_table_and_the_table_variable_wins() -> None:
    base = parse_config({"prefill": {"mode": "enforce"}, "decode": {"mode": "off"}})
    got = apply_environment(base, {"STALLGUARD_SGLANG_MODE": "report"})
    assert got.prefill.mode == "report"
    assert got.decode.mode == "off"  # off stays off
    assert got.bootstrap_queue.mode == "auto" and got.bootstrap_queue.auto_mode == "report"
    got = apply_environment(
        parse_config({"bootstrap_queue": {"mode": "enforce"}}),
        {"STALLGUARD_SGLANG_MODE": "report", "STALLGUARD_SGLANG_DECODE_MODE": "enforce"},
    )
    assert (got.prefill.mode, got.decode.mode, got.bootstrap_queue.mode) == (
        "report",
        "enforce",
        "report",
    )
    back = apply_environment(got, {"STALLGUARD_SGLANG_MODE": "enforce"})
    assert back.prefill.mode == "enforce" and back.bootstrap_queue.mode == "enforce"


def test_the_switch_reaches_the_bootstrap_guard() -> None:
    """``auto`` under the report switch: the same backends guarded, reporting."""
    from stallguard_sglang._guard import QueueGuard
    from stallguard_sglang._runtime import Runtime

    config = apply_environment(parse_config({}), {"STALLGUARD_SGLANG_MODE": "report"})
    guard = QueueGuard(Runtime(config, version="0.5.17"), "bootstrap", 0)
    assert guard._spec("nixl")[1] == "report"
    guard = QueueGuard(Runtime(parse_config({}), version="0.5.17"), "bootstrap", 0)
    assert guard._spec("nixl")[1] == "enforce"  # the control: auto enforces


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"STALLGUARD_SGLANG_PREFILL_DEADLINE_TRANSFERING": "60"},
            'environment: STALLGUARD_SGLANG_PREFILL_DEADLINE_TRANSFERING = "60": unknown '
            "setting (did you mean 'STALLGUARD_SGLANG_PREFILL_DEADLINE_TRANSFERRING'?)",
        ),
        (
            {"STALLGUARD_SGLANG_PREFILL_DEADLINE_TRANSFERRING": "-1"},
            'STALLGUARD_SGLANG_PREFILL_DEADLINE_TRANSFERRING = "-1": must be a positive, '
            'finite number of seconds, or "none" for no deadline',
        ),
        (
            {"STALLGUARD_SGLANG_DECODE_QUARANTINE": "none"},
            'STALLGUARD_SGLANG_DECODE_QUARANTINE = "none": must be a positive, finite number '
            "of seconds; how long",
        ),
        (
            {"STALLGUARD_SGLANG_BOOTSTRAP_QUEUE_DEADLINE": "9" * 400},
            "(this one is too large for a float); set STALLGUARD_SGLANG_BOOTSTRAP_QUEUE_MODE=off",
        ),
        (
            {"STALLGUARD_SGLANG_MODE": "off"},
            'STALLGUARD_SGLANG_MODE = "off": must be one of "enforce", "report"',
        ),
        (
            {"STALLGUARD_SGLANG_PREFILL_MODE": "Report"},
            'must be one of "enforce", "report", "off" (did you mean \'report\'?)',
        ),
        (
            {"STALLGUARD_SGLANG_PREFILL_STALL_BOOTSTRAPPING": "5"},
            "Bootstrapping has no deadline set in the file; set "
            "STALLGUARD_SGLANG_PREFILL_DEADLINE_BOOTSTRAPPING too",
        ),
    ],
)
def test_bad_overrides_name_the_variable_and_the_value(env: dict[str, str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({**ON, **env})
    assert str(info.value).startswith("environment: "), info.value
    assert expected in str(info.value), info.value


NAMES = [
    "STALLGUARD_SGLANG_MODE",
    "STALLGUARD_SGLANG_PREFILL_MODE",
    "STALLGUARD_SGLANG_DECODE_MODE",
    "STALLGUARD_SGLANG_BOOTSTRAP_QUEUE_MODE",
    "STALLGUARD_SGLANG_BOOTSTRAP_QUEUE_DEADLINE",
    "STALLGUARD_SGLANG_DECODE_QUARANTINE",
    "STALLGUARD_SGLANG_PREFILL_DEADLINE_TRANSFERRING",
    "STALLGUARD_SGLANG_PREFILL_STALL_TRANSFERRING",
    "STALLGUARD_SGLANG_PREFILL_MOONCAKE_DEADLINE_WAITINGFORINPUT",
    "STALLGUARD_SGLANG_DECODE_PREALLOC_DEADLINE_WAITINGFORPREFILL",
    "STALLGUARD_SGLANG_DECODE_TRANSFER_STALL_TRANSFERRING",
]

#: what an environment value can be: os.environ holds str, with the bytes of a
#: non-UTF-8 value as lone surrogates (surrogateescape)
values = st.one_of(
    st.sampled_from(["nan", "inf", "-inf", "1e999", "0", "-0.0", "none", "None", "", " "]),
    st.sampled_from(["enforce", "report", "off", "auto", "Report", "60", "0.001", "1_0"]),
    st.integers(min_value=-(10**6), max_value=10**6).map(str),
    st.integers(min_value=10**300, max_value=10**320).map(str),
    st.just("9" * 5000),
    st.binary(max_size=12).map(lambda b: b.decode("utf-8", "surrogateescape")),
    st.text(max_size=12),
    st.text(alphabet=string.digits + ".e-+", max_size=30),
)
names = st.one_of(
    st.sampled_from(NAMES),
    st.sampled_from(NAMES).map(lambda n: n[:-1]),  # a misspelt override
    st.text(alphabet=string.ascii_uppercase + "_", max_size=20).map(
        lambda t: "STALLGUARD_SGLANG_" + t
    ),
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(names, values, max_size=4), st.booleans())
def test_any_overrides_are_applied_or_one_named_error(env: dict[str, str], file: bool) -> None:
    """Whatever the variables and values: a Config whose every deadline is positive and
    finite (or none), or a ConfigError naming one of the variables and its value (as
    the message shows it); never another exception."""
    environ = {**ON, **env}
    for reserved in ("STALLGUARD_SGLANG_CONFIG", "STALLGUARD_SGLANG_ACTIVATION"):
        environ.pop(reserved, None)
    try:
        config = apply_environment(
            parse_config({"decode": {"transfer": {"Transferring": 5}}}), environ
        )
    except ConfigError as e:
        message = str(e)
        assert message.startswith("environment: STALLGUARD_SGLANG_"), message
        var = message.split(" = ", 1)[0].removeprefix("environment: ")
        assert var in env, (var, env)
        message.encode("utf-8")  # printable: no lone surrogates
        return
    tables = [config.prefill.deadlines, config.decode.prealloc, config.decode.transfer]
    tables += list(config.prefill.backends.values())
    for table in tables:
        for deadline in table.values():
            for seconds in (deadline.seconds, deadline.stall):
                assert seconds is None or (seconds > 0 and math.isfinite(seconds))
    assert config.decode.quarantine > 0 and math.isfinite(config.decode.quarantine)
    assert config.prefill.mode in ("enforce", "report", "off")


def test_the_cli_validates_a_file_with_the_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from stallguard_sglang.__main__ import EXIT_USAGE, main

    path = tmp_path / "sg.toml"
    path.write_text("[prefill]\nmode = 'enforce'\n")
    monkeypatch.setenv("STALLGUARD_SGLANG", "0")  # the switch is not what --config reads
    monkeypatch.setenv("STALLGUARD_SGLANG_MODE", "report")
    main(["--config", str(path)])
    out = capsys.readouterr().out
    assert f"config: {path} + environment (STALLGUARD_SGLANG_MODE)" in out
    monkeypatch.setenv("STALLGUARD_SGLANG_MODE", "reprot")
    assert main(["--config", str(path)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert 'STALLGUARD_SGLANG_MODE = "reprot": must be one of' in err
