"""Types are part of the API: ``mypy --strict`` passes on the core, the adapters and
tests/typing/api_types.py (which pins the public API's inferred types)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_mypy_strict_passes() -> None:
    pytest.importorskip("mypy")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_mypy_strict_passes_on_the_vllm_adapter() -> None:
    """stallguard-vllm is checked against its own venv (vLLM's pins conflict with
    SGLang's), with its own mypy settings (adapters/vllm/pyproject.toml)."""
    pytest.importorskip("mypy")
    python = ROOT / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        pytest.skip(".venv-vllm is not built (python3 tools/dev.py env builds it)")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--no-error-summary",
            "--config-file",
            "adapters/vllm/pyproject.toml",
            "--python-executable",
            str(python),
            "adapters/vllm/src/stallguard_vllm",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
