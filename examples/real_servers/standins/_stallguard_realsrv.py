"""CPU stand-ins for running real SGLang 0.5.23 PD servers on a machine without a GPU.

STAND-IN, not stallguard code. Imported by ``_stallguard_realsrv.pth``, which
``tools/dev.py env`` writes into ``.venv-realsrv`` only (the venv of the real-server rig,
examples/real_servers), so every interpreter of that venv, including the scheduler
processes ``sglang.launch_server`` spawns, gets it before SGLang is imported. It must
stay cheap: it runs at every interpreter start-up, and does nothing until
``sglang.srt.disaggregation.nixl.conn`` or ``...mooncake.conn`` is imported.

What it stands in for:

* **NIXL memory kind of the KV pool: VRAM -> DRAM.** SGLang registers the device KV pool
  with NIXL as ``VRAM`` (the default of ``_normalize_kv_mem_kinds`` in
  ``disaggregation/nixl/conn.py`` on prefill; ``["VRAM"] * n`` in ``decode.py`` on
  decode, normalised by the same function in the KV manager's constructor). On a CPU the
  "device" pool is host memory, and UCX refuses a VRAM registration of it
  (``NIXL_ERR_BACKEND`` in ``register_memory``). On a GPU host nothing here is needed.
  The wrapper maps ``VRAM`` to ``DRAM`` in what the function returns, so both sides
  register, and advertise, host memory; the transfer itself is NIXL's real one.

* **Mooncake's sender: indices already on the host.** SGLang's prefill moves a chunk's
  KV page indices to the host for a sender that says ``supports_host_tensor_indices``
  (Mooncake's, ``disaggregation/mooncake/conn.py``) through pinned memory and a CUDA
  event recorded on the current stream (``disaggregation/prefill.py``,
  ``_send_kv_chunk``): on a CPU there is no pinned allocator and the scheduler dies at
  the first request (``RuntimeError: pin_memory=True requires a CUDA or other
  accelerator backend``). On a CPU the indices are host memory already; the class
  attribute is set to False, so the prefill takes the path it takes for NIXL
  (``kv_to_page_indices`` on the host tensor). The transfer is Mooncake's real one (its
  transfer engine over TCP, ``MC_FORCE_TCP=1``).

The other stand-ins of the rig are not Python: the ``vllm`` stub package next to this
file (see its docstring) and two server flags (examples/real_servers/_servers.py,
``CPU_STANDIN_FLAGS``).

Set ``STALLGUARD_REALSRV_STANDINS=0`` to load SGLang without them (to see the errors).

**Not a stand-in either: SGLang's plain-DP prefill rank, fixed.** With
``STALLGUARD_REALSRV_DP_RANK_FIX=1`` (the rig sets it at ``--dp`` > 1, unless
``--no-dp-rank-fix``), ``CommonKVManager`` (``disaggregation/common/conn.py``) takes
its replica's DP rank as its ``attn_dp_rank`` when the server runs DP replicas
(``--dp-size`` > 1, no DP attention). In 0.5.23 a prefill sender compares
``kv_mgr.attn_dp_rank`` with ``bootstrap_room % num_dp_ranks`` (``CommonKVSender``'s
``follow_bootstrap_room`` check) and registers it as the request's DP rank
(``_register_prefill_dp_rank``); with DP replicas ``attn_dp_rank`` is 0 on every
replica, so every request the DP controller sends to a replica other than 0 fails at
bootstrap ("follow_bootstrap_room conflict: dispatched to dp_rank 0 but bootstrap_room
... implies dp_rank 1"), on a GPU host as here (sgl-project/sglang#29725; the fixes
proposed, #29730 and #29733, use the replica's rank at both places, as the bootstrap
server's registration already does). The manager's ``attn_dp_rank`` is read only there
and in that registration payload, where the bootstrap server ignores it once
``system_dp_size`` > 1.

**Not a stand-in: the plugin trace.** With ``STALLGUARD_REALSRV_PLUGIN_TRACE=1`` (the rig
sets it at ``--dp`` > 1) SGLang's own plugin loader (loggers ``sglang.srt.plugins`` and
``sglang.srt.plugins.hook_registry``) logs at INFO to stderr, each line tagged
``[realsrv plugin trace pid=<pid>]``: "Executed general plugin: stallguard" and "Applied
1 hook(s) to <target> (from: plugin=stallguard, dist=stallguard-sglang)" in every
process that calls ``load_plugins()``. SGLang calls it before it configures its loggers
(the launcher, the DP controller, each scheduler, the detokenizer), so those lines are
otherwise dropped; this is how the rig shows which processes loaded the adapter, the DP
controller included (the adapter logs its own line only in processes that run a queue).
Only those two loggers get a handler: the adapter's own (``stallguard.sglang``) is left
alone, so it behaves as without the trace.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Sequence

NIXL_CONN = "sglang.srt.disaggregation.nixl.conn"
MOONCAKE_CONN = "sglang.srt.disaggregation.mooncake.conn"


def _host_memory_kinds(module: types.ModuleType) -> None:
    """Wrap ``module._normalize_kv_mem_kinds`` so that it never answers VRAM."""
    normalize = getattr(module, "_normalize_kv_mem_kinds")  # noqa: B009 (untyped module)
    if getattr(normalize, "_stallguard_realsrv_standin", False):
        return

    def _normalize_kv_mem_kinds(kinds: object, expected_len: int) -> list[str]:
        return ["DRAM" if k == "VRAM" else k for k in normalize(kinds, expected_len)]

    _normalize_kv_mem_kinds._stallguard_realsrv_standin = True  # type: ignore[attr-defined]
    setattr(module, "_normalize_kv_mem_kinds", _normalize_kv_mem_kinds)  # noqa: B010


def _host_tensor_indices(module: types.ModuleType) -> None:
    """Mooncake's sender: no device-to-host copy of the page indices (they are on the
    host)."""
    sender = getattr(module, "MooncakeKVSender", None)
    if sender is not None:
        sender.supports_host_tensor_indices = False


def _replica_dp_rank(module: types.ModuleType) -> None:
    """``CommonKVManager``: a DP replica's rank as its ``attn_dp_rank`` (the fix of
    sgl-project/sglang#29725 described above)."""
    manager = getattr(module, "CommonKVManager", None)
    init = getattr(manager, "__init__", None)
    if manager is None or getattr(init, "_stallguard_realsrv_standin", False):
        return

    def __init__(self: object, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        system_dp_size = getattr(self, "system_dp_size", 1) or 1
        if system_dp_size > 1 and getattr(self, "attn_dp_size", 1) == 1:
            self.attn_dp_rank = getattr(self, "system_dp_rank", 0)  # type: ignore[attr-defined]

    __init__._stallguard_realsrv_standin = True  # type: ignore[attr-defined]
    manager.__init__ = __init__


#: module -> what to do to it right after it is imported
PATCHES = {NIXL_CONN: _host_memory_kinds, MOONCAKE_CONN: _host_tensor_indices}
COMMON_CONN = "sglang.srt.disaggregation.common.conn"
#: SGLang's plain-DP prefill rank fix (not a stand-in; see the module's docstring)
DP_RANK_FIX_ENV = "STALLGUARD_REALSRV_DP_RANK_FIX"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds a module of PATCHES with the normal path finder and runs its patch on the
    module right after its code ran (before anything else can use it)."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = spec.loader if spec is not None else None
        if spec is None or not isinstance(loader, importlib.abc.Loader):
            return spec
        run_module = loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run_module(module)
            patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


#: The rig's diagnostic (not a stand-in): SGLang's plugin loader's INFO lines to stderr
PLUGIN_TRACE_ENV = "STALLGUARD_REALSRV_PLUGIN_TRACE"
#: What each traced line starts with (the pid joins it to a process of the server)
PLUGIN_TRACE_TAG = "[realsrv plugin trace pid="


def trace_plugin_loading() -> None:
    """SGLang's plugin loader's INFO records to stderr, tagged with the pid (idempotent)."""
    import logging

    logger = logging.getLogger("sglang.srt.plugins")
    if any(getattr(h, "_stallguard_realsrv_trace", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(PLUGIN_TRACE_TAG + "%(process)d] %(name)s: %(message)s"))
    handler._stallguard_realsrv_trace = True  # type: ignore[attr-defined]
    logger.addHandler(handler)  # hook_registry's records propagate to it
    logger.setLevel(logging.INFO)


def install() -> None:
    if os.environ.get(PLUGIN_TRACE_ENV, "") == "1":
        trace_plugin_loading()
    if os.environ.get(DP_RANK_FIX_ENV, "") == "1":
        PATCHES[COMMON_CONN] = _replica_dp_rank
    if os.environ.get("STALLGUARD_REALSRV_STANDINS", "1") == "0":
        PATCHES.pop(NIXL_CONN)
        PATCHES.pop(MOONCAKE_CONN)
    if not PATCHES:
        return
    for name, patch in PATCHES.items():
        if name in sys.modules:  # imported before us: patch it in place
            patch(sys.modules[name])
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


install()
