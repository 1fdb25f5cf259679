"""A KV connector stallguard was never told about: the stand-in for LMCache, P2P
tiering and any third-party connector (LMCache does not install here without CUDA).

It is a real vLLM 0.33 ``KVConnectorBase_V1`` (scheduler and worker sides, loaded by
vLLM's ``KVConnectorFactory`` from ``kv_connector_module_path``), with an asynchronous
load whose remote side is a gate the test controls: a decode request with
``do_remote_prefill`` gets all its prompt tokens "from remote"; the worker starts a
thread per request that waits for :data:`GATE` (the remote peer: closed = frozen), then
WRITEs a known pattern into the request's blocks, byte by byte what a late transfer
carries, and reports the request in ``finished_recving``. Nothing in stallguard knows
this class: it goes through the generic guard (the base ``Refinement``).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

#: the remote peer: set = serving, clear = frozen
GATE = threading.Event()
GATE.set()


def late_value(rid: str, block: int) -> float:
    """What the peer writes into *block* for *rid*: float16-exact integers 256..955,
    never a vllm_engine pattern value (1..251) nor NEW_OWNER, and distinct per request
    (a block reused from an earlier request changes when the late write lands)."""
    return float(256 + (sum(map(ord, rid)) * 7 + block * 13) % 700)


class LateMetadata(KVConnectorMetadata):
    def __init__(self) -> None:
        self.loads: dict[str, list[int]] = {}


class LateWriteConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._pending: dict[str, list[int]] = {}
        self._caches: dict[str, torch.Tensor] = {}
        self._done: set[str] = set()
        self._lock = threading.Lock()
        #: rid -> the blocks the peer wrote into (after the gate opened)
        self.written: dict[str, list[int]] = {}

    # scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids or []) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            if num_external_tokens > 0:
                self._pending[request.request_id] = list(blocks.get_block_ids()[0])
            params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = LateMetadata()
        meta.loads, self._pending = self._pending, {}
        return meta

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = kv_caches

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LateMetadata)
        for rid, blocks in meta.loads.items():
            threading.Thread(target=self._load, args=(rid, blocks), daemon=True).start()

    def _load(self, rid: str, blocks: list[int]) -> None:
        GATE.wait()
        for cache in self._caches.values():
            for b in blocks:
                cache[b].fill_(late_value(rid, b))
        with self._lock:
            self.written[rid] = blocks
            self._done.add(rid)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            done, self._done = self._done, set()
        return None, done or None
