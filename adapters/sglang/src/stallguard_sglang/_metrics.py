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
"""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["FORCED_FAILURES", "LABELS", "STALLS_REPORTED", "count"]

log = logging.getLogger("stallguard.sglang")

#: Requests stallguard failed (enforce mode). Exposed as ``..._total``.
FORCED_FAILURES = "sglang:stallguard_forced_failures"
#: Requests stallguard found overdue in report mode (nothing failed).
STALLS_REPORTED = "sglang:stallguard_stalls_reported"
#: Label names of both counters.
LABELS = ("queue", "backend", "state", "tp_rank")

_lock = threading.Lock()
_counters: dict[str, Any] | None = None
_failed = False


def _create() -> dict[str, Any] | None:
    global _counters, _failed
    with _lock:
        if _counters is not None or _failed:
            return _counters
        try:
            from prometheus_client import Counter
        except ImportError:  # SGLang depends on it; a bare test environment may not
            _failed = True
            return None
        try:
            _counters = {
                "forced": Counter(
                    FORCED_FAILURES,
                    "Prefill KV-sender requests stallguard failed for overstaying a "
                    "per-state deadline.",
                    labelnames=LABELS,
                ),
                "reported": Counter(
                    STALLS_REPORTED,
                    "Prefill KV-sender requests overdue in stallguard report mode "
                    "(logged and traced, not failed).",
                    labelnames=LABELS,
                ),
            }
        except ValueError:  # already registered under that name by someone else
            log.exception("stallguard-sglang: could not create its Prometheus counters")
            _failed = True
        return _counters


def prepare() -> None:
    """Create the counters now (call from a scheduler process, where
    ``PROMETHEUS_MULTIPROC_DIR`` is already set when SGLang runs with metrics)."""
    _create()


def count(kind: str, queue: str, backend: str, state: str, tp_rank: object) -> None:
    """Add one to the ``kind`` (``"forced"`` or ``"reported"``) counter."""
    counters = _counters if _counters is not None else _create()
    if counters is None:
        return
    try:
        counters[kind].labels(queue, backend, state, str(tp_rank)).inc()
    except Exception:  # a metrics problem must never break the scheduler loop
        log.exception("stallguard-sglang: could not count a %s expiry", kind)
