"""Deadlines from what the machine measures at warm-up.

The demo's deadlines are seconds, so that a run takes seconds; a healthy request takes
tens of milliseconds on an idle machine. On a loaded one (a build on a 2-core laptop, a
test suite beside other work) the same healthy request can take a second or more, and a
1 s deadline then fails it: a *false positive*, not a detection. So each rig, once its
connections are warm and before the processes that read ``STALLGUARD_SGLANG_CONFIG``
start, sends a short stream of healthy requests at the demo's rate through the arm
without stallguard and measures

* the round trip of each (submitted -> released, on the shared monotonic clock; on the
  decode side every request is sent as two rooms, as the runs send one through each
  decode server, so that the prefills carry the runs' load), and
* the longest gap between two starts of the guarded loop (a scheduler loop pass, or a
  decode queue call), which bounds how late any deadline can be noticed;

and derives one scale factor for the profile's time constants:

    scale = max(1, RTT_HEADROOM * max round trip / shortest deadline,
                   GAP_HEADROOM * max loop gap / shortest deadline)

rounded up to a multiple of 0.5 and capped at :data:`MAX_SCALE`. Every deadline, the
fault window (which must outlast every deadline for an unguarded stall to show as
pinned), the traffic after the fault, the drain, the shadow's freeze and the advice's
floor are multiplied by it; the loop interval and the request rate are not. On an idle
2-core machine the scale is 1 and the demo runs the profile as written. The deadline-timing
checks (a forced failure comes from the first pass after *its* deadline) are made
against the derived deadlines, which is what the guarded processes were configured with.

A healthy request failed despite this is still a false positive: the report names it,
with its phase, its time there and the deadline (``RunResult.false_positives``).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable
from dataclasses import replace

from ._config import DECODE_PHASES, STATES, Profile

#: a deadline must be at least this many times the slowest healthy round trip measured
RTT_HEADROOM = 5.0
#: ... and this many times the longest gap between two passes of the guarded loop
GAP_HEADROOM = 4.0
#: the scale is capped here (a run then takes about MAX_SCALE times longer); beyond it the
#: demo says that the machine is too slow for its deadlines
MAX_SCALE = 8.0
#: seconds of healthy traffic the warm-up measurement takes, at the profile's rate
SECONDS = 1.5


def shortest_deadline(profile: Profile) -> float:
    values = [profile.deadlines[s] for s in STATES]
    values.append(profile.mooncake_waiting)
    for queue, phases in DECODE_PHASES.items():
        values += [profile.decode_deadline(queue, phase) for phase in phases]
    return min(values)


def pass_gaps(starts: Iterable[float]) -> list[float]:
    """Gaps between consecutive loop-pass starts (seconds)."""
    ordered = sorted(starts)
    return [b - a for a, b in itertools.pairwise(ordered)]


def _ceil_half(x: float) -> float:
    return math.ceil(x * 2 - 1e-9) / 2


def scale_for(profile: Profile, rtts: list[float], gaps: list[float]) -> tuple[float, float]:
    """The scale factor (see the module docstring) and the uncapped need behind it."""
    shortest = shortest_deadline(profile)
    need = max(
        RTT_HEADROOM * max(rtts, default=0.0) / shortest,
        GAP_HEADROOM * max(gaps, default=0.0) / shortest,
    )
    return min(MAX_SCALE, max(1.0, _ceil_half(need))), need


def scaled(profile: Profile, scale: float) -> Profile:
    """*profile* with every deadline and the time constants that must follow them
    multiplied by *scale* (rounded to 0.1 s)."""
    if scale == 1.0:
        return profile

    def s(x: float) -> float:
        return round(x * scale, 1)

    return replace(
        profile,
        window=s(profile.window),
        post=s(profile.post),
        drain=s(profile.drain),
        deadlines={k: s(v) for k, v in profile.deadlines.items()},
        mooncake_waiting=s(profile.mooncake_waiting),
        decode_deadlines={
            queue: {k: s(v) for k, v in phases.items()}
            for queue, phases in profile.decode_deadlines.items()
        },
        shadow_fault=s(profile.shadow_fault),
        advice_floor=s(profile.advice_floor),
    )


def derive(
    profile: Profile, rig: str, rtts: list[float], gaps: list[float], failed: int = 0
) -> tuple[Profile, dict]:
    """The derived profile and the record of the measurement behind it (printed, and
    saved with every run of the rig in results.json)."""
    scale, need = scale_for(profile, rtts, gaps)
    derived = scaled(profile, scale)
    ordered = sorted(rtts)

    def ms(x: float) -> float:
        return round(1000 * x, 1)

    record = {
        "rig": rig,
        "requests": len(rtts),
        "failed": failed,
        "rtt_ms": {
            "p50": ms(statistics.median(ordered)) if ordered else None,
            "p90": ms(ordered[int(0.9 * (len(ordered) - 1))]) if ordered else None,
            "max": ms(ordered[-1]) if ordered else None,
        },
        "max_pass_gap_ms": ms(max(gaps, default=0.0)),
        "rtt_headroom": RTT_HEADROOM,
        "gap_headroom": GAP_HEADROOM,
        "need": round(need, 2),
        "scale": scale,
        "capped": need > MAX_SCALE,
        "base_shortest_deadline": shortest_deadline(profile),
        "deadlines": dict(derived.deadlines),
        "mooncake_waiting": derived.mooncake_waiting,
        "decode_deadlines": {q: dict(v) for q, v in derived.decode_deadlines.items()},
        "window": derived.window,
        "drain": derived.drain,
    }
    return derived, record


def describe(record: dict) -> str:
    """One line for the demo's output."""
    rtt = record["rtt_ms"]
    text = (
        f"warm-up measurement: {record['requests']} healthy requests, round trip "
        f"p50/p90/max {rtt['p50']}/{rtt['p90']}/{rtt['max']} ms, longest loop gap "
        f"{record['max_pass_gap_ms']} ms -> deadlines x{record['scale']:g}"
    )
    if record["rig"] == "prefill":
        text += f" (prefill {record['deadlines']}, mooncake WaitingForInput "
        text += f"{record['mooncake_waiting']}s"
    else:
        text += f" (decode {record['decode_deadlines']}"
    text += f"; window {record['window']}s)"
    if record["failed"]:
        text += f"; {record['failed']} warm-up requests FAILED (not measured)"
    if record["capped"]:
        text += (
            f"; WARNING: this machine needs x{record['need']:g}, capped at x{MAX_SCALE:g}: "
            "expect healthy requests to be failed (false positives)"
        )
    return text
