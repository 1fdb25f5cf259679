"""A data-parallel prefill server's KV side, for the decode-side faults: two DP ranks, each
a real prefill ``KVManager`` (NIXL or Mooncake) over host memory and SGLang's
``MetadataBuffers``, in one process, registered with a bootstrap server.

With DP 2 and ``round_robin`` load balancing, a decode server cannot derive a room's
prefill rank: it asks the bootstrap server (``/query_dp_ranks``), which learns the room
only when the prefill scheduler creates the room's ``KVSender`` (``register``). So when
this process is frozen, decode requests for rooms it has not registered yet wait in
decode's ``pending_reqs``, in ``Bootstrapping``, with no deadline in SGLang 0.5.23.

Shared by the demo's prefill peer (``_ppeer.py``) and stallguard-sglang's decode tests
(``adapters/sglang/tests/sglang_decode_support.py``). Import inside a worker process.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.runtime_context import get_context

from . import _kv
from ._decode_queues import metadata_buffers

DP = 2


def install_context(engine: str, port: int, policy: str = "early") -> None:
    """The server args of a DP-2 ``round_robin`` prefill whose bootstrap server listens on
    *port* (decode reads the allocation *policy* from it)."""
    get_context().override_server_args(
        disaggregation_mode="prefill",
        disaggregation_transfer_backend=engine,
        disaggregation_bootstrap_port=port,
        disaggregation_decode_allocation_policy=policy,
        host=_kv.HOST,
        dp_size=DP,
        load_balance_method="round_robin",
    ).install()


class PrefillRanks:
    """The DP ranks' KV managers; rooms are served by rank 0 (rank 1 only makes the
    server DP 2). ``register`` is the scheduler creating a room's sender; ``send`` is the
    forward pass done: the KV pages and the metadata row go to decode."""

    def __init__(self, engine: str, port: int, layout: _kv.Layout) -> None:
        self.engine = engine
        self.addr = f"{_kv.HOST}:{port}"
        self.layout = layout
        self.managers: list[tuple[Any, _kv.HostPool, Any]] = []
        if engine == "mooncake":
            from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
                init_mooncake_transfer_engine,
            )

            init_mooncake_transfer_engine(_kv.HOST, gpu_id=0)  # one engine per process
        for rank in range(DP):
            # system DP: a rank is kv_args.system_dp_rank (attn_dp_rank stays 0)
            _kv.single_rank(dp_size=DP, num_dp_ranks=DP, load_balance_method="round_robin")
            pool = _kv.HostPool(layout)
            args = pool.kv_args()
            args.system_dp_rank = rank
            meta = metadata_buffers(layout.aux_rows)
            args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = meta.get_buf_infos()
            mgr = _kv.kv_class(engine, "MANAGER")(
                args, _kv.DisaggregationMode.PREFILL, get_context().server_args, False
            )
            self.managers.append((mgr, pool, meta))
        self.mgr, self.pool, self.meta = self.managers[0]
        self.senders: dict[int, Any] = {}
        self._sender_cls = _kv.kv_class(engine, "SENDER")

    def register(self, room: int) -> int:
        """Create the room's sender (which registers its DP rank with the bootstrap
        server); returns its first poll."""
        self.senders[room] = self._sender_cls(self.mgr, self.addr, room)
        return int(self.senders[room].poll())

    def status(self, room: int) -> int:
        return int(self.mgr.request_status.get(room, -1))

    def poll(self, room: int) -> int:
        return int(self.senders[room].poll())

    def send(self, room: int, npages: int, write_room: bool = True) -> None:
        """Send the room's KV (*npages* pages filled with the room's pattern) and its
        metadata row (carrying the room, unless *write_room* is false: then SGLang's
        metadata gate on decode holds the concluded request as ``Transferring``).
        The sender must be ``WaitingForInput`` (decode's metadata arrived)."""
        row = room % self.layout.aux_rows  # each room its own metadata row
        self.meta.bootstrap_room[row, 0] = room if write_room else 0
        pages = np.arange(npages, dtype=np.int32)
        sender = self.senders[room]
        sender.init(npages, row)
        sender.send(pages)

    def wait_and_send(
        self, room: int, npages: int, write_room: bool = True, timeout: float = 10.0
    ) -> None:
        """``send`` once decode's metadata arrived (at most *timeout* seconds)."""
        deadline = time.monotonic() + timeout
        while self.poll(room) != KVPoll.WaitingForInput:
            if time.monotonic() > deadline:
                raise TimeoutError(f"room {room}: no decode metadata")
            time.sleep(0.01)
        self.send(room, npages, write_room)

    def forget(self, room: int) -> None:
        self.senders.pop(room, None)
