"""The coverage table: per phase, what vLLM 0.33 bounds on its own and what stallguard adds.

Logged once per engine when a stallguard connector starts, and printed by
``python -m stallguard_vllm``. The native bounds are from vLLM 0.33.0's source
(file:line references in docs/vllm.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from stallguard.adapters import text_table

from ._config import Config

__all__ = ["CoverageRow", "coverage_rows", "format_coverage"]

#: vLLM's default ``kv_lease_duration`` (``kv_connector_extra_config``), seconds.
DEFAULT_LEASE = 30.0


@dataclass(frozen=True)
class CoverageRow:
    """One line of the table.

    Attributes:
        phase: stallguard's phase name (the config key).
        side: ``"decode"`` or ``"prefill"``.
        transfer: ``"pull"``, ``"push"`` (NIXL), ``"mooncake"``, ``"generic"`` (a
            connector stallguard has no refinement for) or ``"both"`` (every one).
        what: what the request waits for in this phase.
        native: vLLM's own bound, in words.
        stallguard: stallguard's deadline and action under this config.
    """

    phase: str
    side: str
    transfer: str
    what: str
    native: str
    stallguard: str


def _secs(value: float | None) -> str:
    return "none" if value is None else f"{value:g} s"


def coverage_rows(
    config: Config, *, lease: float | None = None, modes: Iterable[str] = ("pull", "push")
) -> list[CoverageRow]:
    """The table's rows for *config* (and the prefill's ``kv_lease_duration``, default
    30 s), for the transfer modes in *modes*."""
    lease_s = DEFAULT_LEASE if lease is None else lease
    wanted = set(modes)

    def action(deadline: float | None, how: str, *, report_only: bool = False) -> str:
        return _action(config.mode, deadline, how, report_only=report_only)

    fail = "load failure -> kv_load_failure_policy; blocks quarantined"
    rows = [
        CoverageRow(
            "Queued",
            "decode",
            "both",
            "allocation; keeps the prefill's lease alive",
            "none (an ordinary queue; heartbeats extend the prefill's lease)",
            action(config.queued, "", report_only=True),
        ),
        CoverageRow(
            "Receiving",
            "decode",
            "pull",
            "handshake, then the READ in flight",
            "handshake 5 s; READ in flight: none",
            action(config.receiving, fail),
        ),
        CoverageRow(
            "Receiving",
            "decode",
            "push",
            "registration, then P's WRITE + notification",
            "none (push_registration_timeout 480 s only drops P's registration)",
            action(config.receiving, fail),
        ),
        CoverageRow(
            "Receiving",
            "decode",
            "mooncake",
            "the prefill's WRITE and its answer to the pull",
            "ZMQ receive VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60 = 540 s",
            action(config.receiving, fail + " until the prefill answers"),
        ),
        CoverageRow(
            "Receiving",
            "decode",
            "generic",
            "the connector to end the load",
            "the connector's own",
            action(config.receiving, fail + " until the connector ends the load"),
        ),
        CoverageRow(
            "AbortedHeld",
            "decode",
            "both",
            "the transfer of an aborted request to end",
            "none (blocks held until finished_recving)",
            action(config.aborted_held, "blocks quarantined (still held)"),
        ),
        CoverageRow(
            "Quarantined",
            "decode",
            "both",
            "NIXL to report every transfer into a failed request's blocks over",
            "none (vLLM frees a failed request's blocks once its handles are released)",
            _quarantined(config),
        ),
        CoverageRow(
            "HeldForRead",
            "prefill",
            "both",
            "the transfer out (pull: D's READ; push: P's WRITE)",
            f"lease {lease_s:g} s, renewed by every decode heartbeat",
            action(
                config.held_for_read,
                "lease expired -> finished_sending, once the decode stopped heartbeating",
            ),
        ),
    ]
    return [r for r in rows if r.transfer == "both" or r.transfer in wanted]


def format_coverage(rows: Iterable[CoverageRow]) -> str:
    """The rows as an aligned text table."""
    head = ("phase", "side", "mode", "waits for", "vLLM 0.33 bound", "stallguard")
    return text_table(
        [head, *((r.phase, r.side, r.transfer, r.what, r.native, r.stallguard) for r in rows)]
    )


def _action(mode: str, deadline: float | None, how: str, *, report_only: bool = False) -> str:
    """What stallguard does about a phase of *deadline* in *mode*: *how* it acts (in
    enforce mode, unless the phase is *report_only*)."""
    if mode == "off" or deadline is None:
        return "not guarded"
    if mode == "report" or report_only:
        return f"{_secs(deadline)}, then reported (log, span, counter)"
    return f"{_secs(deadline)}, then {how}"


def _quarantined(config: Config) -> str:
    """What stallguard does about a quarantine past its deadline."""
    if config.mode == "off":
        return "not guarded"
    return (
        f"{_secs(config.quarantined)}, then escalated (ERROR, span, gauge); never freed on a timer"
    )
