"""Test helpers that drive the REAL SGLang prefill code (0.5.23 in .venv, 0.5.17 in
.venv-sglang0517) without a GPU, model, scheduler or transfer engine.

Plain modules, no pytest magic. Importing this package is cheap; the names that need
sglang (~8 s import, paid once per process) are loaded on first access:

    from sglang_support import skip_reason            # cheap, no sglang import
    from sglang_support import FakeScheduler, make_manager, make_sender, make_request

See _core.py for what is real and what is faked, and the report in tools/dev.py's
commit for the full API. Importable because tools/dev.py's `_stallguard_dev.pth` puts
tests/ on sys.path in both venvs (so spawned children and subprocesses see it too).
"""

from __future__ import annotations

import importlib
from typing import Any

from ._env import (
    REPO,
    SUPPORTED,
    VENV,
    VENV_SGLANG0517,
    VENV_SGLANG0517_PYTHON,
    sglang0517_skip_reason,
    sglang_version,
    skip_reason,
    version_tuple,
)

# name -> submodule, loaded lazily (importing _core imports sglang)
_LAZY = {
    **{
        n: "_core"
        for n in (
            "SGLANG_VERSION",
            "LEGACY",
            "KVPoll",
            "KVTransferError",
            "Backend",
            "setup_context",
            "teardown_context",
            "scoped_context",
            "single_process_group",
            "make_manager",
            "make_sender",
            "set_status",
            "fail_sender",
            "make_request",
            "FakeScheduler",
            "Event",
            "Conclusion",
            "install_release_kv_cache_patch",
            "uninstall_release_kv_cache_patch",
            "UNOWNED_KV_RELEASES",
            "wait_until",
            "next_room",
        )
    },
    **{n: "_dist" for n in ("RankInfo", "RankError", "run_ranks", "free_port")},
    **{n: "_subproc" for n in ("SubprocessError", "run_in_python")},
}

__all__ = [
    "REPO",
    "SUPPORTED",
    "VENV",
    "VENV_SGLANG0517",
    "VENV_SGLANG0517_PYTHON",
    "sglang0517_skip_reason",
    "sglang_version",
    "skip_reason",
    "version_tuple",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
