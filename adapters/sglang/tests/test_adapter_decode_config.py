"""The ``[decode]`` table: parsing, every error, defaults, the decode support table and
the hook plan. No SGLang needed."""

from __future__ import annotations

import pytest
from stallguard_sglang import (
    DECODE_PHASES,
    Config,
    decode_deadlines,
    decode_support_table,
    format_support_table,
    parse_config,
)
from stallguard_sglang._decode import hook_plan

from stallguard import ConfigError, Deadline


def parse(decode):
    return parse_config({"decode": decode}, source="f.toml")


def test_defaults_derive_from_sglangs_settings():
    env = {
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "120",
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "600",
    }
    config = Config()
    assert config.decode.mode == "enforce"
    assert decode_deadlines(config, "prealloc", env) == {
        "Bootstrapping": Deadline(seconds=120),
        "WaitingForPrefill": Deadline(seconds=600),
        "WaitingForInput": Deadline(seconds=120),
    }
    assert decode_deadlines(config, "transfer", env) == {
        "WaitingForInput": Deadline(seconds=600),
        "Transferring": Deadline(seconds=600),
    }
    assert decode_deadlines(config, "transfer", {}) == {
        "WaitingForInput": Deadline(seconds=300),
        "Transferring": Deadline(seconds=300),
    }


def test_quarantine_seconds():
    assert Config().decode.quarantine == 60.0
    assert parse({"quarantine": 5}).decode.quarantine == 5.0
    assert parse({"quarantine": 0.5}).decode.quarantine == 0.5
    for bad, shown in ((0, "0"), (-1, "-1"), (float("inf"), "inf"), ("60", '"60"'), (True, "true")):
        with pytest.raises(ConfigError) as info:
            parse({"quarantine": bad})
        assert str(info.value).startswith(f"f.toml: [decode] quarantine = {shown}: must be a ")
        assert "never freed on this timer" in str(info.value)
    with pytest.raises(ConfigError, match=r"\[decode\] quarantin = 5: unknown key"):
        parse({"quarantin": 5})


def test_the_file_overrides_each_phase():
    config = parse(
        {
            "mode": "report",
            "prealloc": {"Bootstrapping": 60, "WaitingForInput": "none"},
            "transfer": {"Transferring": {"seconds": 90, "stall": 10}},
        }
    )
    assert config.decode.mode == "report"
    prealloc = decode_deadlines(config, "prealloc", {})
    assert prealloc["Bootstrapping"] == Deadline(seconds=60)
    assert prealloc["WaitingForInput"] == Deadline()
    assert prealloc["WaitingForPrefill"] == Deadline(seconds=300)
    assert decode_deadlines(config, "transfer", {})["Transferring"] == Deadline(90, stall=10)
    assert set(config.decode.prealloc) <= set(DECODE_PHASES["prealloc"])


@pytest.mark.parametrize(
    ("decode", "message"),
    [
        ({"mode": "fail"}, '[decode] mode = "fail": must be one of "enforce", "report", "off"'),
        (
            {"deadlines": {}},
            "[decode] deadlines = {}: unknown key; allowed keys: mode, quarantine, prealloc",
        ),
        ({"prealloc": 5}, "[decode] prealloc = 5: must be a table ([decode.prealloc])"),
        (
            {"prealloc": {"Bootstraping": 5}},
            "[decode.prealloc] Bootstraping = 5: not a phase of the decode prealloc queue "
            "(did you mean 'Bootstrapping'?)",
        ),
        (
            {"transfer": {"Success": 5}},
            "[decode.transfer] Success = 5: Success is terminal and takes no deadline; "
            "phases: WaitingForInput, Transferring",
        ),
        (
            {"transfer": {"WaitingForPrefill": 5}},
            "[decode.transfer] WaitingForPrefill = 5: not a phase of the decode transfer queue",
        ),
        ({"transfer": {"Transferring": -5}}, "Transferring = -5"),
        ({"prealloc": {"WaitingForInput": "soon"}}, 'WaitingForInput = "soon"'),
    ],
)
def test_bad_decode_config_is_refused_naming_file_key_and_value(decode, message):
    with pytest.raises(ConfigError) as info:
        parse(decode)
    assert str(info.value).startswith("f.toml: ")
    assert message in str(info.value)


def test_the_file_loader_refuses_a_bad_decode_table(tmp_path):
    from stallguard_sglang import load_config

    path = tmp_path / "stallguard-sglang.toml"
    path.write_text("[decode.transfer]\nWaitingForInput = 0\n")
    with pytest.raises(ConfigError, match=r"\[decode.transfer\] WaitingForInput = 0"):
        load_config({"STALLGUARD_SGLANG_CONFIG": str(path)})


def test_unknown_decode_queue_is_a_value_error():
    with pytest.raises(ValueError, match="unknown decode queue 'waiting'"):
        decode_deadlines(Config(), "waiting")


def test_decode_support_table_rows():
    rows = decode_support_table(Config(), {})
    assert [(r.queue, r.state) for r in rows] == [
        ("prealloc", "Bootstrapping"),
        ("prealloc", "WaitingForPrefill"),
        ("prealloc", "WaitingForInput"),
        ("transfer", "WaitingForInput"),
        ("transfer", "Transferring"),
    ]
    by_state = {(r.queue, r.state): r for r in rows}
    assert by_state[("prealloc", "WaitingForPrefill")].backend == "prefill_complete"
    assert by_state[("prealloc", "Bootstrapping")].sglang.startswith("no:")
    assert by_state[("transfer", "WaitingForInput")].sglang.startswith("yes:")
    assert all(r.stallguard == "300s" for r in rows)
    text = format_support_table(rows, version="0.5.23", second="policy")
    assert text.splitlines()[0].split()[:3] == ["queue", "policy", "state"]
    report = decode_support_table(parse({"mode": "report"}), {})
    assert all(r.stallguard.endswith("(report)") for r in report)
    off = decode_support_table(parse({"mode": "off"}), {})
    assert {r.stallguard for r in off} == {"not guarded (decode.mode=off)"}


def test_hook_plan():
    from stallguard_sglang import _decode, _hooks

    update_status = "sglang.srt.disaggregation.common.conn.CommonKVManager.update_status"
    decode_only = hook_plan(Config())
    assert {target: (fn, kind) for target, fn, kind in decode_only} == {
        "sglang.srt.disaggregation.decode.DecodePreallocQueue.pop_preallocated": (
            _decode.prealloc_around,
            "around",
        ),
        "sglang.srt.disaggregation.decode.DecodeTransferQueue.pop_transferred": (
            _decode.transfer_around,
            "around",
        ),
        update_status: (_decode.update_status_after, "after"),
        "sglang.srt.disaggregation.common.conn.CommonKVReceiver.init": (
            _decode.receiver_init_after,
            "after",
        ),
    }
    # with the prefill side's hooks: update_status is hooked once, by both sides
    both = hook_plan(Config(), _hooks.hook_plan(Config(), "0.5.23"))
    targets = [target for target, _, _ in both]
    assert len(targets) == len(set(targets))
    assert (update_status, _decode.update_status_around, "around") in both
    prefill = _hooks.hook_plan(Config(), "0.5.23")
    assert hook_plan(parse({"mode": "off"}), prefill) == prefill
    assert hook_plan(parse({"mode": "off"})) == []


def test_main_prints_the_decode_rows(monkeypatch, capsys):
    from stallguard_sglang.__main__ import main

    monkeypatch.setenv("STALLGUARD_SGLANG", "1")
    monkeypatch.delenv("STALLGUARD_SGLANG_CONFIG", raising=False)
    assert main(["--backend", "nixl"]) == 0
    out = capsys.readouterr().out
    assert "decode queues (every backend" in out
    assert "WaitingForPrefill" in out and "prefill_complete" in out
