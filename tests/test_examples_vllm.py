"""The vLLM half of the demo (examples/vllm_wedge.py) runs and says what it found: the
plain connector pinned, stallguard-vllm released (real vLLM + NIXL, in .venv-vllm)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_vllm_wedge_demo_releases_what_plain_vllm_keeps_pinned(tmp_path: Path) -> None:
    if not (ROOT / ".venv-vllm" / "bin" / "python").exists():
        pytest.skip(".venv-vllm is not built (python3 tools/dev.py env builds it)")
    # a relative --out, from another directory: the scenarios run in their own directory
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "vllm_wedge.py"), "--out", "out"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
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
    assert (tmp_path / "out" / "vllm_results.json").exists()
