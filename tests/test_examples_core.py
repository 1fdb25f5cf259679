"""The core example runs as a newcomer would run it, and does what it says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_stalled_request_example_fails_only_the_stuck_request():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "stalled_request.py")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    assert "room 1: Success" in out.stdout
    assert "room 3: Success" in out.stdout
    assert "room 2: Failed by stallguard" in out.stdout
    assert "inflight at the end: 0; watchdog tracks 0" in out.stdout
    assert "forced failure: spec=kv_sender key=2 state=Transferring" in out.stderr
