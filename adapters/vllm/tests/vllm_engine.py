"""A vLLM 0.33 disaggregated engine on CPU, minus the model: vLLM's real ``Scheduler``
(which builds the KV connector's scheduler side from the KV-transfer config), the same
connector class built in the worker role with a real NIXL agent (UCX over TCP on
loopback) and real CPU KV-cache tensors registered with it.

Imported only in .venv-vllm (the tests run it in subprocesses). The one stand-in is the
model runner: :func:`step` does what vLLM's ``GPUModelRunner`` does around a forward pass
for the KV connector (bind the step's metadata, ``start_load_kv``, collect
``get_transfer_results`` and ``get_block_ids_with_load_errors``, clear the metadata) and
reports one sampled token per scheduled request; no model is loaded or executed (there
is no GPU here, and the scheduler's and connector's behaviour does not depend on the
logits). The output reaches the scheduler through vLLM's real ``KVOutputAggregator``,
as it does from ``vllm serve``'s multiprocess executor (which holds a ``failed_recving``
back until the request's ``finished_recving``).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("UCX_TLS", "tcp,self")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.parallel_state import (
    ensure_model_parallel_initialized,
    init_distributed_environment,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus  # noqa: F401
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 32  # CPU attention wants multiples of 32
BLOCKS = 32
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
# A tiny Llama: the scheduler and the connector need a model config, not weights.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_model_dir: str | None = None


def model_dir() -> str:
    global _model_dir
    if _model_dir is None and os.environ.get("TINY_MODEL_DIR"):
        _model_dir = os.environ["TINY_MODEL_DIR"]
    if _model_dir is None:
        _model_dir = tempfile.mkdtemp(prefix="tiny-llama-")
        with open(os.path.join(_model_dir, "config.json"), "w") as f:
            json.dump(TINY_LLAMA, f)
    return _model_dir


def vllm_config(
    role: str,
    engine_id: str,
    *,
    connector: str = "NixlConnector",
    module_path: str | None = None,
    extra: dict[str, Any] | None = None,
) -> VllmConfig:
    mc = ModelConfig(model=model_dir(), skip_tokenizer_init=True, dtype="float16", seed=42)
    sc = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=512,
        max_model_len=2048,
        is_encoder_decoder=False,
        async_scheduling=False,
    )
    cc = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=True)
    cc.kv_cache_layout = "LBHNC"
    cc.num_gpu_blocks = BLOCKS
    kt = KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path=module_path,
        kv_role=role,
        engine_id=engine_id,
        kv_buffer_device="cpu",
        kv_connector_extra_config=extra or {},
    )
    return VllmConfig(
        scheduler_config=sc,
        model_config=mc,
        cache_config=cc,
        kv_transfer_config=kt,
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16)
    return KVCacheConfig(
        num_blocks=BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
    )


def init_process(port: int) -> None:
    """vLLM's process-group state (world size 1, gloo) and the block hasher's seed."""
    vc = vllm_config("kv_producer", "init")
    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{port}",
        )
        ensure_model_parallel_initialized(1, 1)
    init_none_hash(sha256)


@dataclass
class Engine:
    """One engine: scheduler (with the connector's scheduler side) + worker connector."""

    scheduler: Scheduler
    worker: Any  # the connector class, built in the worker role
    caches: dict[str, torch.Tensor]
    ran: dict[str, Request] = field(default_factory=dict)
    #: what the multiprocess executor passes every worker output through (world size 1)
    aggregator: KVOutputAggregator = field(default_factory=lambda: KVOutputAggregator(1))

    @property
    def connector(self) -> Any:
        """The scheduler-side connector."""
        return self.scheduler.connector

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.free_block_queue.num_free_blocks

    def block_ids(self, rid: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(rid)[0])

    def free_block_ids(self) -> list[int]:
        """The blocks the allocator can hand to the next request."""
        queue = self.scheduler.kv_cache_manager.block_pool.free_block_queue
        return [b.block_id for b in queue.get_all_free_blocks() if not b.is_null]


#: What a "new owner" writes into every block the allocator could give it: negative,
#: so never a value of :func:`pattern` (whose values are 1..251).
NEW_OWNER = -5.0


def pattern(seed: int, layer: int, block: int) -> torch.Tensor:
    """A block's known contents: distinct per engine (*seed*), layer and block, never
    zero, exact in float16 (integers 1..251)."""
    n = 2 * BLOCK * 32
    values = (torch.arange(n, dtype=torch.int64) * 7 + block * 13 + layer * 101 + seed) % 251 + 1
    return values.to(torch.float16).reshape(2, BLOCK, 32)


def fill_pattern(caches: dict[str, torch.Tensor], seed: int) -> None:
    for layer, name in enumerate(LAYERS):
        for block in range(BLOCKS):
            caches[name][block].copy_(pattern(seed, layer, block))


def give_to_new_owner(e: Engine, blocks: list[int]) -> None:
    """Write :data:`NEW_OWNER` into *blocks* (what the next request's KV would be)."""
    for name in LAYERS:
        for b in blocks:
            e.caches[name][b].fill_(NEW_OWNER)


def bytes_changed(e: Engine, blocks: list[int]) -> int:
    """Bytes of *blocks* that no longer hold :data:`NEW_OWNER`."""
    changed = 0
    for name in LAYERS:
        for b in blocks:
            changed += int((e.caches[name][b] != NEW_OWNER).sum()) * e.caches[name].element_size()
    return changed


def snapshot(e: Engine, blocks: list[int]) -> dict[str, torch.Tensor]:
    """A copy of *blocks* in every layer (see :func:`bytes_changed_since`)."""
    return {name: e.caches[name][blocks].clone() for name in LAYERS} if blocks else {}


def bytes_changed_since(e: Engine, snap: dict[str, torch.Tensor], blocks: list[int]) -> int:
    """Bytes of *blocks* that differ from *snap* (what landed in them since)."""
    if not blocks:
        return 0
    changed = 0
    for name in LAYERS:
        now = e.caches[name][blocks]
        changed += int((now != snap[name]).sum()) * e.caches[name].element_size()
    return changed


def bytes_matching(e: Engine, blocks: list[int], seed: int, remote: list[int]) -> int:
    """Bytes of *blocks* equal to the remote engine's pattern (*seed*) of the block each
    was read from (*remote*, in the same order)."""
    same = 0
    for layer, name in enumerate(LAYERS):
        for b, r in zip(blocks, remote, strict=True):
            hit = e.caches[name][b] == pattern(seed, layer, r)
            same += int(hit.sum()) * e.caches[name].element_size()
    return same


def engine(
    role: str,
    engine_id: str,
    *,
    connector: str = "NixlConnector",
    module_path: str | None = None,
    extra: dict[str, Any] | None = None,
    port: int | None = None,
    seed: int = 0,
) -> Engine:
    """*port*: the side channel (ZMQ handshake) to serve: a prefill always serves one, a
    push-mode decode too (the prefill handshakes back before WRITE-ing). *seed*: the
    engine's KV contents (:func:`pattern`); give each engine its own."""
    vc = vllm_config(role, engine_id, connector=connector, module_path=module_path, extra=extra)
    with set_current_vllm_config(vc):
        sched = Scheduler(
            vllm_config=vc,
            kv_cache_config=kv_cache_config(),
            log_stats=True,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=BLOCK,
        )
        cls = KVConnectorFactory.get_connector_class(vc.kv_transfer_config)
        worker = cls(vc, KVConnectorRole.WORKER, kv_cache_config())
    # known, non-zero contents: a transfer that lands is visible byte for byte
    caches = {name: torch.empty((BLOCKS, 2, BLOCK, 32), dtype=torch.float16) for name in LAYERS}
    fill_pattern(caches, seed)
    worker.register_kv_caches(caches)
    if port is not None:  # start the ZMQ handshake listener
        sched.connector.connector_scheduler.side_channel_port = port
        sched.connector.set_xfer_handshake_metadata_pp_aware(
            {(0, 0): worker.connector_worker.xfer_handshake_metadata}
        )
    return Engine(sched, worker, caches)


def request(rid: str, params: dict[str, Any], max_tokens: int) -> Request:
    """A request with a prompt of its own (prefix caching would otherwise serve a
    repeated prompt from the decode's local cache, reading nothing remotely)."""
    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, 2)
    seed = sum(map(ord, rid)) * 13
    prompt = [3 + (i * 7 + seed) % 500 for i in range(100)]
    r = Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=sp,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )
    r.kv_transfer_params = dict(params)
    return r


def add(e: Engine, r: Request) -> None:
    e.ran[r.request_id] = r
    e.scheduler.add_request(r)


def step(e: Engine) -> tuple[dict[int, Any], Any]:
    """One engine step; returns (the scheduler's outputs to clients, the worker's
    transfer results)."""
    so = e.scheduler.schedule()
    w = e.worker
    w.bind_connector_metadata(so.kv_connector_metadata)
    w.start_load_kv(None)
    res = w.get_transfer_results(set())
    w.clear_connector_metadata()
    kvo = KVConnectorOutput(
        finished_sending=res.finished_sending,
        finished_recving=res.finished_recving,
        failed_recving=res.failed_recving,
        invalid_block_ids=w.get_block_ids_with_load_errors(),
        kv_connector_stats=w.get_kv_connector_stats(),
    )
    ids = [rid for rid in so.num_scheduled_tokens if rid in e.ran]
    mro = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={rid: n for n, rid in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids],  # not EOS: max_tokens ends a request
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kvo,
    )
    aggregated = e.aggregator.aggregate([mro])
    assert aggregated is not None
    return e.scheduler.update_from_output(so, aggregated), res


def outputs_for(eco: dict[int, Any], rid: str) -> list[Any]:
    return [o for v in eco.values() for o in v.outputs if o.request_id == rid]


def prefill(e: Engine, rid: str) -> dict[str, Any]:
    """Run *rid*'s prefill on a producer; returns the kv_transfer_params a router would
    forward to the decode."""
    r = request(rid, {"do_remote_prefill": False, "do_remote_decode": True}, 1)
    add(e, r)
    eco, _ = step(e)
    params = next(o.kv_transfer_params for o in outputs_for(eco, rid))
    assert params is not None, f"prefill {rid} returned no kv_transfer_params"
    return dict(params)


def decode_params(prefill_params: dict[str, Any]) -> dict[str, Any]:
    p = dict(prefill_params)
    p.update(do_remote_prefill=True, do_remote_decode=False)
    return p
