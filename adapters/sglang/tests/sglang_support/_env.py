"""Where the SGLang test environments are, and whether they are usable.

Cheap on purpose: nothing here imports sglang (that costs ~8 s), so test modules can
decide to skip at collection time.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

#: The directory holding this package (adapters/sglang/tests): put on a child's
#: PYTHONPATH so that it can import sglang_support without any .pth file.
SUPPORT_ROOT = Path(__file__).resolve().parents[1]


def _checkout() -> Path:
    """The repository checkout this package lives in (the directory with tools/dev.py,
    which builds the venvs next to it), else the adapter's directory."""
    for parent in SUPPORT_ROOT.parents:
        if (parent / "tools" / "dev.py").is_file():
            return parent
    return SUPPORT_ROOT.parent


REPO = _checkout()
VENV = REPO / ".venv"
VENV_SGLANG0517 = REPO / ".venv-sglang0517"
VENV_SGLANG0517_PYTHON = VENV_SGLANG0517 / "bin" / "python"

SUPPORTED = ("0.5.17", "0.5.23")
_HOW_TO = "build it with `python3 tools/dev.py env`"


def sglang_version() -> str | None:
    """Version of the sglang distribution visible to this interpreter (None if absent)."""
    if importlib.util.find_spec("sglang") is None:
        return None
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        # e.g. a bare `sglang` namespace directory on sys.path: not the real package
        return None


def version_tuple(version: str | None = None) -> tuple[int, ...]:
    v = version if version is not None else sglang_version()
    if v is None:
        raise RuntimeError(f"sglang is not installed in {sys.prefix}; {_HOW_TO}")
    return tuple(int(p) for p in v.split(".")[:3] if p.isdigit())


def skip_reason(expected: str | None = "0.5.23") -> str | None:
    """Why tests that drive the real SGLang `expected` can't run here, or None if they can."""
    v = sglang_version()
    if v is None:
        return f"sglang is not installed in this interpreter ({sys.prefix}); {_HOW_TO}"
    if expected is not None and v != expected:
        return f"these tests need sglang=={expected}, this interpreter has {v}; {_HOW_TO}"
    if v not in SUPPORTED:
        return f"sglang_support supports sglang {SUPPORTED}, found {v}"
    return None


def sglang0517_skip_reason() -> str | None:
    """Why the SGLang 0.5.17 overlay venv can't be used, or None if it can."""
    if not VENV_SGLANG0517_PYTHON.exists():
        return f"{VENV_SGLANG0517} is absent; {_HOW_TO}"
    sp = (
        VENV_SGLANG0517
        / "lib"
        / f"python{sys.version_info[0]}.{sys.version_info[1]}"
        / "site-packages"
    )
    if not list(sp.glob("sglang-0.5.17.dist-info")):
        return f"{VENV_SGLANG0517} does not hold sglang 0.5.17; {_HOW_TO}"
    return None
