"""stallguard-vllm on the real vLLM 0.33.0 code with real NIXL agents (UCX over TCP on
loopback), run in .venv-vllm in subprocesses (tools/dev.py builds it).

One subprocess (vllm_scenarios.py): prefill engines (pull and push) in a child process
that is frozen with SIGSTOP after its prefill, and two decode engines stepped side by
side, one with vLLM's plain NIXL connector and one with stallguard's; stallguard's
clock is a FakeClock moved one second per step.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import vllm_scenarios

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
VENV_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def _skip_reason() -> str | None:
    if not VENV_PYTHON.exists():
        return f"{VENV_PYTHON} missing: run python3 tools/dev.py env"
    return None


SKIP = _skip_reason()
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    # the module's scenarios run once, in its first test's fixture: minutes on a loaded
    # 2-core machine (two vLLM start-ups), past the suite's 300 s default
    pytest.mark.timeout(1500),
    pytest.mark.skipif(SKIP is not None, reason=SKIP or ""),
]

CONFIG = """
[decode]
Receiving = 10
AbortedHeld = 4
Quarantined = 8
[prefill]
HeldForRead = 6
"""


def run_scenario(name: str, config_text: str, tmp_path: Path, timeout: float = 1200) -> Any:
    return vllm_scenarios.run_script(
        VENV_PYTHON, "vllm_scenarios.py", name, config_text, tmp_path, timeout
    )


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Both scenarios in one subprocess pair (one vLLM start-up each side)."""
    return run_scenario(
        "pull,push,prefill_hold,badconfig,peer_killed", CONFIG, tmp_path_factory.mktemp("vllm")
    )


@pytest.fixture(scope="module")
def pull(scenarios: Any) -> Any:
    return scenarios["pull"]


@pytest.fixture(scope="module")
def push(scenarios: Any) -> Any:
    return scenarios["push"]


def test_warm_requests_complete(pull: Any) -> None:
    assert pull["warm"] == {"plain": "FINISHED_LENGTH_CAPPED", "guarded": "FINISHED_LENGTH_CAPPED"}


def test_healthy_transfer_slower_than_half_the_deadline_is_never_failed(pull: Any) -> None:
    slow = pull["slow"]
    deadline = pull["deadline"]
    # the READ really was stuck while P was frozen, then completed after 0.6 x deadline
    assert slow["in_flight_while_frozen"] >= 1, slow
    assert 0.5 * deadline < slow["received_after"] < deadline
    assert slow["status"] == "FINISHED_LENGTH_CAPPED"
    finishes = [o["finish"] for o in slow["outputs"] if o["finish"] is not None]
    assert finishes == ["LENGTH"]
    assert slow["forced"] == {}


def test_frozen_prefill_without_stallguard_stays_pinned(pull: Any) -> None:
    f = pull["freeze"]
    deadline = pull["deadline"]
    last = f["trace"][-1]
    assert last["t"] >= 3 * deadline
    assert last["f-plain"] == "WAITING_FOR_REMOTE_KVS"
    assert last["held_plain"] > 0 and last["in_flight_plain"] >= 1
    assert f["outputs"]["f-plain"] == []  # the client has heard nothing
    assert "P" in f["heartbeat_engines_plain"]  # still extending P's lease


def test_frozen_prefill_with_stallguard_fails_first_step_past_deadline(pull: Any) -> None:
    f = pull["freeze"]
    deadline = pull["deadline"]
    trace = f["trace"]
    first_error = next(i for i, row in enumerate(trace) if row["f-sg"] == "FINISHED_ERROR")
    # Receiving began at the first step (t = 1): its deadline passes at t = 1 + deadline
    # and the step that first sees it fails the request
    assert trace[first_error]["t"] == 1 + deadline
    assert all(row["f-sg"] == "WAITING_FOR_REMOTE_KVS" for row in trace[1:first_error])
    # the client sees exactly one error output
    outs = f["outputs"]["f-sg"]
    assert [o["finish"] for o in outs] == ["ERROR"]
    assert outs[0]["at"] - trace[0]["t"] > 0
    # the blocks stay with the failed request, quarantined, and the READ stays in
    # flight (releasing its handle would not stop it): nothing is freed on the deadline
    for row in trace[first_error:]:
        assert row["in_flight_sg"] >= 1 and row["held_sg"] > 0, row
        assert row["quarantined_sg"] >= 1
    assert f["counts"].get("forced/Receiving") == 1
    holds = {h["key"]: h for h in f["quarantine"]["holds"]}
    assert holds[f["rids"]["f-sg"]]["peer"] == "P"
    assert holds[f["rids"]["f-sg"]]["units"] == 4
    assert holds[f["rids"]["f-sg"]]["nbytes"] == 4 * 8192  # 2 layers x 4 KiB a block


def test_abort_while_waiting(pull: Any) -> None:
    """An aborted request whose READ is in flight: vLLM keeps its blocks until the
    transfer ends (safe); stallguard's AbortedHeld deadline quarantines them (reported,
    counted) and frees nothing either."""
    f = pull["freeze"]
    trace = f["trace"]
    aborted_at = f["aborted_at"]
    held = pull["aborted_held_deadline"]
    assert trace[-1]["a-plain"] is True
    assert trace[-1]["t"] - aborted_at >= 3 * held
    assert all(row["a-sg"] for row in trace if row["t"] >= aborted_at)
    assert f["counts"].get("forced/AbortedHeld") == 1
    assert f["rids"]["a-sg"] in {h["key"] for h in f["quarantine"]["holds"]}
    # both freed once the prefill resumed and the READ completed
    after = pull["after_thaw"]
    assert after["a-sg_held"] is False and after["a-plain_held"] is False


def test_late_read_after_a_forced_failure_never_touches_another_request(pull: Any) -> None:
    """The stale-write test (docs/vllm.md, "Freed blocks and DMA"). After the forced
    failures every block the allocator could hand out is given to a new owner
    (vllm_engine.NEW_OWNER), then the frozen prefill resumes.

    * control (the old stallguard, and any backstop that frees): the handles released,
      the blocks freed; the late READ overwrites the new owner's bytes;
    * stallguard: the failed request's blocks were quarantined; the late READ lands in
      them, byte for byte the prefill's KV (the transfer really was in flight), and not
      one byte of a new owner changes; the blocks are freed once NIXL reports the READ
      done, so nothing leaks."""
    after = pull["after_thaw"]
    unsafe, guarded = after["unsafe"], after["guarded"]
    block = 8192  # bytes of one block over both layers
    assert unsafe["new_owner_bytes_changed"] == 4 * block, unsafe
    assert guarded["new_owner_bytes"] > 0
    assert guarded["new_owner_bytes_changed"] == 0, guarded
    assert len(guarded["held_at_failure"]) == 4
    assert guarded["late_bytes_in_held_blocks"] == 4 * block
    assert guarded["held_bytes_from_prefill"] == 4 * block
    assert guarded["released_after_thaw_s"] is not None and not guarded["still_held"]
    assert after["held_sg"] == 0
    assert after["quarantine"]["holds"] == 0
    assert after["quarantine"]["released"] == {"transfer_done": 2}
    # both holds outlived Quarantined = 8 while the prefill was frozen: escalated (never
    # freed), then released by the READs' end
    assert after["quarantine"]["escalated"] == 2


def test_prometheus_counter_on_vllm_metrics(pull: Any) -> None:
    """The counts travel the way vLLM ships connector stats (SchedulerStats ->
    frontend -> KVConnectorProm), each failure once."""
    # each entry [phase, reason]: a phase deadline fired (no stall window configured)
    entries = [tuple(p) for d in pull["stats_payloads"] for p in d.get("stallguard_forced", ())]
    assert {reason for _, reason in entries} == {"state"}
    shipped = Counter(phase for phase, _ in entries)
    assert shipped == Counter(pull["forced_total"])
    assert shipped["Receiving"] >= 1 and shipped["AbortedHeld"] >= 1
    prom = dict(pull["prometheus"])
    gauges = prom.pop("quarantine_gauges")
    assert prom == {k: float(v) for k, v in shipped.items()}
    # the quarantine gauges for peer P: 4 blocks (AbortedHeld), 8 (and Receiving), each
    # hold overdue 8 s later (Quarantined = 8), then 0 once the resumed prefill's READs
    # completed
    block = 8192
    assert [g[0] for g in gauges] == [4.0, 8.0, 8.0, 8.0, 0.0], gauges
    assert [g[1] for g in gauges] == [4.0 * block, 8.0 * block, 8.0 * block, 8.0 * block, 0.0]
    assert [g[2] for g in gauges] == [0.0, 0.0, 1.0, 2.0, 0.0]


def test_push_mode_write_never_arrives(push: Any) -> None:
    """Push: the decode registered its blocks and waits for a WRITE + notification from a
    prefill that froze. Plain: still waiting after 3 x the deadline; stallguard: failed
    in the first step past it (one error output), its blocks quarantined."""
    assert push["warm"] == {"plain": "FINISHED_LENGTH_CAPPED", "guarded": "FINISHED_LENGTH_CAPPED"}
    deadline = push["deadline"]
    trace = push["trace"]
    assert trace[-1]["t"] >= 3 * deadline
    assert trace[-1]["x-plain"] == "WAITING_FOR_REMOTE_KVS" and trace[-1]["held_plain"] > 0
    assert push["outputs"]["x-plain"] == []
    first_error = next(i for i, row in enumerate(trace) if row["x-sg"] == "FINISHED_ERROR")
    assert trace[first_error]["t"] == 1 + deadline
    assert all(row["held_sg"] > 0 and row["quarantined_sg"] == 1 for row in trace[first_error:])
    assert [o["finish"] for o in push["outputs"]["x-sg"]] == ["ERROR"]
    # held from t = 11 to the thaw at t = 30: past Quarantined = 8, escalated once
    assert push["counts"] == {"forced/Receiving": 1, "quarantine_overdue/Quarantined": 1}


def test_late_write_after_a_forced_failure_never_touches_another_request(push: Any) -> None:
    """Push's stale-write test: the prefill resumes and WRITEs into the decode blocks it
    was given. Control (blocks freed at the failure): the new owner's bytes are
    overwritten. stallguard: the WRITE lands in the quarantined blocks, the new owners
    are untouched, and the completion notification frees the blocks."""
    after = push["after_thaw"]
    unsafe, guarded = after["unsafe"], after["guarded"]
    assert unsafe["new_owner_bytes_changed"] > 0, unsafe
    assert guarded["new_owner_bytes_changed"] == 0, guarded
    assert guarded["late_bytes_in_held_blocks"] > 0, guarded
    assert not guarded["still_held"] and after["held_sg"] == 0
    assert after["quarantine"]["holds"] == 0
    assert after["quarantine"]["released"] == {"transfer_done": 1}


def test_bad_config_stops_the_engine(scenarios: Any) -> None:
    """Building the scheduler (what EngineCore does at start-up) and loading vLLM's
    general plugins both raise, naming the file, the key and the value."""
    bad = scenarios["badconfig"]
    want = f"{bad['path']}: [decode] Receiving = -1: must be a positive, finite number"
    for where in ("connector", "plugin"):
        message = bad[where]
        assert message is not None, f"{where}: a bad file did not stop it"
        assert message.startswith("ConfigError: stallguard-vllm: invalid configuration")
        assert want in message
    assert bad["registered"] == [
        "StallguardConnector",
        "StallguardNixlConnector",
        "StallguardNixlPushConnector",
    ]


def test_peer_killed_frees_the_quarantine(scenarios: Any) -> None:
    """A quarantined request whose prefill process dies: NIXL reports the READ ended in
    error, vLLM's poll ends it, and the blocks are freed (proof ``transfer_error``), so a
    dead peer leaks nothing. Before the kill the request was failed and held."""
    k = scenarios["peer_killed"]
    failed = k["failed"]
    assert failed["status"] == "FINISHED_ERROR" and failed["finishes"] == ["ERROR"]
    assert failed["in_flight"] >= 1 and failed["held"] > 0 and failed["quarantined"] == 1
    assert k["released_after_kill_s"] is not None, k
    assert k["held_after"] == 0
    assert k["quarantine"]["holds"] == 0
    assert k["quarantine"]["released"] == {"transfer_error": 1}


def test_prefill_blocks_held_for_a_read_that_never_comes(scenarios: Any) -> None:
    """Prefill side: vLLM holds the blocks for its lease (300 s here, renewed by every
    decode heartbeat in production); stallguard releases them through vLLM's lease-expiry
    path (finished_sending) in the first step past HeldForRead."""
    hold = scenarios["prefill_hold"]
    deadline = hold["deadline"]
    trace = hold["trace"]
    assert trace[-1]["t"] >= 3 * deadline
    assert trace[-1]["h-plain"] is True and trace[-1]["held_plain"] > 0
    released = next(i for i, row in enumerate(trace) if not row["h-sg"])
    assert trace[released]["t"] == deadline
    assert all(row["h-sg"] and row["held_sg"] > 0 for row in trace[:released])
    assert trace[released]["held_sg"] == 0
    assert hold["counts"] == {"forced/HeldForRead": 1}


def test_one_span_per_failure(scenarios: Any) -> None:
    """Each request stallguard failed has exactly one ``stallguard.forced_failure`` span
    (the core's OpenTelemetry hook), carrying vLLM's request id and the phase."""
    spans = [sp for sp in scenarios["spans"] if sp["name"] == "stallguard.forced_failure"]
    ids = [sp["attributes"].get("vllm.request_id") for sp in spans]
    assert len(ids) == len(set(ids))  # never twice
    # the request id also under the name vLLM's own spans use (and stallguard-sglang's)
    assert [sp["attributes"].get("gen_ai.request.id") for sp in spans] == ids
    rids = scenarios["pull"]["freeze"]["rids"]
    side = {sp["attributes"]["vllm.request_id"]: sp["attributes"]["vllm.kv_side"] for sp in spans}
    for rid in (rids["f-sg"], rids["a-sg"], "x-sg"):
        assert side[rid] == "decode"
    assert side["h-sg"] == "prefill"
    total = sum(scenarios["pull"]["forced_total"].values()) + 2  # + push x-sg + prefill h-sg
    assert len(ids) == total + 1  # + peer_killed's k-sg


def test_overdue_quarantine_is_reported_with_its_memory(scenarios: Any) -> None:
    """A hold past its Quarantined deadline is a ``stallguard.stall_reported`` span of
    state Quarantined (never a forced failure: nothing is freed), with the peer and the
    size of what is held; once per hold."""
    spans = [
        sp
        for sp in scenarios["spans"]
        if sp["attributes"].get("stallguard.spec") == "vllm_kv_quarantine"
    ]
    assert all(sp["name"] == "stallguard.stall_reported" for sp in spans)
    rids = scenarios["pull"]["freeze"]["rids"]
    keys = sorted(sp["attributes"]["stallguard.key"] for sp in spans)
    assert keys == sorted([rids["a-sg"], rids["f-sg"], "x-sg"]), keys  # pull and push
    for sp in spans:
        a = sp["attributes"]
        assert a["stallguard.state"] == "Quarantined"
        assert a["stallguard.quarantine.peer"] == ("PP" if a["stallguard.key"] == "x-sg" else "P")
        assert a["stallguard.quarantine.units"] == 4
        assert a["stallguard.quarantine.bytes"] == 4 * 8192
        assert a["stallguard.quarantine.action"] == "holding"


def test_tearing_the_peer_down_does_not_stop_a_late_read(tmp_path: Path) -> None:
    """Why an overdue quarantine keeps holding instead of tearing the peer down: on raw
    NIXL (the agents vLLM uses), ``remove_remote_agent`` on a READ to a frozen peer makes
    the handle's poll raise, yet the READ completes into the buffer when the peer
    resumes, every byte of it. A teardown that freed the memory would hand it to the
    next request. (Control: the READ was in flight - nothing had landed before.)"""
    out = tmp_path / "teardown.json"
    proc = subprocess.run(
        [str(VENV_PYTHON), str(HERE / "nixl_teardown.py"), str(out)],
        cwd=HERE,
        env=vllm_scenarios.subprocess_env(),
        capture_output=True,
        text=True,
        timeout=240,
        errors="replace",
    )
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert "error" not in r, r
    assert r["warm_read_ok"] is True
    assert r["state_before_teardown"] == "PROC" and r["landed_before_teardown_bytes"] == 0
    assert r["state_after_teardown"] != "PROC"  # NIXL no longer reports it in flight...
    assert r["new_owner_bytes_changed"] == r["new_owner_bytes"], r  # ...and it all lands
    assert r["changed_bytes_are_prefill_data"] is True
