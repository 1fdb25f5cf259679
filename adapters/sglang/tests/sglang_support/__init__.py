"""Test helpers that drive the REAL SGLang prefill code (0.5.23 in .venv, 0.5.17 in
.venv-sglang0517) without a GPU, model, scheduler or transfer engine. Plain modules, no
pytest magic; branch on `sglang.__version__` internally, so the same calls work on both.

Importing this package is cheap. Names that need sglang (~8 s import, once per process)
are loaded on first access. Lives with the adapter's tests (adapters/sglang/tests), which
pytest puts on sys.path for them; tools/dev.py's `_stallguard_dev.pth` also puts that
directory on sys.path in both venvs, for the repository's own tests and benchmarks.
`run_in_python` children get it on their PYTHONPATH; `run_ranks` children inherit
the parent's sys.path.

Environment (no sglang import):
    skip_reason(expected="0.5.23") -> str | None     why real-0.5.23 tests can't run here
    sglang0517_skip_reason() -> str | None           why .venv-sglang0517 can't be used
    sglang_version() -> str | None;  version_tuple(v=None) -> tuple[int, ...]
    REPO, VENV, VENV_SGLANG0517, VENV_SGLANG0517_PYTHON, SUPPORT_ROOT (Paths), SUPPORTED

Real objects (_core):
    setup_context(rank=0, world=1, **server_args)    dummy ServerArgs(tp_size=world, ...) +
                                                     tp_rank/attn_tp_rank=rank; replaces the
                                                     previous one. teardown_context(),
                                                     scoped_context(...) (context manager)
    make_manager(backend: "nixl"|"mooncake", bootstrap_timeout=300.0, *, attn_dp_rank=0)
    make_sender(mgr, room, *, bootstrap_addr="127.0.0.1:8998")   -> real Nixl/MooncakeKVSender
    set_status(sender, KVPoll.X)                     mgr.update_status (forward only)
    fail_sender(sender, reason)                      0.5.23 conclude_failure; 0.5.17
                                                     record_failure + update_status(Failed)
    make_request(rid, sender, *, pending_bootstrap=False, prefilled=True,
                 bootstrap_host="127.0.0.1", num_tokens=8, **extra) -> SimpleNamespace
    FakeScheduler(group=None, *, metadata_buffers=16, optimistic_prefill_attempts=0,
                  free_req_slots=16)                 real SchedulerDisaggregationPrefillMixin
        .step(rids_to_check=None) -> done reqs       one real inflight-queue iteration
        .admit(*reqs); .pop_bootstrapped(); .prefill(*reqs)   real bootstrap queue path
        .iteration, .events: list[Event], .conclusions: dict[rid, Conclusion],
        .done_per_iteration, .released, .inflight_rids(), .events_for(rid, kind=None)
    Event(iteration, kind, rid, detail); Conclusion(rid, iteration, outcome, message)
    KVPoll, KVTransferError, SGLANG_VERSION, LEGACY (< 0.5.18), single_process_group(),
    install_release_kv_cache_patch(), uninstall_release_kv_cache_patch(),
    UNOWNED_KV_RELEASES, wait_until(pred, timeout, interval=0.01), next_room()

Processes (_dist, _subproc; no sglang import in the parent):
    run_ranks(fn, world=2, *, args=(), kwargs=None, timeout=120.0, collective_timeout=30.0,
              setup=True, server_args=None, env=None) -> list  (fn(RankInfo, *args, **kw)
              in spawned gloo ranks; RankInfo(rank, world, group, port); raises RankError)
    run_in_python(python, "module:function", *, args=(), kwargs=None, timeout=120.0,
                  env=None) -> result    (raises SubprocessError)
    run_scripts(python, [(env changes, code), ...], *, preload=(), timeout=120.0,
                env=None) -> [ScriptResult(returncode, stdout, stderr)]   each script as
                  `python -c` runs it, forked from one process that imported `preload`
    free_port()

Reusable scenarios returning plain data: sglang_support.scenarios (inflight_states,
fail_on_rank0_only, bootstrap_wedge, call_many).
"""

from __future__ import annotations

import importlib
from typing import Any

from ._env import (
    REPO,
    SUPPORT_ROOT,
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
    **{n: "_subproc" for n in ("ScriptResult", "SubprocessError", "run_in_python", "run_scripts")},
}

__all__ = [
    "REPO",
    "SUPPORT_ROOT",
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
