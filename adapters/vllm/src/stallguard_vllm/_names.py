"""stallguard-vllm's Prometheus metric names (pure Python: the advise command reads them
without importing vLLM; ``_metrics.py`` creates the metrics)."""

from __future__ import annotations

__all__ = [
    "DEADLINE",
    "FORCED_FAILURES",
    "OLDEST_AGE",
    "QUARANTINED_BLOCKS",
    "QUARANTINED_BYTES",
    "QUARANTINE_OVERDUE",
    "STALLS_REPORTED",
    "STATE_SECONDS",
]

#: Counter name (``_total`` is appended by prometheus_client).
FORCED_FAILURES = "vllm:stallguard_forced_failures"
#: Counter name (``_total`` is appended by prometheus_client).
STALLS_REPORTED = "vllm:stallguard_stalls_reported"
#: Gauge names: quarantined blocks and bytes, and overdue holds, per peer.
QUARANTINED_BLOCKS = "vllm:stallguard_quarantined_blocks"
QUARANTINED_BYTES = "vllm:stallguard_quarantined_bytes"
QUARANTINE_OVERDUE = "vllm:stallguard_quarantine_overdue"
#: Time in state (histogram), the phase deadline and the oldest request's age (gauges).
STATE_SECONDS = "vllm:stallguard_state_seconds"
DEADLINE = "vllm:stallguard_deadline_seconds"
OLDEST_AGE = "vllm:stallguard_oldest_age_seconds"
