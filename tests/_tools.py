"""Loading a script of tools/ as a module (they are not a package on sys.path)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` as the module ``_stallguard_<name>_tool``."""
    spec = importlib.util.spec_from_file_location(
        f"_stallguard_{name}_tool", ROOT / "tools" / f"{name}.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
