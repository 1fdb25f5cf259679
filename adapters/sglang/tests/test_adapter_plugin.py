"""The adapter as a server runs it, each scenario in a fresh process of the real venv:

* loaded by SGLang's own `load_plugins()` from the installed entry point, doing nothing
  without STALLGUARD_SGLANG_CONFIG and guarding with it; its span (OpenTelemetry SDK)
  and its counter on SGLang's /metrics (prometheus_client's real multiprocess
  collector over PROMETHEUS_MULTIPROC_DIR, as SGLang serves /metrics);
* a bad configuration stops the real `run_scheduler_process` before it does anything;
* the .pth activation for SGLang builds without the plugin framework;
* two ranks of a real gloo group whose clocks disagree.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import sglang_support as sgs
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent

SKIP = sgs.skip_reason("0.5.23")
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    # a scheduler process importing SGLang took over 150 s at load 12-15 on 2 cores
    pytest.mark.timeout(900),
    pytest.mark.skipif(SKIP is not None, reason=SKIP or ""),
]

CONFIG = """
[prefill]
mode = "enforce"
[prefill.deadlines]
Bootstrapping = 30
WaitingForInput = 10
Transferring = 20
"""


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STALLGUARD_SGLANG")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


@pytest.fixture
def config_path(tmp_path):
    path = tmp_path / "stallguard-sglang.toml"
    path.write_text(CONFIG)
    return str(path)


def run(target: str, *args, timeout: float = 600, **env: str):
    return sgs.run_in_python(
        sys.executable,
        f"sglang_adapter_scenarios:{target}",
        args=args,
        timeout=timeout,
        env=child_env(**env),
    )


def test_load_plugins_with_and_without_config(config_path, tmp_path):
    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir()
    out = run("plugin_roundtrip", config_path, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir))

    assert ("stallguard", "stallguard_sglang.plugin:register") in out["eps"]
    # without the variable: nothing registered, nothing wrapped
    assert out["before"]["runtime"] is False
    assert out["before"]["registered"] == []
    assert not any(out["before"]["wrapped"].values())
    # with it: SGLang's HookRegistry applied the hooks (0.5.23 needs no bootstrap-queue one)
    after = out["after"]
    assert after["runtime"] is True and after["source"] == config_path
    assert after["wrapped"] == {
        "inflight": True,
        "bootstrap": False,
        "update_status": True,
        "fake_send": True,
        "fake_abort": True,
    }
    assert "Executed general plugin: stallguard" in out["logs"]
    assert "stallguard-sglang active on SGLang 0.5.23" in out["logs"]
    assert "Failed to" not in out["logs"]

    # NIXL stuck in Transferring (20 s) and Mooncake in WaitingForInput (10 + 20 s): the
    # clock moves 5 s per iteration after enrollment at T0
    conclusions = out["conclusions"]
    assert conclusions["nixl-stuck"][:2] == (5, "transfer_failed")  # 20 s: 4th step after
    assert conclusions["mooncake-stuck"][:2] == (7, "transfer_failed")  # 30 s
    assert "spent 20.0s in KVPoll.Transferring" in conclusions["nixl-stuck"][2]
    assert "spent 30.0s in KVPoll.WaitingForInput" in conclusions["mooncake-stuck"][2]

    # the span: a child of SGLang's request trace, with the request's identity
    spans = {s["attributes"]["stallguard.sglang.rid"]: s for s in out["spans"]}
    assert set(spans) == {"nixl-stuck", "mooncake-stuck"}
    nixl = spans["nixl-stuck"]
    assert nixl["name"] == "stallguard.forced_failure" and nixl["status"] == "ERROR"
    assert nixl["parent"] == out["parent_span_id"] and nixl["trace_id"] == out["parent_trace_id"]
    assert nixl["attributes"]["stallguard.sglang.backend"] == "nixl"
    assert nixl["attributes"]["stallguard.sglang.tp_rank"] == 0
    assert nixl["attributes"]["stallguard.sglang.queue"] == "inflight"
    assert isinstance(nixl["attributes"]["stallguard.sglang.bootstrap_room"], int)
    assert not any(k.startswith("sglang.") for k in nixl["attributes"])  # old names gone
    assert nixl["attributes"]["stallguard.state"] == "Transferring"
    assert nixl["attributes"]["stallguard.deadline_s"] == 20.0
    assert spans["mooncake-stuck"]["parent"] is None  # no SGLang trace: a root span

    # the counter, as SGLang's /metrics reads it (MultiProcessCollector)
    assert out["multiprocess_value"] != "MutexValue"
    samples = forced_samples("\n".join(out["metrics"]) + "\n")
    # labelled like SGLang's own scheduler metrics (SchedulerMetricsCollector's labels:
    # model_name, engine_type, tp_rank, pp_rank, moe_ep_rank), with the same values, so
    # that the two join
    [running] = [
        dict(s.labels)
        for family in text_string_to_metric_families("\n".join(out["metrics"]) + "\n")
        for s in family.samples
        if s.name == "sglang:num_running_reqs"
    ]
    assert running == {
        "model_name": "test-model",
        "engine_type": "prefill",
        "tp_rank": "0",
        "pp_rank": "0",
        "moe_ep_rank": "0",
    }
    assert samples == {
        ("nixl", "Transferring"): ({"queue": "inflight", "reason": "state", **running}, 1.0),
        ("mooncake", "WaitingForInput"): (
            {"queue": "inflight", "reason": "state", **running},
            1.0,
        ),
    }
    # the startup table was logged once
    assert out["logs"].count("stallguard-sglang: deadlines (config") == 1


def forced_samples(text):
    """(backend, state) -> (the other labels, value) of the forced-failures counter in
    a /metrics scrape."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "sglang:stallguard_forced_failures_total":
                labels = dict(sample.labels)
                key = (labels.pop("backend"), labels.pop("state"))
                out[key] = (labels, sample.value)
    return out


BAD_CONFIGS = {
    "bad value": (
        b"[prefill.deadlines]\nTransferring = -5\n",
        "[prefill.deadlines] Transferring = -5: must be a positive, finite number of "
        'seconds, or "none" for no deadline',
    ),
    # issue 20: these raised UnicodeDecodeError / OverflowError, which load_plugins()
    # swallowed: the scheduler went on unguarded
    "Latin-1": (
        b"[prefill.deadlines]\nTransferring = 20 # 20 \xb5s\n",
        "not UTF-8 text (TOML files must be UTF-8): byte 0xb5 at offset 43 cannot be "
        "decoded; save it as UTF-8",
    ),
    "400 digits": (
        b"[bootstrap_queue]\ndeadline = " + b"9" * 400 + b"\n",
        "[bootstrap_queue] deadline = 99999999999999999999... (400 digits): must be a "
        "positive, finite number of seconds (this one is too large for a float); use "
        'mode = "off" for no deadline',
    ),
}


@pytest.fixture(scope="module")
def active_line_runs(tmp_path_factory):
    """`sglang_adapter_scenarios.active_line` with logging configured after and before
    load_plugins(), each in a process forked from one that imported SGLang once."""
    path = tmp_path_factory.mktemp("active-line") / "stallguard-sglang.toml"
    path.write_text(CONFIG)
    code = (
        "import json, sglang_adapter_scenarios as s\n"
        "print('RESULT ' + json.dumps(s.active_line({path!r}, {first!r})))\n"
    )
    firsts = ("no", "yes")
    results = sgs.run_scripts(
        sys.executable,
        [({}, code.format(path=str(path), first=first)) for first in firsts],
        preload=("sglang.srt.plugins", "sglang.srt.utils.common", "sglang_support._core"),
        timeout=600,
        env=child_env(),
    )
    out = {}
    for first, r in zip(firsts, results, strict=True):
        assert r.returncode == 0, r.stderr[-3000:]
        [line] = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        out[first] = (str(path), json.loads(line.removeprefix("RESULT ")))
    return out


@pytest.mark.parametrize("configure_first", ["no", "yes"])
def test_the_active_line_reaches_a_log_configured_after_load_plugins(
    active_line_runs, configure_first
):
    """launch_server runs load_plugins() before SGLang configures logging: the line is
    kept and logged at the first queue call, once; with logging already configured it
    is logged at once, and not again."""
    config_path, out = active_line_runs[configure_first]
    line = f"stallguard-sglang active on SGLang 0.5.23 (config {config_path}; prefill enforce"
    if configure_first == "no":
        assert line not in out["after_configure"]  # dropped if logged at install time
    else:
        assert line in out["after_plugins"]
    assert out["after_queue"].count(line) == 1, out["after_queue"]
    # it comes with (before) the support table of the first queue call
    table = out["after_queue"].index("stallguard-sglang: deadlines (config")
    assert out["after_queue"].index(line) < table


SCHEDULER = (
    "from sglang.srt.managers.scheduler import run_scheduler_process\n"
    # load_plugins() is its first statement: these arguments are never looked at
    "run_scheduler_process(None, None, 0, 0, 0, None, None)\n"
    "print('SCHEDULER WENT ON')\n"
)


@pytest.fixture(scope="module")
def bad_config_runs(tmp_path_factory):
    """Each bad configuration given to the real `run_scheduler_process`, in a process of
    its own forked from one that imported SGLang's scheduler module (once, not per case:
    10-40 s each) without any STALLGUARD_SGLANG_* variable set; the first script is the
    control, the same call with a good configuration (it must go past load_plugins())."""
    tmp = tmp_path_factory.mktemp("bad-configs")
    good = tmp / "good.toml"
    good.write_text(CONFIG)
    paths = {}
    for i, (case, (data, _)) in enumerate(BAD_CONFIGS.items()):
        paths[case] = tmp / f"bad-{i}.toml"
        paths[case].write_bytes(data)
    scripts = [({"STALLGUARD_SGLANG_CONFIG": str(good)}, SCHEDULER)]
    scripts += [({"STALLGUARD_SGLANG_CONFIG": str(paths[c])}, SCHEDULER) for c in BAD_CONFIGS]
    results = sgs.run_scripts(
        sys.executable,
        scripts,
        preload=("sglang.srt.managers.scheduler",),
        timeout=600,
        env=child_env(),
    )
    control, *bad = results
    return control, {case: (paths[case], r) for case, r in zip(BAD_CONFIGS, bad, strict=True)}


def test_a_good_config_lets_the_scheduler_process_go_on(bad_config_runs):
    """The control of the bad-config cases: the same forked call with a good file gets
    past load_plugins() (it fails later, on the arguments no one passed)."""
    control, _ = bad_config_runs
    assert "stallguard-sglang: invalid configuration" not in control.stderr, control.stderr
    assert "SCHEDULER WENT ON" not in control.stdout  # None arguments: it fails after
    assert "Traceback" in control.stderr and control.returncode == 1, control.stderr[-3000:]


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_stops_the_scheduler_process(bad_config_runs, case):
    _, runs = bad_config_runs
    bad, proc = runs[case]
    _, problem = BAD_CONFIGS[case]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "SCHEDULER WENT ON" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        f"stallguard-sglang: invalid configuration, refusing to start: {bad}: {problem}"
    ), proc.stderr[-3000:]
    assert "Failed to execute general plugin" not in proc.stderr  # not swallowed


def test_pth_activation_without_the_plugin_framework(config_path):
    out = run(
        "pth_fallback",
        STALLGUARD_SGLANG_CONFIG=config_path,
        STALLGUARD_SGLANG_ACTIVATION="pth",  # act as if SGLang had no sglang.srt.plugins
    )
    assert out["armed"] == ["_Finder"]  # armed by the .pth at interpreter start-up
    assert out["prefill_imported_before"] is False
    assert out["hooks"] == {
        "inflight": True,
        "bootstrap": False,
        "update_status": True,
        "fake_send": True,
        "fake_abort": True,
    }
    assert all(out["hooks_after_plugins"].values())  # load_plugins() added nothing
    assert out["conclusions"]["stuck"][1] == "transfer_failed"
    assert "spent 21.0s in KVPoll.Transferring" in out["conclusions"]["stuck"][2]


def test_ranks_whose_clocks_disagree_conclude_in_the_same_iteration(config_path):
    from sglang_adapter_scenarios import ranks_clock_skew

    results = sgs.run_ranks(
        ranks_clock_skew,
        world=2,
        args=(config_path,),
        timeout=600,
        collective_timeout=30,
        env={"PYTHONPATH": child_env()["PYTHONPATH"]},
    )
    rank0, rank1 = results
    assert rank0["iterations"] == rank1["iterations"] == 25  # no collective hung
    # rank 0's clock reaches the 10 s deadline at iteration 11 (enrolled at iteration 1);
    # rank 1's would only at iteration 18: both conclude it at 11
    assert rank0["conclusions"]["stuck"][:2] == (11, "transfer_failed")
    assert rank1["conclusions"]["stuck"][:2] == (11, "transfer_failed")
    assert "stallguard" in rank0["conclusions"]["stuck"][2]
    assert "another rank" in rank1["conclusions"]["stuck"][2]
    assert rank0["expiries"] == [("stuck", "WaitingForInput", 10.0)]
    assert rank1["expiries"] == []  # it left rank 1's queue before rank 1's deadline
    for rank in results:
        assert rank["conclusions"]["healthy"][:2] == (20, "success")
        assert rank["inflight"] == []
