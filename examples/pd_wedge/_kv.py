"""Real SGLang KV-transfer setup shared by the prefill and the decode worker processes.

Everything here is SGLang 0.5.23's own machinery: the runtime context, ``KVArgs``, the
bootstrap server, the KV managers of the chosen transfer engine (NIXL or Mooncake).
The only thing that is not a model server's is the memory: the KV "cache" is a few
host (DRAM) buffers, because this machine has no GPU. Both engines move host memory
for real, over TCP loopback.

Import this module only inside a worker process, after ``_env.apply_engine_env()``
has set the environment (SGLang and the engines read it at import time).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import numpy as np
from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.disaggregation.utils import (
    DisaggregationMode,
    KVClassType,
    TransferBackend,
    get_kv_class,
)
from sglang.srt.runtime_context import get_context, get_parallel

HOST = "127.0.0.1"


@dataclass(frozen=True)
class Layout:
    """Shape of the host-memory KV pool, identical on both sides (decode checks it).

    ``layers`` MHA layers give ``2 * layers`` regions (K then V). A request of ``n``
    tokens occupies ``n`` pages (``page_size`` = 1 token) in every region.
    """

    layers: int = 2
    page_bytes: int = 2048
    num_pages: int = 4096
    aux_rows: int = 1024
    aux_row_bytes: int = 64

    @property
    def regions(self) -> int:
        return 2 * self.layers


class HostPool:
    """The KV and metadata ("aux") buffers one side registers with its engine.

    Stands in for the GPU KV pool (``MHATokenToKVPool``) and the metadata buffers of a
    model server: plain numpy ``uint8`` arrays in host memory, so the transfer engines
    really move bytes between the two processes and the decode side can check them.
    """

    def __init__(self, layout: Layout):
        self.layout = layout
        self.kv = [
            np.zeros((layout.num_pages, layout.page_bytes), dtype=np.uint8)
            for _ in range(layout.regions)
        ]
        self.aux = np.zeros((layout.aux_rows, layout.aux_row_bytes), dtype=np.uint8)

    def kv_args(self) -> KVArgs:
        lay = self.layout
        a = KVArgs()
        a.engine_rank = 0
        a.kv_data_ptrs = [int(r.ctypes.data) for r in self.kv]
        a.kv_data_lens = [int(r.nbytes) for r in self.kv]
        a.kv_item_lens = [lay.page_bytes] * lay.regions
        a.kv_layer_ids = []  # positional pairing, as ordinary MHA pools report
        a.kv_data_mem_kinds = ["DRAM"] * lay.regions
        a.kv_cache_dtype_str = "auto"
        a.aux_data_ptrs = [int(self.aux.ctypes.data)]
        a.aux_data_lens = [int(self.aux.nbytes)]
        a.aux_item_lens = [lay.aux_row_bytes]
        a.state_types = []
        a.state_data_ptrs = []
        a.state_data_lens = []
        a.state_item_lens = []
        a.state_layer_ids = []
        a.state_dim_per_tensor = []
        a.state_slice_outer_counts = []
        a.state_conv_shard_groups = []
        a.is_hybrid_mla_backend = False
        a.swa_kv_cache_layout = None
        a.ib_device = None
        a.gpu_id = 0
        a.kv_head_num = 1
        a.total_kv_head_num = 1
        a.page_size = 1
        a.system_dp_rank = 0
        a.rust_http_port = None
        a.pp_rank = 0
        a.prefill_start_layer = 0
        a.prefill_end_layer = lay.layers
        a.mla_compression_ratios = None
        a.kv_buf_groups = 1
        a.hidden_kv_layers = lay.layers
        a.draft_kv_layers = 0
        return a

    # ---- the byte pattern a room carries (decode verifies it page by page)

    @staticmethod
    def pattern(room: int, region: int) -> int:
        return (room * 31 + region * 7) % 251 + 1

    def fill(self, room: int, pages: np.ndarray, aux_row: int) -> None:
        for region, buf in enumerate(self.kv):
            buf[pages] = self.pattern(room, region)
        self.aux[aux_row] = self.pattern(room, 255)

    def check(self, room: int, pages: np.ndarray, aux_row: int) -> bool:
        for region, buf in enumerate(self.kv):
            if not np.all(buf[pages] == self.pattern(room, region)):
                return False
        return bool(np.all(self.aux[aux_row] == self.pattern(room, 255)))

    def scrub(self, pages: np.ndarray, aux_row: int) -> None:
        for buf in self.kv:
            buf[pages] = 0
        self.aux[aux_row] = 0


class StatusProbe:
    """Measurement only: timestamps every status change of a room on a KV manager.

    Installed on the manager *instance*; it calls the class's ``update_status`` (whatever
    plugins made of it) and records ``(monotonic time, new status)`` in ``log[room]``
    when the room's status actually changed (under ``lock``). The demo uses it to know
    when each deadline was due.
    """

    def __init__(self, mgr) -> None:
        self.log: dict[int, list[tuple[float, int]]] = {}
        self.lock = threading.Lock()
        cls_update = type(mgr).update_status

        def update_status(room, status, *args, **kwargs):
            before = mgr.request_status.get(room)
            result = cls_update(mgr, room, status, *args, **kwargs)
            after = mgr.request_status.get(room)
            if after != before and after is not None:
                with self.lock:
                    self.log.setdefault(room, []).append((time.monotonic(), int(after)))
            return result

        mgr.update_status = update_status

    def entered(self, room: int, status: int) -> float | None:
        """When the room last changed into *status* (None: never, as far as seen)."""
        with self.lock:
            times = [t for t, s in self.log.get(room, ()) if s == status]
        return times[-1] if times else None


def single_rank(**extra) -> None:
    """Publish a parallel layout of one rank everywhere (TP, CP, PP, MoE), plus *extra*
    (``dp_size``, ``tp_rank``, ...)."""
    layout = dict(
        tp_rank=0,
        attn_tp_rank=0,
        attn_cp_rank=0,
        attn_dp_rank=0,
        attn_dcp_rank=0,
        pp_rank=0,
        moe_ep_rank=0,
        moe_tp_rank=0,
        moe_dp_rank=0,
        pp_group=None,
    )
    layout.update(extra)
    get_parallel().override_permanently(**layout)


def install_context(mode: str, engine: str, bootstrap_port: int) -> None:
    """Publish the server args and parallel layout SGLang's KV classes read.

    ``mode`` is "prefill" or "decode"; ``engine`` is "nixl" or "mooncake". One TP/DP/PP
    rank, the default ``early`` decode allocation policy, no staging buffer.
    """
    get_context().override_server_args(
        disaggregation_mode=mode,
        disaggregation_transfer_backend=engine,
        disaggregation_bootstrap_port=bootstrap_port,
        host=HOST,
    ).install()
    single_rank()


def kv_class(engine: str, kind: str):
    """SGLang's own class of ``kind`` (MANAGER, SENDER, RECEIVER, BOOTSTRAP_SERVER)."""
    return get_kv_class(TransferBackend(engine), getattr(KVClassType, kind))


def start_bootstrap_server(engine: str, port: int, timeout: float = 20.0):
    """Start SGLang's bootstrap HTTP server and wait until it accepts connections."""
    server = kv_class(engine, "BOOTSTRAP_SERVER")(HOST, port)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return server
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"bootstrap server on port {port} did not come up") from None
            time.sleep(0.05)


def make_manager(engine: str, mode: str, pool: HostPool, kv_args: KVArgs | None = None):
    """Create the engine's real KV manager (NIXL agent / Mooncake engine included), over
    *pool*'s buffers (or *kv_args*, when the caller registers more)."""
    if engine == "mooncake":
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            init_mooncake_transfer_engine,
        )

        init_mooncake_transfer_engine(HOST, gpu_id=0)
    dmode = DisaggregationMode.PREFILL if mode == "prefill" else DisaggregationMode.DECODE
    manager_cls = kv_class(engine, "MANAGER")
    args = pool.kv_args() if kv_args is None else kv_args
    return manager_cls(args, dmode, get_context().server_args, False)
