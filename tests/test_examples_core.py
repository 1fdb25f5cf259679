"""The core example runs as a newcomer would run it, and does what it says."""

from __future__ import annotations

from _examples import run_example


def test_stalled_request_example_fails_only_the_stuck_request():
    out = run_example("stalled_request.py")
    assert out.returncode == 0, out.stderr
    assert "room 1: Success" in out.stdout
    assert "room 3: Success" in out.stdout
    assert "room 2: Failed by stallguard" in out.stdout
    assert "inflight at the end: 0; watchdog tracks 0" in out.stdout
    assert "forced failure: spec=kv_sender key=2 state=Transferring" in out.stderr
