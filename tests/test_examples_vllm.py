"""The vLLM half of the demo (examples/vllm_wedge.py) runs and says what it found: the
plain connector pinned, stallguard-vllm released (real vLLM + NIXL, and vLLM's Mooncake
connector over the real Mooncake transfer engine through ``StallguardConnector``, in
.venv-vllm)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
# two halves (NIXL, Mooncake), each starting vLLM engines: 97-222 s at load 5-20, and
# the suite's other worker beside it (pytest-timeout's default is 300 s)
@pytest.mark.timeout(900)
def test_vllm_wedge_demo_releases_what_plain_vllm_keeps_pinned(tmp_path: Path) -> None:
    if not (ROOT / ".venv-vllm" / "bin" / "python").exists():
        pytest.skip(".venv-vllm is not built (python3 tools/dev.py env builds it)")
    # a relative --out, from another directory: the scenarios run in their own directory
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "vllm_wedge.py"), "--out", "out"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "| pull: READ to a frozen prefill | without | WAITING_FOR_REMOTE_KVS |" in out, out
    assert "| with | FINISHED_ERROR at t=11 s | 8 (quarantined) | error response |" in out, out
    assert "never failed" in out, out
    # the thaw: stallguard's quarantine kept every new owner's bytes, the control did not
    assert "| pull (READ) | stallguard | 0 of " in out, out
    assert "| push (WRITE) | stallguard | 0 of " in out, out
    assert "| pull (READ) | frees at once (control) | 32,768 of " in out, out
    # the Mooncake half: pinned without stallguard, failed at its deadline with it (the
    # same step as NIXL's: Receiving began at t = 1), its blocks quarantined, then the
    # thaw's late WRITE lands in them and nowhere else
    lines = out.splitlines()
    mooncake = [
        "| mooncake: pull from a frozen prefill | without | WAITING_FOR_REMOTE_KVS | 8 | nothing |",
        "|  | with | FINISHED_ERROR at t=11 s | 8 (quarantined) | error response |",
        "| mooncake: aborted while pulling | without | held | (included above) | - |",
        "|  | with | held, quarantined | (included above) | - |",
    ]
    i = lines.index(mooncake[0])
    assert lines[i : i + 4] == mooncake, out
    healthy = (
        "mooncake: healthy pull held up 6 s (0.6 x the deadline) by the frozen prefill: "
        "FINISHED_LENGTH_CAPPED, never failed"
    )
    assert healthy in lines, out
    assert "| mooncake (WRITE) | frees at once (control) | 32,768 of " in out, out
    assert "| mooncake (WRITE) | stallguard | 0 of " in out, out
    assert "quarantine (mooncake): 2 holds released (transfer_done), " in out, out
    res = json.loads((tmp_path / "out" / "vllm_results.json").read_text())
    assert {"pull", "push", "mooncake"} <= set(res)
    mc = res["mooncake"]
    assert mc["refinement"] == "MooncakeRefinement"  # StallguardConnector's Mooncake one
    guarded = mc["after_thaw"]["guarded"]
    # the patterned check: the late bytes in the quarantined blocks are the prefill's KV
    assert guarded["late_bytes_in_held_blocks"] == guarded["held_bytes"] == 32_768, guarded
    assert guarded["failed_bytes_from_prefill"] == 32_768, guarded
    assert guarded["new_owner_bytes"] > 0 and guarded["new_owner_bytes_changed"] == 0, guarded
    for name in ("vllm_wedge.png", "vllm_results.md", "vllm_nixl.log", "vllm_mooncake.log"):
        assert (tmp_path / "out" / name).exists(), name
