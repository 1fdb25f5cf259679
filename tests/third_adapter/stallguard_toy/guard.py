"""The adapter proper: the engine's phase-change hook feeds a watchdog, the engine's
step loop checks it and fails what overstayed; time in state goes to Prometheus."""

from __future__ import annotations

from typing import Any, Protocol

from stallguard import Spec, Watchdog
from stallguard.adapters import StatisticsExporter, histogram_buckets

from ._config import PHASES, TERMINAL, Config


class Engine(Protocol):
    """What the adapter needs from the engine."""

    def on_phase(self, hook: Any) -> None: ...
    def fail(self, rid: str, reason: str) -> None: ...


class ToyGuard:
    """Guards one engine: ``step()`` from its loop."""

    def __init__(self, engine: Engine, config: Config, *, clock: Any, registry: Any = None) -> None:
        spec = Spec(name="toy", deadlines=dict(config.deadlines), terminal=list(TERMINAL))
        assert set(spec.deadlines) == set(PHASES)
        self.engine = engine
        self.mode = config.mode
        self.watchdog: Watchdog[str] = Watchdog(
            spec, clock=clock, mode=config.mode, statistics=True
        )
        engine.on_phase(self.watchdog.observe)
        self.exporter: StatisticsExporter | None = None
        if registry is not None:
            from prometheus_client import Histogram

            histogram = Histogram(
                "toy_stallguard_state_seconds",
                "Seconds a Toy request stayed in a phase.",
                labelnames=("engine", "state"),
                buckets=histogram_buckets(),
                registry=registry,
            )
            self.exporter = StatisticsExporter(histogram, labels={"engine": "toy0"})

    def step(self) -> list[str]:
        """Check; fail (enforce mode) what overstayed; export. Returns the keys failed."""
        failed = []
        for expiry in self.watchdog.check():
            if self.mode == "enforce":
                self.engine.fail(expiry.key, f"stallguard: {expiry.state} overstayed")
                failed.append(expiry.key)
        if self.exporter is not None:
            self.exporter.export(self.watchdog.statistics())
        return failed
