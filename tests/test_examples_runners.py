"""The runner and transitions examples run as programs, and pass their own checks."""

from __future__ import annotations

import pytest
from _examples import run_example as run


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_anyio_runner_example(backend: str) -> None:
    result = run("anyio_runner.py", "--backend", backend)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert f"backend: {backend};" in out
    assert "req-4: failed: stallguard: in Transferring" in out
    assert out.count(": success") == 3
    assert "check: OK" in out


def test_transitions_example_quick() -> None:
    result = run("transitions_deadlines.py", "--quick")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "stallguard.transitions: 1,000 models" in out
    assert "threads: 1 before, 1 while 1,000 models are in flight, 1 after (0 extra)" in out
    assert "expired: 10 of 10 stalled models" in out
    assert "0 healthy models failed" in out
    assert "check: OK" in out
    # the comparison really ran transitions' Timeout state, one thread per model
    assert "transitions Timeout state: 100 models" in out
    assert "(100 extra: one timer thread per model)" in out
