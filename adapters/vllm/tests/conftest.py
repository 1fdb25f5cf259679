"""Make stallguard_vllm importable from a checkout (the pure-Python parts are tested in
.venv, where vLLM is absent; the real-vLLM tests run in .venv-vllm subprocesses)."""

from __future__ import annotations

import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
try:
    import stallguard_vllm  # noqa: F401
except ImportError:
    sys.path.insert(0, str(SRC))
