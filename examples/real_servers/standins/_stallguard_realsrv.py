"""CPU stand-ins for running real SGLang 0.5.23 PD servers on a machine without a GPU.

STAND-IN, not stallguard code. Imported by ``_stallguard_realsrv.pth``, which
``tools/dev.py env`` writes into ``.venv-realsrv`` only (the venv of the real-server rig,
examples/real_servers), so every interpreter of that venv, including the scheduler
processes ``sglang.launch_server`` spawns, gets it before SGLang is imported. It must
stay cheap: it runs at every interpreter start-up, and does nothing until
``sglang.srt.disaggregation.nixl.conn`` is imported.

What it stands in for:

* **NIXL memory kind of the KV pool: VRAM -> DRAM.** SGLang registers the device KV pool
  with NIXL as ``VRAM`` (the default of ``_normalize_kv_mem_kinds`` in
  ``disaggregation/nixl/conn.py`` on prefill; ``["VRAM"] * n`` in ``decode.py`` on
  decode, normalised by the same function in the KV manager's constructor). On a CPU the
  "device" pool is host memory, and UCX refuses a VRAM registration of it
  (``NIXL_ERR_BACKEND`` in ``register_memory``). On a GPU host nothing here is needed.
  The wrapper maps ``VRAM`` to ``DRAM`` in what the function returns, so both sides
  register, and advertise, host memory; the transfer itself is NIXL's real one.

The other stand-ins of the rig are not Python: the ``vllm`` stub package next to this
file (see its docstring) and two server flags (examples/real_servers/_servers.py,
``CPU_STANDIN_FLAGS``).

Set ``STALLGUARD_REALSRV_STANDINS=0`` to load SGLang without them (to see the errors).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Sequence

NIXL_CONN = "sglang.srt.disaggregation.nixl.conn"


def _host_memory_kinds(module: types.ModuleType) -> None:
    """Wrap ``module._normalize_kv_mem_kinds`` so that it never answers VRAM."""
    normalize = getattr(module, "_normalize_kv_mem_kinds")  # noqa: B009 (untyped module)
    if getattr(normalize, "_stallguard_realsrv_standin", False):
        return

    def _normalize_kv_mem_kinds(kinds: object, expected_len: int) -> list[str]:
        return ["DRAM" if k == "VRAM" else k for k in normalize(kinds, expected_len)]

    _normalize_kv_mem_kinds._stallguard_realsrv_standin = True  # type: ignore[attr-defined]
    setattr(module, "_normalize_kv_mem_kinds", _normalize_kv_mem_kinds)  # noqa: B010


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds NIXL_CONN with the normal path finder and runs _host_memory_kinds on the
    module right after its code ran (before anything else can use it)."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != NIXL_CONN:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = spec.loader if spec is not None else None
        if spec is None or not isinstance(loader, importlib.abc.Loader):
            return spec
        run_module = loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run_module(module)
            _host_memory_kinds(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    if os.environ.get("STALLGUARD_REALSRV_STANDINS", "1") == "0":
        return
    if NIXL_CONN in sys.modules:  # imported before us: patch it in place
        _host_memory_kinds(sys.modules[NIXL_CONN])
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


install()
