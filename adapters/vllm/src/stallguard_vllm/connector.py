"""The stallguard NIXL connectors: vLLM's NIXL connectors with per-phase deadlines.

Select one in the KV-transfer config, the way any vLLM connector is selected::

    --kv-transfer-config '{"kv_connector": "StallguardNixlConnector",
                           "kv_connector_module_path": "stallguard_vllm.connector", ...}'

(``StallguardNixlPushConnector`` for push mode; with the plugin installed the module
path may be left out: the ``vllm.general_plugins`` entry point registers both names.)

They are vLLM's own ``NixlPullConnector`` / ``NixlPushConnector`` plus:

* **scheduler side** (one per engine core): every phase change of a disaggregated
  request is observed where vLLM makes it (``on_new_request``,
  ``update_state_after_alloc``, ``request_finished``, ``update_connector_output``), and
  ``build_connector_meta``, which vLLM calls once per scheduler step, runs the deadline
  check; the requests found overdue ride to the workers on the step's connector metadata
  (two extra attributes).
* **worker side**: the worker reports each overdue receive in ``failed_recving`` in
  the same step, which vLLM's ``kv_load_failure_policy`` turns into ``FINISHED_ERROR``
  (the client gets an error response). Its in-flight NIXL handles are **not**
  released: releasing a handle does not stop its transfer (a frozen prefill that wakes
  up completes the READ into the same addresses), so the request is not reported in
  ``finished_recving`` and vLLM keeps its blocks, as it does for an aborted request,
  until its own poll finds every handle ``DONE`` or ``ERR``. Until then the blocks are
  quarantined (:attr:`PhaseTracker.quarantine`). Push mode the same: the blocks stay
  registered for the prefill's WRITE until its completion notification. Overdue
  prefill holds go through vLLM's lease-expiry path (reported in ``finished_sending``,
  blocks freed) once the decode has stopped heartbeating for them.

So nothing is scheduled by stallguard: a dict write per phase change, one clock read per
step, and the failure path is vLLM's. The private attributes of vLLM's workers used here
are listed in :data:`VLLM_INTERNALS` and checked at construction.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlPullConnector,
    NixlPushConnector,
)

from ._config import Config, config_or_raise
from ._coverage import DEFAULT_LEASE, coverage_rows, format_coverage
from ._metrics import StallguardNixlPromMetrics, StallguardNixlStats, stats_with_counts
from ._phases import PhaseTracker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
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
    "FAIL_RECV_ATTR",
    "RELEASE_SEND_ATTR",
    "VLLM_INTERNALS",
    "StallguardNixlConnector",
    "StallguardNixlPushConnector",
    "set_clock",
]

log = logging.getLogger("stallguard.vllm")

#: Attribute of the step's ``NixlConnectorMetadata``: decode requests to fail.
FAIL_RECV_ATTR = "stallguard_fail_recv"
#: Attribute of the step's ``NixlConnectorMetadata``: prefill holds to release.
RELEASE_SEND_ATTR = "stallguard_release_send"
#: The private names of vLLM's NIXL worker the failure path uses (checked at start).
VLLM_INTERNALS = (
    "_recving_transfers",
    "_recving_metadata",
    "_reqs_to_send",
    "xfer_stats",
)

_logged_table = False
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


class _Stallguard:
    """What both stallguard connectors add to vLLM's NIXL connector (a mixin: put it
    before the vLLM class)."""

    # Set by vLLM's connector classes (declared for the type checker).
    connector_scheduler: Any
    connector_worker: Any
    engine_id: str
    kv_transfer_config: Any
    _connector_metadata: Any
    _TRANSFER_MODE: str = "pull"

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        config = config_or_raise()  # a bad file stops the engine here, naming key and value
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[call-arg]
        self.stallguard_config: Config = config
        #: the scheduler side's tracker (None on workers or with mode "off").
        self.stallguard: PhaseTracker | None = None
        self._sg_fail: set[str] = set()
        self._sg_release: set[str] = set()
        #: receives failed this step: reported in the next ``failed_recving``
        self._sg_failed_now: set[str] = set()
        #: bytes of one block, over every layer (what a quarantined block holds)
        self._sg_block_bytes = _block_bytes(kv_cache_config)
        #: prefill: rid -> when its decode last heartbeated (perf_counter)
        self._sg_heartbeats: dict[str, float] = {}
        self._sg_silence = DEFAULT_LEASE / 3
        if config.mode == "off":
            log.info("stallguard-vllm: mode off (%s): plain NIXL connector", config.source)
            return
        if role == KVConnectorRole.SCHEDULER:
            self.stallguard = PhaseTracker(
                config,
                clock=_clock,
                attributes={
                    "vllm.engine_id": str(self.engine_id),
                    "vllm.kv_role": str(self.kv_transfer_config.kv_role),
                    "vllm.kv_transfer_mode": self._TRANSFER_MODE,
                },
            )
            _log_table(config, vllm_config, self._TRANSFER_MODE)
        else:
            missing = [n for n in VLLM_INTERNALS if not hasattr(self.connector_worker, n)]
            if missing:
                raise RuntimeError(
                    "stallguard-vllm: this vLLM's NIXL worker lacks "
                    f"{', '.join(missing)}; the adapter supports vLLM 0.33 "
                    "(set STALLGUARD_VLLM=0 to run the plain connector)"
                )
            # a decode that heartbeated within two of its heartbeat intervals (vLLM
            # sends one every lease/6) is alive and may be reading a held block
            lease = _lease(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
            self._sg_silence = (DEFAULT_LEASE if lease is None else lease) / 3
            self._sg_watch_heartbeats()

    # ------------------------------------------------------------------ scheduler side

    def on_new_request(self, request: Request) -> None:
        super().on_new_request(request)  # type: ignore[misc]
        sg = self.stallguard
        if sg is not None:
            params = request.kv_transfer_params
            if params and params.get("do_remote_prefill"):
                sg.queued(request.request_id, trace_headers=_headers(request))

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        sg = self.stallguard
        params = request.kv_transfer_params
        remote = sg is not None and bool(params) and bool(params.get("do_remote_prefill"))
        super().update_state_after_alloc(request, blocks, num_external_tokens)  # type: ignore[misc]
        if remote:
            assert sg is not None
            if num_external_tokens > 0:
                blocks_held = sum(len(ids) for ids in blocks.get_block_ids())
                sg.receiving(
                    request.request_id,
                    trace_headers=_headers(request),
                    peer=str(params.get("remote_engine_id", "")) if params else "",
                    blocks=blocks_held,
                    nbytes=blocks_held * self._sg_block_bytes,
                )
            else:
                sg.not_receiving(request.request_id)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        result: tuple[bool, dict[str, Any] | None] = super().request_finished(  # type: ignore[misc]
            request, block_ids
        )
        self._sg_finished(request, result[0])
        return result

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        result: tuple[bool, dict[str, Any] | None] = super().request_finished_all_groups(  # type: ignore[misc]
            request, block_ids
        )
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
        super().update_connector_output(connector_output)  # type: ignore[misc]
        sg = self.stallguard
        if sg is not None:
            failed = connector_output.failed_recving or ()
            for rid in connector_output.finished_recving or ():
                sg.done(rid, failed=rid in failed)
            for rid in connector_output.finished_sending or ():
                sg.done(rid)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        meta = super().build_connector_meta(scheduler_output)  # type: ignore[misc]
        sg = self.stallguard
        if sg is not None:
            orders = sg.step()
            if orders:
                setattr(meta, FAIL_RECV_ATTR, orders.fail_recv)
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

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        stats = super().get_kv_connector_stats()  # type: ignore[misc]
        sg = self.stallguard
        if sg is None:
            return stats_with_counts(stats, None)
        return stats_with_counts(stats, sg.take_counts(), sg.take_quarantine(), sg.take_stays())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return StallguardNixlStats(data=data) if data is not None else StallguardNixlStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return StallguardNixlPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    # ------------------------------------------------------------------ worker side

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)  # type: ignore[misc]
        meta = self._connector_metadata
        self._sg_fail.update(getattr(meta, FAIL_RECV_ATTR, ()))
        self._sg_release.update(getattr(meta, RELEASE_SEND_ATTR, ()))
        if self._sg_fail:
            self._sg_fail_receives()
        if self._sg_release:
            self._sg_release_sends()
        seen = self._sg_heartbeats
        if len(seen) > 64 and len(seen) > 2 * len(self.connector_worker._reqs_to_send):
            held = self.connector_worker._reqs_to_send
            for rid in [r for r in seen if r not in held]:
                del seen[rid]

    def _sg_fail_receives(self) -> None:
        """Report each ordered receive failed (the client's error, this step) without
        releasing anything a transfer may still write: vLLM frees the blocks when its
        own poll reports every handle of the request ``DONE`` or ``ERR``
        (``finished_recving``). One still in its handshake (pull: no READ posted yet)
        waits for it to end (vLLM bounds it at 5 s)."""
        w = self.connector_worker
        for rid in tuple(self._sg_fail):
            handles = w._recving_transfers.get(rid)
            if handles:
                # count the failed transfer once (vLLM's nixl_num_failed_transfers)
                w.xfer_stats.record_failed_transfer()
                self._sg_failed_now.add(rid)
            elif handles is not None:
                pass  # push: the completion notification just arrived; let it succeed
            elif rid in w._recving_metadata:
                if self._TRANSFER_MODE == "pull":
                    continue  # handshake pending: no READ issued yet
                # push: the prefill may still WRITE into the registered blocks; its
                # completion notification ends the hold
                w.xfer_stats.record_failed_transfer()
                self._sg_failed_now.add(rid)
            self._sg_fail.discard(rid)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results: KVConnectorTransferResults = super().get_transfer_results(  # type: ignore[misc]
            finished_req_ids
        )
        if self._sg_failed_now:
            # failed, not finished: vLLM fails the request and keeps its blocks (its
            # finish path delays the free of a request still WAITING_FOR_REMOTE_KVS)
            # until a later step reports it in finished_recving. Reported in the same
            # step as its finish (the READ just completed), failure still wins: the
            # deadline passed, and the blocks are freed by the finish.
            results.failed_recving.update(self._sg_failed_now)
            self._sg_failed_now.clear()
        return results

    def _sg_release_sends(self) -> None:
        """Release ordered prefill holds through vLLM's lease-expiry path, once the
        decode has gone silent for them: a decode that heartbeats for a request may be
        reading its blocks right now, and freeing them under a READ would hand this
        request's decode another request's KV. A hold whose decode still heartbeats
        stays ordered (checked every step); vLLM's own lease then decides."""
        w = self.connector_worker
        now = time.perf_counter()
        for rid in tuple(self._sg_release):
            if rid in w._reqs_to_send:
                last = self._sg_heartbeats.get(rid)
                if last is not None and now - last < self._sg_silence:
                    continue  # the decode is alive and may be reading: keep
                w._reqs_to_send[rid] = float("-inf")  # expired: reaped this step
            self._sg_release.discard(rid)
            self._sg_heartbeats.pop(rid, None)

    def _sg_watch_heartbeats(self) -> None:
        """Record when the decode last heartbeated for each held request (vLLM's
        worker extends the lease in ``_handle_heartbeat``; stallguard wraps it)."""
        w = self.connector_worker
        handle = getattr(w, "_handle_heartbeat", None)
        if handle is None:
            return
        seen = self._sg_heartbeats

        def handle_heartbeat(payload: str) -> None:
            handle(payload)
            now = time.perf_counter()
            for rid in payload.split(","):
                if rid in w._reqs_to_send:
                    seen[rid] = now

        w._handle_heartbeat = handle_heartbeat


class StallguardNixlConnector(_Stallguard, NixlPullConnector):
    """vLLM's ``NixlPullConnector`` (READ; vLLM's ``NixlConnector``) with stallguard's
    per-phase deadlines. See the module docstring and docs/vllm.md."""

    _TRANSFER_MODE = "pull"


class StallguardNixlPushConnector(_Stallguard, NixlPushConnector):
    """vLLM's ``NixlPushConnector`` (WRITE) with stallguard's per-phase deadlines."""

    _TRANSFER_MODE = "push"


def _block_bytes(kv_cache_config: KVCacheConfig) -> int:
    """Bytes one block holds over every layer (0 if the config does not say)."""
    total = 0
    try:
        for group in kv_cache_config.kv_cache_groups:
            total += int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names)
    except (AttributeError, TypeError, ValueError):
        return 0
    return total


def _headers(request: Request) -> Mapping[str, str] | None:
    headers = getattr(request, "trace_headers", None)
    return headers if isinstance(headers, Mapping) and headers else None


def _log_table(config: Config, vllm_config: VllmConfig, mode: str) -> None:
    global _logged_table
    if _logged_table:
        return
    _logged_table = True
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    rows = coverage_rows(config, lease=_lease(extra), modes=(mode,))
    log.info(
        "stallguard-vllm active (config %s, mode %s, NIXL %s):\n%s",
        config.source,
        config.mode,
        mode,
        format_coverage(rows),
    )


def _lease(extra: Mapping[str, Any]) -> float | None:
    value = extra.get("kv_lease_duration")
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None
