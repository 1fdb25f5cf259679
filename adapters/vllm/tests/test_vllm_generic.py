"""The generic guard (``StallguardConnector``) on the real vLLM 0.33.0 code, run in
.venv-vllm in one subprocess (mooncake_scenarios.py):

* vLLM's real ``MooncakeConnector`` over the real Mooncake transfer engine (TCP
  transport on this host), the prefill engine in a child process frozen with SIGSTOP
  while the decodes' pulls are outstanding;
* a connector stallguard was never told about (late_connector.py, the stand-in for
  LMCache, which does not install here without CUDA).

stallguard's clock is a FakeClock moved one second per step.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import vllm_scenarios

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
VENV_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
SKIP = None if VENV_PYTHON.exists() else f"{VENV_PYTHON} missing: run python3 tools/dev.py env"
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
"""


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return vllm_scenarios.run_script(
        VENV_PYTHON,
        "mooncake_scenarios.py",
        "unknown,mooncake",
        CONFIG,
        tmp_path_factory.mktemp("generic"),
    )


@pytest.fixture(scope="module")
def mc(scenarios: Any) -> Any:
    return scenarios["mooncake"]


def test_mooncake_guard_uses_the_mooncake_refinement(mc: Any) -> None:
    assert mc["refinement"] == "MooncakeRefinement"
    assert mc["warm"] == {
        "plain": "FINISHED_LENGTH_CAPPED",
        "guarded": "FINISHED_LENGTH_CAPPED",
        "unsafe": "FINISHED_LENGTH_CAPPED",
    }


def test_mooncake_frozen_prefill_without_stallguard_stays_pinned(mc: Any) -> None:
    R = mc["deadline"]
    last = mc["trace"][-1]
    assert last["t"] >= 3 * R
    assert last["f-plain"] == "WAITING_FOR_REMOTE_KVS"
    assert last["held_plain"] > 0
    assert "f-plain" not in mc["outputs_before_thaw"]  # the client has heard nothing
    assert mc["after_thaw"]["f-plain"] == "FINISHED_LENGTH_CAPPED"  # until the thaw


def test_mooncake_frozen_prefill_with_stallguard_fails_at_its_deadline(mc: Any) -> None:
    R = mc["deadline"]
    trace = mc["trace"]
    first = next(i for i, row in enumerate(trace) if row["f-sg"] == "FINISHED_ERROR")
    # Receiving began in the first step (t = 0 -> 1): the step that first sees the
    # deadline passed (t = 1 + R) fails it, through vLLM's failed-receive path
    assert trace[first]["t"] == 1 + R, trace[first]
    assert all(row["f-sg"] == "WAITING_FOR_REMOTE_KVS" for row in trace[:first])
    assert [o["finish"] for o in mc["outputs"]["f-sg"]] == ["ERROR"]  # exactly once
    assert mc["outputs_before_thaw"]["f-sg"] == mc["outputs"]["f-sg"]  # at its deadline
    # its blocks stay with the failed request (quarantined) until the prefill answers
    for row in trace[first:]:
        assert row["held_sg"] > 0 and row["quarantined_sg"] >= 1, row
    holds = {h["key"]: h for h in mc["quarantine_before_thaw"]["holds"]}
    assert holds["f-sg"]["peer"] == "MP"
    assert holds["f-sg"]["units"] == 4 and holds["f-sg"]["nbytes"] == 4 * mc["block_bytes"]
    assert mc["counts"]["forced/Receiving"] == 1


def test_mooncake_abort_while_waiting_is_bounded_and_held(mc: Any) -> None:
    """An aborted request with a pull outstanding: vLLM keeps its blocks (safe), the
    AbortedHeld deadline quarantines (counts) it; freed once the prefill answered."""
    aborted_at = mc["aborted_at"]
    assert all(
        row["a-sg_held"] and row["a-plain_held"] for row in mc["trace"] if row["t"] > aborted_at
    )
    assert mc["counts"]["forced/AbortedHeld"] == 1
    assert "a-sg" in {h["key"] for h in mc["quarantine_before_thaw"]["holds"]}


def test_mooncake_late_write_never_touches_another_request(mc: Any) -> None:
    """After the failures every free block goes to a new owner, then the prefill
    resumes and answers the pulls it owes, WRITE-ing into the decode blocks it was given.
    Control (freed at the deadline): the new owner's bytes are overwritten. Guarded:
    the WRITE lands in the quarantined blocks, byte for byte the prefill's KV, and no
    new owner's byte changes; the prefill's answer then frees them."""
    after = mc["after_thaw"]
    unsafe, guarded = after["unsafe"], after["guarded"]
    assert unsafe["held_when_new_owners_came"] is False
    assert unsafe["new_owner_bytes_changed"] > 0, unsafe
    assert guarded["held_when_new_owners_came"] is True
    assert guarded["new_owner_bytes"] > 0
    assert guarded["new_owner_bytes_changed"] == 0, guarded
    assert len(guarded["held_at_failure"]) == 4
    assert guarded["late_bytes_in_held_blocks"] > 0, guarded
    assert guarded["failed_bytes_from_prefill"] == guarded["late_bytes_in_held_blocks"]
    assert unsafe["new_owner_bytes_changed"] == guarded["late_bytes_in_held_blocks"]
    assert not guarded["still_held"] and after["held_sg"] == 0
    assert after["quarantine"]["holds"] == 0
    assert after["quarantine"]["released"] == {"transfer_done": 2}
    assert after["quarantine"]["escalated"] == 2  # both outlived Quarantined = 8


def test_mooncake_healthy_request_unharmed(mc: Any) -> None:
    """A request on the guarded decode added 0.6 x the deadline before the thaw: it
    waits on the frozen prefill too, then completes normally."""
    after = mc["after_thaw"]
    assert after["healthy"]["status"] == "FINISHED_LENGTH_CAPPED", after["healthy"]
    assert after["healthy"]["finishes"][-1] == "LENGTH"
    assert "ERROR" not in after["healthy"]["finishes"]
    assert after["healthy_received_s"] is not None
    assert after["f-plain"] != "FINISHED_ERROR"  # the control was never failed


def test_mooncake_counts_shipped_once(mc: Any) -> None:
    # one [phase, reason] entry per forced failure (the shared label vocabulary)
    shipped = Counter(
        tuple(e) for d in mc["stats_payloads"] for e in d.get("stallguard_forced", ())
    )
    assert shipped == Counter({("Receiving", "state"): 1, ("AbortedHeld", "state"): 1})


def test_unknown_connector_failed_at_deadline_and_held_until_it_ends(scenarios: Any) -> None:
    u = scenarios["unknown"]
    R = u["deadline"]
    assert u["refinement"] == "Refinement"  # the generic one: nothing known of it
    assert u["warm"] == {"plain": "FINISHED_LENGTH_CAPPED", "guarded": "FINISHED_LENGTH_CAPPED"}
    trace = u["trace"]
    first = next(i for i, row in enumerate(trace) if row["sg"] == "FINISHED_ERROR")
    assert trace[first]["t"] == 1 + R
    assert trace[-1]["plain"] == "WAITING_FOR_REMOTE_KVS"  # the control: pinned
    assert all(row["sg_held"] and row["quarantined"] == 1 for row in trace[first:])
    assert u["outputs"]["u-sg"] == ["ERROR"]
    assert u["counts"]["forced/Receiving"] == 1
    after = u["after"]
    assert len(after["failed_blocks"]) == 4
    assert after["new_owner_bytes"] > 0 and after["new_owner_bytes_changed"] == 0, after
    # the late write landed, every byte of it, in the failed request's held blocks
    written = after["written_blocks"]
    assert written and set(written) <= set(after["failed_blocks"]), after
    assert after["late_bytes_in_failed_blocks"] == len(written) * 8192, after
    assert after["late_pattern_bytes"] == len(written) * 8192, after
    assert after["still_held"] is False
    assert after["quarantine"] == {"holds": 0, "released": {"transfer_done": 1}}
    assert after["plain"] == "FINISHED_LENGTH_CAPPED"
