"""Run profiles (quick / default / full), the scenarios, and the stallguard-sglang file.

The "with stallguard" arm differs from the "without" arm by one thing only: its prefill
process is launched with ``STALLGUARD_SGLANG_CONFIG`` naming the TOML file written by
:func:`write_stallguard_config`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ENGINES = ("nixl", "mooncake")

#: scenario name -> what it does to decode A (decode B always stays healthy).
SCENARIOS = {
    "freeze": "decode frozen mid-transfer (SIGSTOP, every thread stopped, then prefill "
    "queues the KV write of a room to it; SIGCONT at the end of the fault window)",
    "kill": "decode killed during bootstrap (SIGKILL after receiver.init, before it sent "
    "its destination; the router keeps sending it requests for the fault window)",
    "mute": "a decode that never answers the bootstrap (alive, accepts requests, never "
    "creates their receivers: a stuck prealloc queue)",
    "aborts": "abort storm racing transfer completion (clients abort about half the "
    "requests, on prefill in the same or the next loop iteration after the KV send, and "
    "on decode a few ms after the request)",
}

#: scenario name -> what it does to prefill A (the decode-side faults: the decode
#: servers are the guarded side; prefill B always stays healthy).
DECODE_SCENARIOS = {
    "prefill-freeze": "prefill scheduler frozen before registration (SIGSTOP as the next "
    "request arrives, before its KV sender registers the room with the bootstrap server, "
    "which stays up; SIGCONT at the end of the fault window)",
    "prefill-freeze-sent": "prefill frozen after send_metadata (SIGSTOP once decode "
    "metadata has arrived for a room of each decode server, before their KV is sent)",
    "prefill-freeze-write": "the thaw: prefill frozen mid-WRITE (a 32 MiB room; SIGSTOP "
    "the moment its first bytes land on decode), the decode request failed, its pages' "
    "next owner written, SIGCONT: the new owner's bytes compared exactly (_thaw.py)",
}
#: the decode-side scenarios run by _thaw.py (processes of their own), not by DecodeRun
THAW_SCENARIOS = ("prefill-freeze-write",)
ALL_SCENARIOS = (*SCENARIOS, *DECODE_SCENARIOS)

#: Decode phases per queue, keyed for ``[decode.prealloc]`` / ``[decode.transfer]``.
DECODE_PHASES = {
    "prealloc": ("Bootstrapping", "WaitingForPrefill", "WaitingForInput"),
    "transfer": ("WaitingForInput", "Transferring"),
}

#: Deadlines in seconds per KVPoll state, keyed for ``[prefill.deadlines]``.
STATES = ("Bootstrapping", "WaitingForInput", "Transferring")


@dataclass(frozen=True)
class Profile:
    """How long and how heavy one run is (one scenario x one arm x one engine).

    Attributes:
        rate: requests per second sent to prefill (split between decodes A and B).
        pre: seconds of normal traffic before the fault.
        window: seconds from the moment the fault took effect to the observation point.
            Longer than every deadline, so an unguarded stall is visibly pinned there.
        post: seconds of traffic after the fault was lifted.
        drain: at most this long to let the queues empty before the end-of-run count.
        loop_interval: the prefill scheduler's loop period (one inflight-queue pass each).
        deadlines: stallguard-sglang ``[prefill.deadlines]``.
        mooncake_waiting: stallguard-sglang ``[prefill.backends.mooncake.deadlines]
            WaitingForInput`` (Mooncake has no Transferring state; its WaitingForInput is
            "transfer pending").
        max_turn_tokens: prompt size cap (KV pages per request; 1 page = 4 KiB here).
        mooncake_timeout: Mooncake's own stall bound (MC_TRANSFER_TIMEOUT), kept above
            every deadline so the transport does not end a freeze before stallguard would.
        decode_deadlines: stallguard-sglang ``[decode.prealloc]`` and
            ``[decode.transfer]``, per phase.
        shadow: the advice section: seconds of traffic on the report-mode ("shadow")
            prefill before its fault (a decode freeze of ``shadow_fault`` seconds).
        advice_rate: the false-timeout rate given to ``stallguard_sglang advise``
            (``--false-timeout-rate``; it needs ``10 / rate`` recorded stays per state).
        advice_floor: ``advise --floor``: the shortest deadline it suggests.
    """

    name: str
    rate: float
    pre: float
    window: float
    post: float
    drain: float
    loop_interval: float
    deadlines: dict[str, float] = field(default_factory=dict)
    mooncake_waiting: float = 1.5
    max_turn_tokens: int = 32
    mooncake_timeout: float = 30.0
    decode_deadlines: dict[str, dict[str, float]] = field(default_factory=dict)
    shadow: float = 10.0
    shadow_fault: float = 1.0
    advice_rate: float = 0.05
    advice_floor: float = 1.0

    def decode_deadline(self, queue: str, phase: str) -> float:
        return self.decode_deadlines[queue][phase]

    def deadline(self, engine: str, state: str) -> float:
        if engine == "mooncake" and state == "WaitingForInput":
            return self.mooncake_waiting
        return self.deadlines[state]

    def as_dict(self) -> dict:
        return asdict(self)


QUICK = Profile(
    name="quick",
    rate=30.0,
    pre=0.5,
    window=2.2,
    post=0.4,
    drain=0.8,
    loop_interval=0.04,
    deadlines={"Bootstrapping": 1.2, "WaitingForInput": 1.0, "Transferring": 1.0},
    mooncake_waiting=1.2,
    max_turn_tokens=16,
    decode_deadlines={
        "prealloc": {"Bootstrapping": 1.2, "WaitingForPrefill": 1.0, "WaitingForInput": 1.0},
        "transfer": {"WaitingForInput": 1.0, "Transferring": 1.0},
    },
)
DEFAULT = replace(
    QUICK,
    name="default",
    shadow=15.0,
    pre=0.8,
    window=2.6,
    post=0.8,
    drain=1.0,
    deadlines={"Bootstrapping": 1.5, "WaitingForInput": 1.0, "Transferring": 1.0},
    mooncake_waiting=1.5,
    max_turn_tokens=32,
    decode_deadlines={
        "prealloc": {"Bootstrapping": 1.5, "WaitingForPrefill": 1.0, "WaitingForInput": 1.0},
        "transfer": {"WaitingForInput": 1.0, "Transferring": 1.0},
    },
)
FULL = replace(
    DEFAULT,
    name="full",
    shadow=30.0,
    shadow_fault=2.0,
    advice_rate=0.01,
    rate=80.0,
    pre=4.0,
    window=6.0,
    post=4.0,
    drain=2.0,
    deadlines={"Bootstrapping": 3.0, "WaitingForInput": 2.0, "Transferring": 2.0},
    mooncake_waiting=3.0,
    max_turn_tokens=128,
    decode_deadlines={
        "prealloc": {"Bootstrapping": 3.0, "WaitingForPrefill": 2.0, "WaitingForInput": 2.0},
        "transfer": {"WaitingForInput": 2.0, "Transferring": 2.0},
    },
)
PROFILES = {p.name: p for p in (QUICK, DEFAULT, FULL)}


def prefill_lines(profile: Profile, mode: str, comment: str) -> list[str]:
    """A stallguard-sglang ``[prefill]`` section with *profile*'s deadlines."""
    return [
        f"# stallguard-sglang configuration of the pd_wedge demo's {comment}.",
        "[prefill]",
        f'mode = "{mode}"',
        "",
        "[prefill.deadlines]",
        *(f"{state} = {profile.deadlines[state]}" for state in STATES),
        "",
        "[prefill.backends.mooncake.deadlines]",
        f"WaitingForInput = {profile.mooncake_waiting}",
        "",
    ]


def write_stallguard_config(profile: Profile, path: Path) -> Path:
    """The stallguard-sglang configuration of the "with" arm: its prefill server (the
    prefill-side faults) and its decode server (the decode-side faults) read the same
    file, each side using its own sections."""
    lines = [*prefill_lines(profile, "enforce", '"with stallguard" arm'), "[decode]"]
    lines.append('mode = "enforce"')
    for queue, phases in DECODE_PHASES.items():
        lines += ["", f"[decode.{queue}]"]
        lines += [f"{phase} = {profile.decode_deadline(queue, phase)}" for phase in phases]
    lines.append("")
    path.write_text("\n".join(lines))
    return path


def write_report_config(profile: Profile, path: Path) -> Path:
    """The stallguard-sglang configuration of the advice section's shadow arm: report
    mode (nothing is failed; time in state is recorded and exported, and the stays that
    would have overrun the demo's deadlines are counted)."""
    path.write_text("\n".join(prefill_lines(profile, "report", "shadow (report-mode) arm")))
    return path
