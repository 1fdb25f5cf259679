"""A stub serving engine with two phases (``Loading`` -> ``Generating`` -> ``Done``),
standing in for a real engine (SGLang's scheduler, vLLM's connector) in the third
adapter sketch: it keeps requests, calls a phase hook on every change, and can fail a
request. A request can be made to hang in a phase (the fault stallguard exists for)."""

from __future__ import annotations

from collections.abc import Callable


class ToyEngine:
    def __init__(self) -> None:
        self.phase: dict[str, str] = {}
        self.failed: dict[str, str] = {}
        self.hooks: list[Callable[[str, str], None]] = []
        self.hang: dict[str, str] = {}

    def on_phase(self, hook: Callable[[str, str], None]) -> None:
        self.hooks.append(hook)

    def _set(self, rid: str, phase: str) -> None:
        self.phase[rid] = phase
        for hook in self.hooks:
            hook(rid, phase)

    def submit(self, rid: str, *, hang_in: str | None = None) -> None:
        if hang_in is not None:
            self.hang[rid] = hang_in
        self._set(rid, "Loading")

    def advance(self) -> None:
        """One engine step: each request not hanging moves to its next phase."""
        for rid, phase in list(self.phase.items()):
            if phase in ("Done", "Failed") or self.hang.get(rid) == phase:
                continue
            self._set(rid, "Generating" if phase == "Loading" else "Done")

    def fail(self, rid: str, reason: str) -> None:
        self.failed[rid] = reason
        self._set(rid, "Failed")
