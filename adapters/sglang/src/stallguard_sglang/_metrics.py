"""Prometheus counters that show up on SGLang's own ``/metrics``.

SGLang serves ``/metrics`` from the HTTP process with prometheus_client's
``MultiProcessCollector`` over ``PROMETHEUS_MULTIPROC_DIR`` (``add_prometheus_middleware``
in ``sglang/srt/utils/common.py``); scheduler processes write their metrics into that
directory. prometheus_client picks its storage (per-process files or in-memory) **once,
when it is first imported**, from that environment variable. So this module imports it
lazily, from inside a scheduler's queue loop (never from ``register()``, which also runs
in the launcher process before SGLang sets the directory): importing it too early there
would silently drop SGLang's own tokenizer metrics from ``/metrics``.

Without metrics enabled (no ``PROMETHEUS_MULTIPROC_DIR``) the counters live in the
process's default registry, unseen and harmless.

The counts are the core's (``StateStatistics.forced`` / ``.reported``: each expiry once,
less those withdrawn), added by each lane's exporter (``_stats_export``); this module
names the counters.

Labels: ``queue``, ``backend``, ``state`` and ``reason`` (the adapter's own; ``reason``
is which limit fired: ``state`` for a state deadline, ``stall`` for a progress window,
``lifetime`` for a lifetime, as on the expiry's span), then the labels SGLang's
own scheduler metrics carry in that process (``SchedulerMetricsCollector``'s ``labels``:
``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank``, and
``dp_rank`` / ``priority`` / ``--extra-metric-labels`` when SGLang adds them), with the
same values, so the counters join with ``sglang:num_running_reqs`` and the others.
Without SGLang's collector (metrics off) they are derived from SGLang's runtime context as
SGLang derives them; a value that cannot be found is the empty string, which Prometheus
treats as an absent label.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "FORCED_FAILURES",
    "LABELS",
    "QUARANTINED_BYTES",
    "QUARANTINED_OVERDUE",
    "QUARANTINED_PAGES",
    "QUARANTINE_LABELS",
    "STALLS_REPORTED",
    "failure_counters",
    "prepare",
    "scheduler_labels",
    "set_quarantined",
    "sglang_label_names",
]

log = logging.getLogger("stallguard.sglang")

#: Requests stallguard failed (enforce mode). Exposed as ``..._total``.
FORCED_FAILURES = "sglang:stallguard_forced_failures"
#: Requests stallguard found overdue in report mode (nothing failed).
STALLS_REPORTED = "sglang:stallguard_stalls_reported"
#: The adapter's own label names (first); SGLang's scheduler labels follow.
LABELS = ("queue", "backend", "state", "reason")
#: Decode pages of requests stallguard failed, held in quarantine (not freed) because
#: the prefill has not proven its writes into them over; per prefill peer.
QUARANTINED_PAGES = "sglang:stallguard_quarantined_pages"
#: The same holds in bytes (pages times the bytes a page spans over every KV buffer).
QUARANTINED_BYTES = "sglang:stallguard_quarantined_bytes"
#: Holds older than ``[decode] quarantine`` (escalated: logged at ERROR, still held).
QUARANTINED_OVERDUE = "sglang:stallguard_quarantined_overdue_holds"
#: The quarantine gauges' own label names (first); SGLang's scheduler labels follow.
QUARANTINE_LABELS = ("backend", "peer")

_lock = threading.Lock()
_counters: dict[str, Any] | None = None
_gauges: dict[str, Any] | None = None
_failed = False
#: SGLang's label names the counters were created with (fixed at creation)
_sglang_names: tuple[str, ...] = ()


def _create(sglang_names: tuple[str, ...] = ()) -> dict[str, Any] | None:
    global _counters, _failed, _sglang_names
    with _lock:
        if _counters is not None or _failed:
            return _counters
        try:
            from prometheus_client import Counter
        except ImportError:  # SGLang depends on it; a bare test environment may not
            _failed = True
            return None
        names = LABELS + sglang_names
        try:
            _counters = {
                "forced": Counter(
                    FORCED_FAILURES,
                    "Prefill KV-sender requests stallguard failed for overstaying a "
                    "per-state deadline.",
                    labelnames=names,
                ),
                "reported": Counter(
                    STALLS_REPORTED,
                    "Prefill KV-sender requests overdue in stallguard report mode "
                    "(logged and traced, not failed).",
                    labelnames=names,
                ),
            }
        except ValueError:  # already registered under that name by someone else
            log.exception("stallguard-sglang: could not create its Prometheus counters")
            _failed = True
        else:
            _sglang_names = sglang_names
        return _counters


def prepare(sglang_labels: Mapping[str, str]) -> dict[str, str]:
    """Create the counters now (call from a scheduler process, where
    ``PROMETHEUS_MULTIPROC_DIR`` is already set when SGLang runs with metrics), labelled
    with the names of *sglang_labels* after :data:`LABELS` (names that clash with the
    adapter's own are left out). The first call fixes the label names for the process.

    Returns:
        The SGLang labels to pass to :func:`count`: exactly the counters' names.
    """
    names = tuple(k for k in sglang_labels if k not in LABELS)
    _create(names)
    return {name: str(sglang_labels.get(name, "")) for name in _sglang_names}


def failure_counters() -> dict[str, Any] | None:
    """The two counters (``"forced"``, ``"reported"``), created if not yet (None when
    they cannot be): what a lane's ``StatisticsExporter`` adds the core's counts of
    expiries to (``_stats_export.LaneStats``)."""
    return _counters if _counters is not None else _create()


def sglang_label_names() -> tuple[str, ...]:
    """SGLang's label names the adapter's metrics carry after their own (fixed for the
    process by the first :func:`prepare`; empty before it or without SGLang labels)."""
    return _sglang_names


def scheduler_labels(sched: Any, tp_rank: int | None) -> dict[str, str]:
    """The labels SGLang's scheduler metrics carry in this process: those of
    *sched*'s ``metrics_collector`` when SGLang runs with metrics (the only case where
    the counters are scraped), else derived from SGLang's runtime context the way
    ``SchedulerMetricsCollector.init_new`` derives them, each value that cannot be read
    left empty (attribute reads only)."""
    collector_labels = getattr(getattr(sched, "metrics_collector", None), "labels", None)
    if isinstance(collector_labels, Mapping) and collector_labels:
        return {str(k): "" if v is None else str(v) for k, v in collector_labels.items()}
    ctx = _runtime_context()
    server_args = getattr(sched, "server_args", None)
    parallel = _attempt(lambda: ctx.get_parallel())
    labels: dict[str, Any] = {
        "model_name": _model_name(ctx, server_args),
        "engine_type": _engine_type(_disaggregation_mode(ctx, server_args)),
        "tp_rank": tp_rank,
        **_ranks(parallel, getattr(sched, "ps", None)),
    }
    return {k: _label_value(v) for k, v in labels.items()}


def _label_value(value: Any) -> str:
    """A label value derived from the runtime context as text: empty for one that could
    not be read (None) or is not a value (a mapping)."""
    return "" if value is None or isinstance(value, Mapping) else str(value)


def _model_name(ctx: Any, server_args: Any) -> Any:
    """The served model's name: the runtime context's, else the server arguments'."""
    served = _attempt(lambda: ctx.get_serving().served_model_name)
    return served or getattr(server_args, "served_model_name", None)


def _engine_type(mode: str) -> str:
    """The ``engine_type`` label of disaggregation *mode*, as SGLang's collector sets it."""
    return mode if mode in ("prefill", "decode") else "unified"


def _runtime_context() -> Any:
    """SGLang's ``runtime_context`` module (None in SGLang without one: 0.5.17)."""
    try:
        from sglang.srt import runtime_context as ctx  # type: ignore[import-untyped]
    except ImportError:
        return None
    return ctx


def _disaggregation_mode(ctx: Any, server_args: Any) -> str:
    """The disaggregation mode: the runtime context's, else the server arguments'."""
    mode = _attempt(lambda: ctx.get_disagg().disaggregation_mode)
    if mode is None:
        mode = getattr(server_args, "disaggregation_mode", None)
    return str(getattr(mode, "value", mode))


def _attempt(get: Callable[[], Any]) -> Any:
    """``get()``, or None if it raises (a value not published in this process)."""
    try:
        return get()
    except Exception:
        return None


def _ranks(parallel: Any, ps: Any) -> dict[str, Any]:
    """The ``pp_rank``, ``moe_ep_rank`` and (when published) ``dp_rank`` labels, from
    the runtime context's *parallel* state (SGLang 0.5.17: ``pp_rank`` from the
    scheduler's *ps*)."""
    ranks = {
        "pp_rank": _pp_rank(parallel, ps),
        "moe_ep_rank": _rank(parallel, "moe_ep_rank"),
    }
    dp_rank = _rank(parallel, "dp_rank")
    if dp_rank is not None:
        ranks["dp_rank"] = dp_rank
    return ranks


def _pp_rank(parallel: Any, ps: Any) -> Any:
    """The ``pp_rank`` label: the runtime context's, else (0.5.17) the scheduler's."""
    pp_rank = _rank(parallel, "pp_rank")
    on_scheduler = getattr(ps, "pp_rank", None)
    if pp_rank is None and isinstance(on_scheduler, int):
        return on_scheduler  # 0.5.17 keeps it on the scheduler
    return pp_rank


def _rank(parallel: Any, name: str) -> Any:
    return None if parallel is None else _attempt(lambda: getattr(parallel, name))


def _create_gauges() -> dict[str, Any] | None:
    global _gauges
    if _create(_sglang_names) is None:  # fixes the SGLang label names, once
        return None
    with _lock:
        if _gauges is not None:
            return _gauges
        try:
            from prometheus_client import Gauge

            names = QUARANTINE_LABELS + _sglang_names
            # multiprocess: one series per live scheduler process (labels differ by rank)
            _gauges = {
                what: Gauge(name, doc, labelnames=names, multiprocess_mode="livesum")
                for what, name, doc in (
                    (
                        "pages",
                        QUARANTINED_PAGES,
                        "Decode KV pages of requests stallguard failed, held (not freed) "
                        "until the prefill proves its writes into them over.",
                    ),
                    (
                        "bytes",
                        QUARANTINED_BYTES,
                        "Bytes of decode KV pages held in stallguard's quarantine.",
                    ),
                    (
                        "overdue",
                        QUARANTINED_OVERDUE,
                        "Quarantined holds older than [decode] quarantine (escalated, "
                        "still held: see docs/sglang.md for what to do).",
                    ),
                )
            }
        except Exception:
            log.exception("stallguard-sglang: could not create its quarantine gauges")
            _gauges = {}
        return _gauges


def _quarantine_gauges() -> dict[str, Any] | None:
    """The three quarantine gauges by what they count, created on first use (None or
    empty when they cannot be)."""
    return _gauges if _gauges is not None else _create_gauges()


def set_quarantined(
    backend: str,
    by_peer: Mapping[str, tuple[int, int, int]],
    sglang_labels: Mapping[str, str],
) -> None:
    """Set the quarantine gauges of *backend*: ``peer -> (pages, bytes, overdue holds)``
    (a peer whose holds were all released is passed with zeros)."""
    gauges = _quarantine_gauges()
    if not gauges:
        return
    try:
        extra = {name: sglang_labels.get(name, "") for name in _sglang_names}
        for peer, values in by_peer.items():
            for what, value in zip(("pages", "bytes", "overdue"), values, strict=True):
                gauges[what].labels(backend=backend, peer=peer, **extra).set(value)
    except Exception:  # a metrics problem must never break the scheduler loop
        log.exception("stallguard-sglang: could not set the quarantine gauges")
