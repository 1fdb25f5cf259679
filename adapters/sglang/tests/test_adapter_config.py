"""The adapter's configuration, profiles and version logic: pure Python, no SGLang import."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.specifiers import SpecifierSet
from stallguard_sglang import (
    BACKENDS,
    PROFILES,
    Config,
    effective_deadlines,
    format_support_table,
    load_config,
    parse_config,
    support_table,
)
from stallguard_sglang._hooks import (
    BOOTSTRAP_TARGET,
    FAKE_ABORT_TARGET,
    FAKE_SEND_TARGET,
    INFLIGHT_TARGET,
    UPDATE_STATUS_TARGET,
    hook_plan,
)
from stallguard_sglang.package import (
    SUPPORTED_SGLANG,
    is_supported,
    nixl_has_bootstrap_timeout,
    parse_version,
    supported_specifier,
)

from stallguard import ConfigError, Deadline

ISSUE_EXAMPLE = """
[prefill]
mode = "enforce"            # or "report": log and trace, fail nothing
[prefill.deadlines]         # seconds, keyed by KVPoll state name
Bootstrapping = 300
WaitingForInput = 120
Transferring = 120
"""


def write(tmp_path, text: str) -> str:
    path = tmp_path / "stallguard.toml"
    path.write_text(text)
    return str(path)


# --------------------------------------------------------------------------- enabling


def test_disabled_without_environment():
    assert load_config({}) is None
    assert load_config({"STALLGUARD_SGLANG": "0"}) is None
    assert load_config({"STALLGUARD_SGLANG_CONFIG": ""}) is None


def test_enabled_with_defaults():
    config = load_config({"STALLGUARD_SGLANG": "1"})
    assert config is not None
    assert config.prefill.mode == "enforce"
    assert dict(config.prefill.deadlines) == {}
    assert config.bootstrap_queue.mode == "auto"
    assert config.source == "STALLGUARD_SGLANG=1"


def test_the_schema_from_the_issue(tmp_path):
    path = write(tmp_path, ISSUE_EXAMPLE)
    config = load_config({"STALLGUARD_SGLANG_CONFIG": path})
    assert config is not None and config.source == path
    assert config.prefill.mode == "enforce"
    assert dict(config.prefill.deadlines) == {
        "Bootstrapping": Deadline(300),
        "WaitingForInput": Deadline(120),
        "Transferring": Deadline(120),
    }
    assert effective_deadlines(config, "nixl", environ={}) == {
        "Bootstrapping": Deadline(300),
        "WaitingForInput": Deadline(120),
        "Transferring": Deadline(120),
    }


def test_kill_switch_wins_over_a_file(tmp_path):
    path = write(tmp_path, ISSUE_EXAMPLE)
    assert load_config({"STALLGUARD_SGLANG_CONFIG": path, "STALLGUARD_SGLANG": "0"}) is None


def test_bad_enable_flag_names_the_variable():
    with pytest.raises(ConfigError, match=r"STALLGUARD_SGLANG='maybe'"):
        load_config({"STALLGUARD_SGLANG": "maybe"})


def test_missing_file_names_it(tmp_path):
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="STALLGUARD_SGLANG_CONFIG=.*nope.toml.*no such file"):
        load_config({"STALLGUARD_SGLANG_CONFIG": missing})


def test_toml_syntax_error_names_the_file(tmp_path):
    path = write(tmp_path, "[prefill\nmode = 1\n")
    with pytest.raises(ConfigError) as info:
        load_config({"STALLGUARD_SGLANG_CONFIG": path})
    assert path in str(info.value) and "not valid TOML" in str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "[prefill.deadlines]\nTransferring = -5\n",
            "[prefill.deadlines] Transferring = -5: must be a positive",
        ),
        (
            "[prefill.deadlines]\nTransfering = 5\n",
            "[prefill.deadlines] Transfering = 5: not a KVPoll state that takes a deadline "
            "(did you mean 'Transferring'?)",
        ),
        (
            "[prefill.deadlines]\nSuccess = 5\n",
            "[prefill.deadlines] Success = 5: Success is terminal",
        ),
        ('[prefill]\nmode = "strict"\n', '[prefill] mode = "strict": must be one of'),
        (
            "[prefill]\ndeadline = 5\n",
            "[prefill] deadline = 5: unknown key (did you mean 'deadlines'?)",
        ),
        ("[prefil]\nmode = 1\n", "prefil = { mode = 1 }: unknown key (did you mean 'prefill'?)"),
        (
            '[prefill]\nmode = "enforcing"\n',
            'must be one of "enforce", "report", "off" (did you mean \'enforce\'?)',
        ),
        (
            "[prefill.backends.nixI.deadlines]\nTransferring = 5\n",
            "[prefill.backends] nixI = { deadlines = { Transferring = 5 } }: unknown transfer "
            "backend (did you mean 'nixl'?)",
        ),
        (
            "[prefill.deadlines]\nTransferring = { seconds = 5, stal = 1 }\n",
            "Transferring.stal = 1: unknown key (did you mean 'stall'?)",
        ),
        ('[prefill.deadlines]\nTransferring = "5"\n', 'Transferring = "5": must be a positive'),
        ("[bootstrap_queue]\ndeadline = 0\n", "[bootstrap_queue] deadline = 0: must be a positive"),
        ('[bootstrap_queue]\nmode = "on"\n', '[bootstrap_queue] mode = "on": must be one of'),
    ],
)
def test_errors_name_file_key_and_value(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config({"STALLGUARD_SGLANG_CONFIG": path})
    message = str(info.value)
    assert message.startswith(path + ": "), message
    assert expected in message, message


def test_extended_schema(tmp_path):
    path = write(
        tmp_path,
        """
[prefill]
mode = "report"
[prefill.deadlines]
WaitingForInput = 60
Transferring = { seconds = 120, stall = 15 }
[prefill.backends.mooncake.deadlines]
WaitingForInput = 90
[prefill.backends.nixl.deadlines]
Bootstrapping = "none"
[bootstrap_queue]
mode = "enforce"
deadline = 45
""",
    )
    config = load_config({"STALLGUARD_SGLANG_CONFIG": path})
    assert config is not None
    assert config.prefill.mode == "report"
    assert config.prefill.deadlines["Transferring"] == Deadline(120, stall=15)
    assert config.bootstrap_queue.mode == "enforce" and config.bootstrap_queue.deadline == 45
    nixl = effective_deadlines(config, "nixl", environ={})
    assert nixl == {
        "Bootstrapping": Deadline(),  # "none": explicitly no deadline
        "WaitingForInput": Deadline(60),
        "Transferring": Deadline(120, stall=15),
    }
    assert effective_deadlines(config, "mooncake", environ={})["WaitingForInput"] == Deadline(90)


# --------------------------------------------------------------------------- defaults


def test_defaults_derive_from_sglang_settings():
    config = Config()
    env = {
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "600",
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "90",
    }
    assert effective_deadlines(config, "nixl", environ=env) == {
        "Bootstrapping": Deadline(600),
        "WaitingForInput": Deadline(90),
        "Transferring": Deadline(90),
    }
    # SGLang's own defaults when nothing is set
    assert effective_deadlines(config, "nixl", environ={})["Bootstrapping"] == Deadline(300)


def test_mooncake_waiting_for_input_stands_for_transfer_pending():
    config = parse_config({"prefill": {"deadlines": {"WaitingForInput": 20, "Transferring": 100}}})
    for backend in ("mooncake", "ascend"):
        assert PROFILES[backend].merges_transfer
        assert "Transferring" not in PROFILES[backend].reports
        assert effective_deadlines(config, backend, environ={})["WaitingForInput"] == Deadline(120)
    assert effective_deadlines(config, "nixl", environ={})["WaitingForInput"] == Deadline(20)
    assert effective_deadlines(config, "mori", environ={})["WaitingForInput"] == Deadline(20)
    unbounded = parse_config({"prefill": {"deadlines": {"Transferring": "none"}}})
    assert effective_deadlines(unbounded, "mooncake", environ={})["WaitingForInput"] == Deadline()


def test_every_backend_has_a_profile():
    assert tuple(PROFILES) == BACKENDS
    assert not PROFILES["fake"].common and all(PROFILES[b].common for b in BACKENDS[:-1])


# --------------------------------------------------------------------------- versions


def test_versions():
    assert parse_version("0.5.23.post1") == (0, 5, 23)
    assert parse_version("0.5.18rc0") == (0, 5, 18)
    assert is_supported("0.5.17") and is_supported("0.5.23") and not is_supported("0.5.16")
    assert not is_supported("0.6.0")
    assert not nixl_has_bootstrap_timeout("0.5.17")
    assert nixl_has_bootstrap_timeout("0.5.18") and nixl_has_bootstrap_timeout("0.5.23")
    with pytest.raises(ValueError, match="not a PEP 440 version number: 'main'"):
        parse_version("main")
    with pytest.raises(ValueError, match="not a PEP 440 version number: 'garbage'"):
        is_supported("garbage")


def test_supported_range_follows_pep_440():
    assert supported_specifier() == SpecifierSet(SUPPORTED_SGLANG)
    assert not is_supported("0.5.17rc0")  # before 0.5.17 (a hand-made compare said yes)
    assert not is_supported("0.5.17.dev1")
    assert is_supported("0.5.18rc0") and is_supported("0.5.23.post1")
    assert not is_supported("0.6.0rc0")  # "<0.6" excludes the pre-releases of 0.6


@settings(deadline=None)  # the property is the order, not how long an example takes
@given(
    release=st.tuples(st.integers(0, 1), st.integers(0, 7), st.integers(0, 30)),
    pre=st.sampled_from(["", "rc0", "a1", "b2"]),
    post=st.sampled_from(["", ".post1"]),
    dev=st.sampled_from(["", ".dev3"]),
)
def test_is_supported_against_release_order(release, pre, post, dev):
    version = ".".join(map(str, release)) + pre + post + dev
    # reference: ">=0.5.17,<0.6" under PEP 440, spelled as tuple order: a pre-release of
    # 0.5.17, or a dev release of it (not of its post release), comes before 0.5.17;
    # every 0.6 pre-release is excluded
    early = bool(pre) or (bool(dev) and not post)
    expected = (0, 5, 17) <= release < (0, 6) and not (early and release == (0, 5, 17))
    assert is_supported(version) is expected, version


def test_support_table_per_version():
    config = Config()
    old = {(r.queue, r.backend, r.state): r for r in support_table(config, version="0.5.17")}
    new = {(r.queue, r.backend, r.state): r for r in support_table(config, version="0.5.23")}
    assert old[("bootstrap", "nixl", "Bootstrapping")].sglang == "no: waits forever"
    assert old[("bootstrap", "nixl", "Bootstrapping")].stallguard == "300s"
    assert old[("inflight", "nixl", "Bootstrapping")].sglang == "no: waits forever"
    assert new[("bootstrap", "nixl", "Bootstrapping")].sglang.startswith("yes")
    assert new[("bootstrap", "nixl", "Bootstrapping")].stallguard.startswith("not guarded")
    assert old[("bootstrap", "mooncake", "Bootstrapping")].stallguard.startswith("not guarded")
    assert new[("inflight", "nixl", "Transferring")].sglang.startswith("no")
    assert new[("inflight", "nixl", "Transferring")].stallguard == "300s"
    assert new[("inflight", "mooncake", "Transferring")].stallguard == "n/a"
    assert new[("inflight", "fake", "WaitingForInput")].sglang.startswith("yes")
    assert old[("inflight", "fake", "WaitingForInput")].sglang.startswith("no")
    text = format_support_table(list(new.values()), version="0.5.23")
    assert "SGLang 0.5.23 bounds it" in text.splitlines()[0]
    assert len(text.splitlines()) == len(new) + 2


def test_hook_plan_per_version_and_mode():
    config = Config()
    new = [target for target, _, _ in hook_plan(config, "0.5.23")]
    assert new == [INFLIGHT_TARGET, UPDATE_STATUS_TARGET, FAKE_SEND_TARGET, FAKE_ABORT_TARGET]
    old = [target for target, _, _ in hook_plan(config, "0.5.17")]
    assert old == [
        INFLIGHT_TARGET,
        BOOTSTRAP_TARGET,
        UPDATE_STATUS_TARGET,
        FAKE_SEND_TARGET,
        FAKE_ABORT_TARGET,
    ]
    off = parse_config({"prefill": {"mode": "off"}, "bootstrap_queue": {"mode": "off"}})
    assert hook_plan(off, "0.5.17") == []
    only_boot = parse_config({"prefill": {"mode": "off"}, "bootstrap_queue": {"mode": "enforce"}})
    assert [t for t, _, _ in hook_plan(only_boot, "0.5.23")] == [
        BOOTSTRAP_TARGET,
        UPDATE_STATUS_TARGET,
    ]


def test_deadline_values_are_finite():
    config = parse_config({"prefill": {"deadlines": {"Transferring": 0.5}}})
    assert config.prefill.deadlines["Transferring"].seconds == 0.5
    with pytest.raises(ConfigError, match="Transferring = inf"):
        parse_config({"prefill": {"deadlines": {"Transferring": math.inf}}})


def test_counter_labels_copy_sglangs_scheduler_labels():
    from types import SimpleNamespace

    from stallguard_sglang._metrics import LABELS, scheduler_labels

    sglang_labels = {"model_name": "m", "engine_type": "prefill", "tp_rank": 3, "dp_rank": None}
    sched = SimpleNamespace(metrics_collector=SimpleNamespace(labels=sglang_labels))
    assert scheduler_labels(sched, tp_rank=7) == {
        "model_name": "m",
        "engine_type": "prefill",
        "tp_rank": "3",  # SGLang's value wins: the two must join
        "dp_rank": "",  # absent, not "None"
    }
    assert LABELS == ("queue", "backend", "state", "reason")


def test_counter_labels_without_a_collector_come_from_the_runtime(monkeypatch):
    """Without SGLang's metrics collector, the labels are derived as SGLang derives
    them: the runtime context's values first, the scheduler's where it has none."""
    from types import SimpleNamespace

    from stallguard_sglang._metrics import scheduler_labels

    srt = pytest.importorskip("sglang.srt")
    sched = SimpleNamespace(
        server_args=SimpleNamespace(
            disaggregation_mode=SimpleNamespace(value="decode"), served_model_name="args"
        ),
        ps=SimpleNamespace(pp_rank=2),
    )

    def unpublished():
        raise RuntimeError("not published in this process")

    context = SimpleNamespace(get_disagg=unpublished, get_parallel=unpublished)
    context.get_serving = unpublished
    monkeypatch.setattr(srt, "runtime_context", context, raising=False)
    assert scheduler_labels(sched, tp_rank=1) == {
        "model_name": "args",
        "engine_type": "decode",
        "tp_rank": "1",
        "pp_rank": "2",  # the scheduler's (SGLang 0.5.17)
        "moe_ep_rank": "",
    }
    context.get_serving = lambda: SimpleNamespace(served_model_name="served")
    context.get_disagg = lambda: SimpleNamespace(disaggregation_mode="prefill")
    context.get_parallel = lambda: SimpleNamespace(pp_rank=0, moe_ep_rank=1, dp_rank=3)
    assert scheduler_labels(sched, tp_rank=None) == {
        "model_name": "served",
        "engine_type": "prefill",
        "tp_rank": "",
        "pp_rank": "0",
        "moe_ep_rank": "1",
        "dp_rank": "3",
    }
    assert scheduler_labels(SimpleNamespace(), tp_rank=0)["engine_type"] == "prefill"
