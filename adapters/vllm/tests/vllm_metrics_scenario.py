"""Real stallguard-vllm expositions for the Prometheus rules test
(tests/test_prometheus_rules.py), run in .venv-vllm:

    python vllm_metrics_scenario.py OUT.json

The adapter's scheduler-side tracker (``PhaseTracker``, what the connector calls at each
of vLLM's phase changes) on a FakeClock moved 0.5 s per scheduler step: healthy
transfers (half of the decodes aborted while receiving: ``AbortedHeld`` until their
READ ends), one decode request whose READ never ends (failed in ``Receiving``, its blocks
quarantined until overdue), one prefill whose blocks are never read (released from
``HeldForRead``), one request stuck ``Queued`` (reported). Each step's stats travel the
way vLLM ships them (``stats_with_counts`` -> the stats' ``data`` dict ->
``StallguardNixlPromMetrics.observe``, vLLM's NIXL Prometheus class underneath, the
labels vLLM's stat logger passes), into prometheus_client's default registry; the
exposition after each of two rounds goes to OUT.json. What is not here is a vLLM engine
(tests/test_vllm_real.py runs those: they need minutes and a model).
"""

from __future__ import annotations

import json
import random
import sys
from types import SimpleNamespace
from typing import Any

STEP = 0.5
LABELS = {"model_name": "tiny", "engine": "0"}
DEADLINES = {
    "queued": 5.0,
    "receiving": 10.0,
    "aborted_held": 10.0,
    "held_for_read": 20.0,
    "quarantined": 8.0,
}
BLOCK_BYTES = 8192


def _round(tracker: Any, prom: Any, clock: Any, n: int, tag: str, seed: int) -> None:
    from stallguard_vllm._metrics import stats_with_counts

    rng = random.Random(seed)
    start = clock()
    # rid -> (event time, action) for healthy requests; decode and prefill sides
    events: list[tuple[float, str, str]] = []
    for i in range(n):
        at = start + (i // 4) * STEP
        rid = f"{tag}-d{i}"
        events.append((at, "queued", rid))
        events.append((at + rng.choice((0.5, 1.0)), "receiving", rid))
        events.append((at + 1.0 + rng.uniform(0.5, 4.0), "done", rid))
        if i % 2:  # aborted while receiving: AbortedHeld until its transfer ends
            events.append((at + 1.2, "finished", rid))
        prid = f"{tag}-p{i}"
        events.append((at, "held_for_read", prid))
        events.append((at + rng.uniform(0.5, 6.0), "done", prid))
    events += [
        (start + 1.0, "queued", f"{tag}-stuck-recv"),
        (start + 1.5, "receiving", f"{tag}-stuck-recv"),  # its READ never ends
        (start + 1.0, "held_for_read", f"{tag}-never-read"),  # never read
        (start + 2.0, "queued", f"{tag}-stuck-queued"),  # never allocated
    ]
    events.sort(key=lambda e: e[0])
    ends = events[-1][0] + 30
    while clock() < ends:
        while events and events[0][0] <= clock():
            _, action, rid = events.pop(0)
            if action == "receiving":
                tracker.receiving(rid, peer="P", blocks=4, nbytes=4 * BLOCK_BYTES)
            else:
                getattr(tracker, action)(rid)
        tracker.step()
        stats = stats_with_counts(
            None, tracker.take_counts(), tracker.take_quarantine(), tracker.take_stays()
        )
        if stats is not None:
            prom.observe(dict(stats.data), 0)
        clock.advance(STEP)


def expositions(n: int = 40) -> dict[str, Any]:
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest
    from stallguard_vllm._config import Config
    from stallguard_vllm._metrics import StallguardNixlPromMetrics
    from stallguard_vllm._phases import PhaseTracker

    from stallguard.testing import FakeClock

    clock = FakeClock(1000.0)
    tracker = PhaseTracker(Config(mode="enforce", **DEADLINES), clock=clock)
    prom = StallguardNixlPromMetrics(
        SimpleNamespace(kv_transfer_config=None),  # NixlPromMetrics reads only this
        {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
        list(LABELS),
        {0: list(LABELS.values())},
    )
    texts = []
    for i in range(2):
        _round(tracker, prom, clock, n, f"round{i}", seed=11 + i)
        texts.append(generate_latest(REGISTRY).decode())
    return {
        "labels": LABELS,
        "deadlines": DEADLINES,
        "texts": texts,
        "counts": {f"{k}/{p}": v for (k, p), v in tracker.counts.items()},
    }


if __name__ == "__main__":
    with open(sys.argv[1], "w") as f:
        json.dump(expositions(), f)
