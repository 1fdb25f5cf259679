"""The stallguard connectors: any vLLM KV connector, with per-phase deadlines.

``StallguardConnector`` wraps the connector its ``kv_connector_extra_config`` names
(the way vLLM's ``MultiConnector`` names its children)::

    --kv-transfer-config '{"kv_connector": "StallguardConnector",
        "kv_connector_module_path": "stallguard_vllm.connector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"inner": {
            "kv_connector": "MooncakeConnector",
            "kv_connector_extra_config": {"mooncake_protocol": "rdma"}}}}'

The inner connector gets the outer KV-transfer config with the inner's keys on top
(``kv_connector``, ``kv_connector_module_path``, ``kv_connector_extra_config``, any
other field given). ``StallguardNixlConnector`` and ``StallguardNixlPushConnector``
are the same guard with the inner fixed to vLLM's ``NixlPullConnector`` /
``NixlPushConnector`` (no ``inner`` key: the extra config is NIXL's own).

What the guard does, for any inner connector (one code path):

* **scheduler side** (one per engine core): every phase change of a disaggregated
  request is observed where vLLM makes it (``on_new_request``,
  ``update_state_after_alloc``, ``request_finished``, ``update_connector_output``);
  ``build_connector_meta``, which vLLM calls once per scheduler step, runs the
  deadline check, and the requests found overdue ride to the workers on the step's
  connector metadata (three extra attributes of the inner connector's metadata).
* **worker side**: each overdue receive is reported failed in the same step: by its
  blocks (the scheduler sends them with the order) as blocks that failed to load
  (``get_block_ids_with_load_errors``), which vLLM's ``kv_load_failure_policy`` turns
  into ``FINISHED_ERROR`` (the client's error response) in the step it hears of them.
  Not by ``failed_recving``: vLLM's multiprocess executor passes that to the scheduler
  only together with the request's ``finished_recving``, i.e. when the stuck transfer
  ends. (A model with several KV cache groups has no unique block ids: there the
  scheduler sends none, the receive goes in ``failed_recving``, and the client is
  answered when it ends.) The receive is not reported in ``finished_recving``, so vLLM keeps
  its blocks, as it does for an aborted request, until the inner connector reports
  the receive ended **and** the end proves nothing can still land: until then the
  blocks are quarantined (:attr:`PhaseTracker.quarantine`; an overdue hold is
  escalated, never freed). Overdue prefill holds are released only where the
  connector's refinement knows a safe way.

What is transport-specific is a :class:`Refinement`, chosen by the inner connector's
class (:data:`REFINEMENTS`):

* **NIXL** (pull and push): a pull still in its handshake (no READ posted) is failed
  when it ends (vLLM bounds it at 5 s); a push whose WRITE notification just arrived is
  let succeed; the end vLLM reports (every handle ``DONE`` or ``ERR``) is proof;
  prefill holds are released through vLLM's lease-expiry path once the decode stopped
  heartbeating for them.
* **Mooncake**: an end is proof when the prefill answered the pull (its
  ``batch_transfer_sync_write`` returns before it answers); an end that comes from the
  decode's own ZMQ timeout or socket error is not (the prefill may still be about to
  WRITE): the hold stays. Prefill holds are released through Mooncake's own
  expiry (``expire_time``) only while no WRITE is in flight (``sending == 0``).
* **any other connector** (:class:`Refinement` itself): an overdue receive is reported
  failed at once; its blocks are held until the connector reports it in
  ``finished_recving``, which is the connector's promise (vLLM frees the blocks on it
  whatever stallguard does) - an unknown connector's late write after that is the
  connector's bug, and stallguard says so in the coverage table; the ``Quarantined``
  deadline escalates a hold the connector never ends. Prefill holds are only
  reported: releasing blocks under a transport stallguard does not know could hand
  them to another request mid-read.

So nothing is scheduled by stallguard: a dict write per phase change, one clock read
per step, and the failure path is vLLM's.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from stallguard import ConfigError

from ._config import Config, config_or_raise
from ._coverage import DEFAULT_LEASE, coverage_rows, format_coverage
from ._inner import INNER_KEY, inner_transfer_config
from ._ledger import FailLedger, Verdict
from ._phases import PhaseTracker
from ._wrap_metrics import StallguardPromMetrics, StallguardStats, stats_with_counts
from .package import SUPPORTED_VLLM

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "FAIL_BLOCKS_ATTR",
    "FAIL_RECV_ATTR",
    "INNER_KEY",
    "MOONCAKE_INTERNALS",
    "REFINEMENTS",
    "RELEASE_SEND_ATTR",
    "VLLM_INTERNALS",
    "MooncakeRefinement",
    "NixlRefinement",
    "Refinement",
    "StallguardConnector",
    "StallguardNixlConnector",
    "StallguardNixlPushConnector",
    "inner_transfer_config",
    "set_clock",
]

log = logging.getLogger("stallguard.vllm")

#: The attribute of the step's connector metadata that names the decode requests to fail.
FAIL_RECV_ATTR = "stallguard_fail_recv"
#: The attribute of the step's connector metadata that maps each decode request to fail to
#: the blocks its receive writes into (where the scheduler knows them: one KV cache group).
FAIL_BLOCKS_ATTR = "stallguard_fail_blocks"
#: The attribute of the step's connector metadata that names the prefill holds to release.
RELEASE_SEND_ATTR = "stallguard_release_send"
#: The private names of vLLM's NIXL worker the NIXL refinement uses (checked at start).
VLLM_INTERNALS = (
    "_recving_transfers",
    "_recving_metadata",
    "_reqs_to_send",
    "xfer_stats",
)
#: The private names of vLLM's Mooncake worker the Mooncake refinement uses (and, on a
#: prefill, ``sender_loop``).
MOONCAKE_INTERNALS = (
    "_handle_failed_recv",
    "reqs_need_send",
    "xfer_stats",
)

_logged_table: set[str] = set()
_clock: Callable[[], float] = time.monotonic


def set_clock(clock: Callable[[], float]) -> None:
    """Use *clock* (seconds, never going backwards; default ``time.monotonic``) for the
    stallguard connectors created from now on in this process. For tests: a
    :class:`stallguard.testing.FakeClock`.

    Raises:
        TypeError: if *clock* is not callable.
    """
    global _clock
    if not callable(clock):
        raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
    _clock = clock


# ---------------------------------------------------------------------- refinements


class Refinement:
    """What stallguard knows of one inner connector's transport. This base class is
    what it does for a connector it was never told about (see the module docstring);
    subclasses refine it. Worker side only: the scheduler side is connector-agnostic.

    Args:
        inner: the inner connector, built in the worker role.
        vllm_config: the inner connector's vLLM config.
    """

    #: the name in logs and the span attribute ``vllm.kv_transfer_mode``
    name = "generic"
    #: whether :meth:`release_send` can release a prefill hold
    releases_sends = False

    def __init__(self, inner: Any, vllm_config: Any) -> None:
        self.inner = inner
        self.vllm_config = vllm_config

    def verdict(self, rid: str) -> Verdict:
        """An ordered receive: ``"fail"`` (report it failed now), ``"wait"`` (ask again
        next step) or ``"drop"`` (its transfer just completed: let it succeed)."""
        return "fail"

    def unproven(self, ended: set[str]) -> set[str]:
        """Of the receives the inner connector reported ended this step, those whose end
        does not prove that nothing can still land in their blocks."""
        return set()

    def release_send(self, rid: str) -> bool:
        """Release a prefill's held blocks; True when done (or gone), False to retry
        next step. The base class never releases (returns True: nothing to retry)."""
        return True

    def on_step(self) -> None:
        """Called once per worker step, after the orders (housekeeping)."""


class NixlRefinement(Refinement):
    """vLLM's NIXL connectors (pull: the decode READs; push: the prefill WRITEs)."""

    name = "pull"
    releases_sends = True

    def __init__(self, inner: Any, vllm_config: Any) -> None:
        super().__init__(inner, vllm_config)
        w = inner.connector_worker
        missing = [n for n in VLLM_INTERNALS if not hasattr(w, n)]
        if missing:
            raise RuntimeError(
                "stallguard-vllm: this vLLM's NIXL worker lacks "
                f"{', '.join(missing)}; the adapter supports vLLM {SUPPORTED_VLLM} "
                "(set STALLGUARD_VLLM=0 to run the plain connector)"
            )
        self.worker = w
        #: prefill: rid -> when its decode last heartbeated (perf_counter)
        self.heartbeats: dict[str, float] = {}
        # a decode that heartbeated within two of its heartbeat intervals (vLLM sends
        # one every lease/6) is alive and may be reading a held block
        lease = _lease(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self.silence = (DEFAULT_LEASE if lease is None else lease) / 3
        self._watch_heartbeats()

    def verdict(self, rid: str) -> Verdict:
        w = self.worker
        handles = w._recving_transfers.get(rid)
        if handles:
            w.xfer_stats.record_failed_transfer()  # vLLM's nixl_num_failed_transfers
            return "fail"
        if handles is not None:
            return "drop"  # push: the completion notification just arrived
        if rid in w._recving_metadata:
            if self.name == "pull":
                return "wait"  # handshake pending: no READ issued yet
            # push: the prefill may still WRITE into the registered blocks; its
            # completion notification ends the hold
            w.xfer_stats.record_failed_transfer()
            return "fail"
        return "drop"  # not receiving (any more) on this worker

    def release_send(self, rid: str) -> bool:
        """Through vLLM's lease-expiry path, once the decode has gone silent for the
        request: a decode that heartbeats may be reading its blocks right now."""
        w = self.worker
        if rid in w._reqs_to_send:
            last = self.heartbeats.get(rid)
            if last is not None and time.perf_counter() - last < self.silence:
                return False  # the decode is alive and may be reading: keep
            w._reqs_to_send[rid] = float("-inf")  # expired: reaped this step
        self.heartbeats.pop(rid, None)
        return True

    def on_step(self) -> None:
        seen = self.heartbeats
        held = self.worker._reqs_to_send
        if len(seen) > 64 and len(seen) > 2 * len(held):
            for rid in [r for r in seen if r not in held]:
                del seen[rid]

    def _watch_heartbeats(self) -> None:
        """Record when the decode last heartbeated for each held request (vLLM's worker
        extends the lease in ``_handle_heartbeat``; stallguard wraps it)."""
        w = self.worker
        handle = getattr(w, "_handle_heartbeat", None)
        if handle is None:
            return
        seen = self.heartbeats

        def handle_heartbeat(payload: str) -> None:
            handle(payload)
            now = time.perf_counter()
            for rid in payload.split(","):
                if rid in w._reqs_to_send:
                    seen[rid] = now

        w._handle_heartbeat = handle_heartbeat


class NixlPushRefinement(NixlRefinement):
    """vLLM's ``NixlPushConnector``."""

    name = "push"


class MooncakeRefinement(Refinement):
    """vLLM's ``MooncakeConnector`` (the prefill WRITEs into the decode's blocks with
    the Mooncake transfer engine, then answers the decode's pull request over ZMQ)."""

    name = "mooncake"
    releases_sends = True
    #: the reason prefix of ``_handle_failed_recv`` for an exception on the decode's
    #: side (ZMQ receive timeout, socket error): the prefill never answered
    LOCAL_FAILURE = "transfer failed:"

    def __init__(self, inner: Any, vllm_config: Any) -> None:
        super().__init__(inner, vllm_config)
        w = inner.connector_worker
        missing = [n for n in MOONCAKE_INTERNALS if not hasattr(w, n)]
        if missing:
            raise RuntimeError(
                "stallguard-vllm: this vLLM's Mooncake worker lacks "
                f"{', '.join(missing)}; the adapter supports vLLM {SUPPORTED_VLLM} "
                "(set STALLGUARD_VLLM=0 to run the plain connector)"
            )
        self.worker = w
        #: receives that ended without the prefill's answer (set from the receiver
        #: loop's thread; read here: set operations are atomic under the GIL)
        self.unanswered: set[str] = set()
        handle = w._handle_failed_recv
        unanswered = self.unanswered
        prefix = self.LOCAL_FAILURE

        def handle_failed_recv(pull_metas: Any, req_ids: Any, reason: str) -> None:
            if str(reason).startswith(prefix):
                unanswered.update(r for r in req_ids if r in pull_metas)
            handle(pull_metas, req_ids, reason)

        w._handle_failed_recv = handle_failed_recv

    def unproven(self, ended: set[str]) -> set[str]:
        if not self.unanswered:
            return set()
        out = ended & self.unanswered
        self.unanswered.difference_update(ended)
        return out

    def release_send(self, rid: str) -> bool:
        """Expire the prefill's hold through Mooncake's own reaper, only while no WRITE
        of it is in flight (``sending == 0``; checked again by the reaper)."""
        w = self.worker
        sender_loop = getattr(w, "sender_loop", None)
        if sender_loop is None:
            return True
        import asyncio

        async def expire() -> bool:
            for meta in list(w.reqs_need_send.values()):
                if meta.p_req_id == rid:
                    if meta.sending > 0:
                        return False  # a WRITE is running: not now
                    meta.expire_time = float("-inf")
                    return True
            return True  # not held (any more)

        return bool(asyncio.run_coroutine_threadsafe(expire(), sender_loop).result(timeout=30))


#: inner connector class (``module.QualName``, matched along its MRO) -> refinement
REFINEMENTS: dict[str, type[Refinement]] = {
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector.NixlPushConnector": (
        NixlPushRefinement
    ),
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector.NixlPullConnector": (
        NixlRefinement
    ),
    "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector."
    "MooncakeConnector": MooncakeRefinement,
}


def refinement_for(cls: type) -> type[Refinement]:
    """The refinement of an inner connector class (:class:`Refinement` if none)."""
    for c in cls.__mro__:
        found = REFINEMENTS.get(f"{c.__module__}.{c.__qualname__}")
        if found is not None:
            return found
    return Refinement


# ---------------------------------------------------------------------- the inner config


def _inner_vllm_config(vllm_config: Any) -> Any:
    out = copy.copy(vllm_config)
    out.kv_transfer_config = inner_transfer_config(vllm_config.kv_transfer_config)
    return out


# ---------------------------------------------------------------------- the guard

#: base-class methods passed to the inner connector unchanged
_DELEGATED = (
    "get_mem_pool_context",
    "register_kv_caches",
    "unregister_kv_caches",
    "restore_kv_caches",
    "set_host_xfer_buffer_ops",
    "finish_forward",
    "reset_capture_state",
    "handle_preemptions",
    "shutdown",
    "get_kv_connector_kv_cache_events",
    "get_handshake_metadata",
    "build_connector_worker_meta",
    "bind_kv_cache_manager",
    "bind_gpu_block_pool",
    "get_loaded_kv_cache_group_ids",
    "get_external_cache_hit_sources",
    "register_finished_partial_tail",
    "take_events",
    "has_pending_block_frees",
    "has_pending_push_work",
    "get_finished_count",
    "set_xfer_handshake_metadata",
    "set_xfer_handshake_metadata_pp_aware",
    "reset_cache",
)


def _delegate(name: str) -> Callable[..., Any]:
    def method(self: StallguardConnector, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._sg_inner, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"The inner connector's ``{name}``."
    return method


class StallguardConnector(KVConnectorBase_V1, SupportsHMA):
    """Any vLLM KV connector (``kv_connector_extra_config["inner"]``) with stallguard's
    per-phase deadlines. See the module docstring and docs/vllm.md.

    Attributes:
        stallguard: the scheduler side's tracker (None on workers or with mode off).
        refinement: the worker side's :class:`Refinement` (None on the scheduler).
        inner: the wrapped connector.
    """

    #: the inner connector class, if fixed (the NIXL connectors); else from the config
    _INNER: type | None = None

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        # a bad file or extra-config table stops the engine here, naming key and value
        config = config_or_raise(extra=vllm_config.kv_transfer_config.kv_connector_extra_config)
        super().__init__(vllm_config, role, kv_cache_config)
        inner_cls, inner_config = self._inner_class_and_config(vllm_config)
        if not issubclass(inner_cls, SupportsHMA) and len(kv_cache_config.kv_cache_groups) > 1:
            raise ConfigError(
                f"stallguard-vllm: the inner connector {inner_cls.__name__} does not support "
                f"vLLM's hybrid memory allocator, and this model has "
                f"{len(kv_cache_config.kv_cache_groups)} KV cache groups"
            )
        self._sg_inner: Any = inner_cls(inner_config, role, kv_cache_config)
        self.stallguard_config = config  # (a Config: mypy infers it)
        self.stallguard: PhaseTracker | None = None
        self.refinement: Refinement | None = None
        self._sg_ledger = FailLedger()
        self._sg_release: set[str] = set()
        #: scheduler side: each receive's blocks, sent to the workers with a fail order
        #: (block ids are unique in one KV cache group only: none kept with more)
        self._sg_recv_blocks: dict[str, tuple[int, ...]] | None = (
            {} if len(kv_cache_config.kv_cache_groups) == 1 else None
        )
        #: bytes of one block, over every layer (what a quarantined block holds)
        self._sg_block_bytes = _block_bytes(kv_cache_config)
        refinement = refinement_for(inner_cls)
        self._sg_transfer = refinement.name
        if config.mode == "off":
            log.info("stallguard-vllm: mode off (%s): plain %s", config.source, inner_cls.__name__)
            return
        if role == KVConnectorRole.SCHEDULER:
            self.stallguard = PhaseTracker(
                config,
                clock=_clock,
                attributes={
                    "vllm.engine_id": str(inner_config.kv_transfer_config.engine_id),
                    "vllm.kv_role": str(inner_config.kv_transfer_config.kv_role),
                    "vllm.kv_transfer_mode": refinement.name,
                    "vllm.kv_connector": inner_cls.__name__,
                },
                releases_sends=refinement.releases_sends,
            )
            _log_table(config, inner_config, refinement)
        else:
            self.refinement = refinement(self._sg_inner, inner_config)

    @classmethod
    def _inner_class_and_config(cls, vllm_config: Any) -> tuple[Any, Any]:
        if cls._INNER is not None:
            return cls._INNER, vllm_config
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        inner_config = _inner_vllm_config(vllm_config)
        return KVConnectorFactory.get_connector_class(inner_config.kv_transfer_config), inner_config

    @property
    def inner(self) -> Any:
        """The wrapped connector."""
        return self._sg_inner

    def __getattr__(self, name: str) -> Any:
        # anything else the inner connector has (connector_scheduler, engine_id, ...)
        if name.startswith("_sg_") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._sg_inner, name)

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return bool(self._sg_inner.supports_divergent_local_hybrid_hits)

    @property
    def requires_kv_delivery(self) -> bool:
        return bool(self._sg_inner.requires_kv_delivery)

    # ------------------------------------------------------------------ plain delegation
    # (the base class's abstract methods; the others are set below the class)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        result: tuple[int | None, bool] = self._sg_inner.get_num_new_matched_tokens(
            request, num_computed_tokens
        )
        return result

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._sg_inner.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._sg_inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self._sg_inner.wait_for_save()

    # ------------------------------------------------------------------ scheduler side

    def on_new_request(self, request: Request) -> None:
        self._sg_inner.on_new_request(request)
        sg = self.stallguard
        if sg is not None and _remote_peer(request.kv_transfer_params) is not None:
            sg.queued(request.request_id, trace_headers=_headers(request))

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        sg = self.stallguard
        # read before the inner connector's own update (NIXL's clears do_remote_prefill)
        peer = _remote_peer(request.kv_transfer_params) if sg is not None else None
        self._sg_inner.update_state_after_alloc(request, blocks, num_external_tokens)
        if sg is None or peer is None:
            return
        if num_external_tokens > 0:
            self._sg_receiving(sg, request, blocks, peer)
        else:
            sg.not_receiving(request.request_id)
            self._sg_forget_blocks(request.request_id)

    def _sg_receiving(
        self, sg: PhaseTracker, request: Request, blocks: KVCacheBlocks, peer: str
    ) -> None:
        """*request* receives its remote tokens from *peer* into *blocks*: tracked as
        receiving, with the blocks (and bytes) a late write could reach."""
        blocks_held = sum(len(ids) for ids in blocks.get_block_ids())
        if self._sg_recv_blocks is not None:
            # the blocks allocated for the remote tokens (a local prefix hit
            # shares its blocks with other requests: not those)
            self._sg_recv_blocks[request.request_id] = tuple(blocks.get_unhashed_block_ids())
        sg.receiving(
            request.request_id,
            trace_headers=_headers(request),
            peer=peer,
            blocks=blocks_held,
            nbytes=blocks_held * self._sg_block_bytes,
        )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        result: tuple[bool, dict[str, Any] | None] = self._sg_inner.request_finished(
            request, block_ids
        )
        self._sg_finished(request, result[0])
        return result

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        inner = self._sg_inner
        result: tuple[bool, dict[str, Any] | None]
        if isinstance(inner, SupportsHMA):
            result = inner.request_finished_all_groups(request, block_ids)
        else:  # what vLLM's scheduler does for a connector without HMA
            result = inner.request_finished(request, block_ids[0])
        self._sg_finished(request, result[0])
        return result

    def _sg_finished(self, request: Request, delay_free: bool) -> None:
        sg = self.stallguard
        if sg is None:
            return
        if delay_free:
            sg.held_for_read(request.request_id, trace_headers=_headers(request))
        else:
            sg.finished(request.request_id)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sg_inner.update_connector_output(connector_output)
        sg = self.stallguard
        if sg is not None:
            failed = connector_output.failed_recving or ()
            for rid in connector_output.finished_recving or ():
                sg.done(rid, failed=rid in failed)
                self._sg_forget_blocks(rid)
            for rid in connector_output.finished_sending or ():
                sg.done(rid)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        meta = self._sg_inner.build_connector_meta(scheduler_output)
        sg = self.stallguard
        if sg is not None:
            orders = sg.step()
            if orders:
                setattr(meta, FAIL_RECV_ATTR, orders.fail_recv)
                setattr(meta, FAIL_BLOCKS_ATTR, self._sg_take_blocks(orders.fail_recv))
                setattr(meta, RELEASE_SEND_ATTR, orders.release_send)
                for rid in sorted(orders.fail_recv):
                    log.warning(
                        "stallguard-vllm: failing request %s: its remote KV transfer "
                        "overstayed its deadline (kv_load_failure_policy decides the rest)",
                        rid,
                    )
                for rid in sorted(orders.release_send):
                    log.warning(
                        "stallguard-vllm: releasing prefill blocks of %s held for a "
                        "remote read past their deadline",
                        rid,
                    )
        return meta

    def _sg_take_blocks(self, rids: frozenset[str]) -> dict[str, tuple[int, ...]]:
        known = self._sg_recv_blocks
        if not known:
            return {}
        return {rid: known.pop(rid) for rid in rids if rid in known}

    def _sg_forget_blocks(self, rid: str) -> None:
        if self._sg_recv_blocks is not None:
            self._sg_recv_blocks.pop(rid, None)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        stats = self._sg_inner.get_kv_connector_stats()
        sg = self.stallguard
        if sg is None:
            return stats_with_counts(stats, None, inner_cls=type(self._sg_inner))
        return stats_with_counts(
            stats,
            sg.take_counts(),
            sg.take_quarantine(),
            sg.take_stays(),
            inner_cls=type(self._sg_inner),
        )

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return StallguardStats(data=data) if data is not None else StallguardStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        inner_cls, inner_config = cls._inner_class_and_config(vllm_config)
        inner = inner_cls.build_prom_metrics(
            inner_config, metric_types, labelnames, per_engine_labelvalues
        )
        return StallguardPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues, inner=inner
        )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        inner_cls, inner_config = cls._inner_class_and_config(vllm_config)
        layout: str | None = inner_cls.get_required_kvcache_layout(inner_config)
        return layout

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        if cls._INNER is not None:
            return bool(cls._INNER.requires_piecewise_for_cudagraph(extra_config))  # type: ignore[attr-defined]
        inner = extra_config.get(INNER_KEY)
        if not isinstance(inner, Mapping):
            return False
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        ktc = KVTransferConfig(**dict(inner))
        inner_cls = KVConnectorFactory.get_connector_class(ktc)
        return bool(
            inner_cls.requires_piecewise_for_cudagraph(inner.get("kv_connector_extra_config", {}))
        )

    # ------------------------------------------------------------------ worker side

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._sg_inner.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._sg_inner.clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._sg_inner.start_load_kv(forward_context, **kwargs)
        ref = self.refinement
        if ref is None:
            return
        meta = self._connector_metadata
        self._sg_ledger.order(
            getattr(meta, FAIL_RECV_ATTR, ()), getattr(meta, FAIL_BLOCKS_ATTR, None)
        )
        self._sg_release.update(getattr(meta, RELEASE_SEND_ATTR, ()))
        if self._sg_release:
            for rid in tuple(self._sg_release):
                if ref.release_send(rid):
                    self._sg_release.discard(rid)
        ref.on_step()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The inner connector's, and the blocks of the receives stallguard reported
        failed this step (vLLM's scheduler fails their requests at once: see the module
        docstring)."""
        errors: set[int] = set(self._sg_inner.get_block_ids_with_load_errors() or ())
        return errors | self._sg_ledger.take_load_errors()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results: KVConnectorTransferResults = self._sg_inner.get_transfer_results(finished_req_ids)
        ref = self.refinement
        if ref is None:
            return results
        ledger = self._sg_ledger
        if ledger.ordered:
            # failed, not finished: vLLM fails the request and keeps its blocks (its
            # finish path delays the free of a request still WAITING_FOR_REMOTE_KVS)
            # until a later step reports it in finished_recving. Reported in the same
            # step as its finish, failure still wins: the deadline passed, and the
            # blocks are freed by the finish. A receive whose blocks the scheduler sent
            # is reported by them (get_block_ids_with_load_errors, next), the others
            # here.
            results.failed_recving.update(ledger.due(ref.verdict))
        if ledger.failed and results.finished_recving:
            ended = set(results.finished_recving)
            results.finished_recving = ledger.ends(ended, ref.unproven(ended))
        elif results.finished_recving:
            ref.unproven(set(results.finished_recving))  # forget what ended
        return results


for _name in _DELEGATED:
    if _name not in StallguardConnector.__dict__:
        setattr(StallguardConnector, _name, _delegate(_name))


def _nixl_classes() -> tuple[type, type]:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
        NixlPullConnector,
        NixlPushConnector,
    )

    return NixlPullConnector, NixlPushConnector


class StallguardNixlConnector(StallguardConnector):
    """vLLM's ``NixlPullConnector`` (READ; vLLM's ``NixlConnector``) in the generic
    guard with the NIXL refinement. See the module docstring and docs/vllm.md."""

    _INNER = _nixl_classes()[0]


class StallguardNixlPushConnector(StallguardConnector):
    """vLLM's ``NixlPushConnector`` (WRITE) in the generic guard with the NIXL
    refinement."""

    _INNER = _nixl_classes()[1]


# ---------------------------------------------------------------------- helpers


def _block_bytes(kv_cache_config: KVCacheConfig) -> int:
    """Bytes one block holds over every layer (0 if the config does not say)."""
    total = 0
    try:
        for group in kv_cache_config.kv_cache_groups:
            total += int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names)
    except (AttributeError, TypeError, ValueError):
        return 0
    return total


def _remote_peer(params: Mapping[str, Any] | None) -> str | None:
    """The remote prefill's engine id if a request's ``kv_transfer_params`` (*params*)
    ask for its KV from a remote prefill (``do_remote_prefill``), else None."""
    if not params or not params.get("do_remote_prefill"):
        return None
    return str(params.get("remote_engine_id", ""))


def _headers(request: Request) -> Mapping[str, str] | None:
    headers = getattr(request, "trace_headers", None)
    return headers if isinstance(headers, Mapping) and headers else None


def _log_table(config: Config, vllm_config: Any, refinement: type[Refinement]) -> None:
    if refinement.name in _logged_table:
        return
    _logged_table.add(refinement.name)
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    rows = coverage_rows(config, lease=_lease(extra), modes=(refinement.name,))
    log.info(
        "stallguard-vllm active (config %s, mode %s, connector %s, refinement %s):\n%s",
        config.source,
        config.mode,
        vllm_config.kv_transfer_config.kv_connector,
        refinement.name,
        format_coverage(rows),
    )


def _lease(extra: Mapping[str, Any]) -> float | None:
    value = extra.get("kv_lease_duration")
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None
