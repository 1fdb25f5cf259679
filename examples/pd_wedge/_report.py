"""The outcome table (text and markdown), results.json, and the inflight-count picture."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path

from ._config import Profile
from ._driver import RunResult

COLUMNS = (
    ("engine", "engine"),
    ("scenario", "scenario"),
    ("arm", "stallguard"),
    ("sent", "sent"),
    ("completed", "completed"),
    ("failed_stallguard", "failed by stallguard"),
    ("failed_sglang", "failed by SGLang"),
    ("pinned", "pinned at obs."),
    ("left", "left at end"),
    ("healthy_failed", "healthy failed"),
    ("latency", "deadline->release ms (median/max)"),
)


#: the table's "stallguard" column
ARM_NAMES = {"without": "off", "with": "on", "report": "report", "advised": "advised"}


def _latency(r: RunResult) -> str:
    if not r.release_latency_ms:
        return "-"
    lat = r.release_latency_ms
    # (rounded to whole ms; a release measured a fraction of a ms before the deadline is
    # the clock-read slack between the worker's timestamps and the adapter's)
    text = f"{round(statistics.median(lat))}/{round(max(lat))}"
    if r.late_releases:
        text += f" ({r.late_releases} late)"
    return text


def rows(results: list[RunResult]) -> list[list[str]]:
    out = []
    for r in results:
        row = []
        for key, _ in COLUMNS:
            if key == "latency":
                row.append(_latency(r))
            elif key == "arm":
                row.append(ARM_NAMES.get(r.arm, r.arm))
            else:
                row.append(str(getattr(r, key)))
        out.append(row)
    return out


def text_table(results: list[RunResult]) -> str:
    header = [title for _, title in COLUMNS]
    body = rows(results)
    widths = [max([len(header[i]), *(len(row[i]) for row in body)]) for i in range(len(header))]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    sep = "  ".join("-" * w for w in widths)
    lines = [line, sep]
    for row in body:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    return "\n".join(lines)


def summary(results: list[RunResult]) -> str:
    """One paragraph under the table: how the forced failures met their deadlines."""
    forced = [r for r in results if r.release_latency_ms]
    n = sum(len(r.release_latency_ms) for r in forced)
    if not n:
        return "No request was failed by stallguard."
    late = sum(r.late_releases for r in forced)
    worst = max(max(r.release_latency_ms) for r in forced)
    gap = max(r.max_pass_gap_ms for r in results if r.arm in ("with", "advised"))
    loop = forced[0].loop_interval_ms
    first = "every one" if not late else f"{n - late} of them"
    return (
        f"{n} requests were failed by stallguard; {first} in the first scheduler loop pass "
        f"that started after its deadline (loop interval {loop:.0f} ms). The latest came "
        f"{worst:.0f} ms after its deadline; the longest gap between two loop passes in the "
        f'"with" runs was {gap:.0f} ms (a deadline that falls in such a gap is released by the '
        "pass that ends it)."
    )


def calibration_section(results: list[RunResult]) -> str:
    """What each rig measured at warm-up and the deadlines derived from it."""
    from ._calibrate import describe

    seen: dict[tuple[str, str], dict] = {}
    for r in results:
        if r.calibration:
            seen.setdefault((r.engine, r.side), r.calibration)
    if not seen:
        return ""
    lines = ["Deadlines derived from the warm-up measurement of each rig:"]
    for (engine, side), cal in seen.items():
        lines.append(f"- {engine}, {side} side: {describe(cal)}")
    return "\n".join(lines)


def false_positive_section(results: list[RunResult], limit: int = 10) -> str:
    """Every healthy request that was failed, named with its timing: a false positive to
    explain, never noise (the demo exits 1 on any)."""
    from ._driver import explain_false_positive

    runs = [r for r in results if r.false_positives]
    if not runs:
        return "False positives: none (no healthy request was failed)."
    total = sum(len(r.false_positives) for r in runs)
    lines = [
        f"FALSE POSITIVES: {total} healthy requests were failed (each below: the phase it "
        "was failed in, how long it had been there, and the deadline):"
    ]
    for r in runs:
        for fp in r.false_positives[:limit]:
            lines.append("- " + explain_false_positive(r, fp))
        if len(r.false_positives) > limit:
            lines.append(
                f"- ... and {len(r.false_positives) - limit} more in {r.engine}/{r.scenario} "
                f"({r.arm}); all of them in results.json, runs[].false_positives"
            )
    return "\n".join(lines)


def advice_section(results: list[RunResult], advice: dict[str, str], profile: Profile) -> str:
    """The advice section: per engine, what the shadow arm recorded, what `advise`
    printed, and what enforcing its suggestions did to the same fault."""
    if not advice:
        return ""
    parts = [
        "## Advice: shadow -> advise -> enforce",
        "",
        f"Shadow: a report-mode prefill took {profile.shadow:g} s of traffic with a "
        f"{profile.shadow_fault:g} s decode freeze; `python -m stallguard_sglang advise "
        f"--false-timeout-rate {profile.advice_rate:g} --floor {profile.advice_floor:g}` "
        "read its exported time in state and printed:",
    ]
    for engine, text in advice.items():
        parts += ["", f"### {engine}", "", "```", text.rstrip(), "```"]
        for r in results:
            if r.engine == engine and r.arm == "advised":
                dl = ", ".join(f"{k} {v:g}s" for k, v in r.deadlines.items())
                parts.append(
                    f"Enforcing it ({dl}) on the `freeze` fault: {r.sent} sent, "
                    f"{r.completed} completed, {r.failed_stallguard} failed by stallguard "
                    f"(deadline->release {_latency(r)} ms), {r.pinned} pinned at the "
                    f"observation point, {r.left} left at the end, {r.healthy_failed} healthy "
                    "failed."
                )
    return "\n".join(parts)


def markdown_table(results: list[RunResult]) -> str:
    header = [title for _, title in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows(results):
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def save_json(
    results: list[RunResult], profile: Profile, path: Path, thaw: list | None = None
) -> None:
    """Every run; ``profile`` is the one the demo was started with, ``calibrations`` what
    each rig measured at warm-up and the deadlines it derived (each run carries its own
    rig's as ``calibration``); ``thaw`` the thaw's rounds (``_thaw.ThawResult``, with
    their ``ok``)."""
    calibrations: dict[str, dict] = {}
    for r in results:
        if r.calibration:
            calibrations.setdefault(f"{r.engine}/{r.side}", r.calibration)
    data = {
        "profile": profile.as_dict(),
        "calibrations": calibrations,
        "runs": [asdict(r) for r in results],
        "thaw": [{**asdict(t), "ok": t.ok()} for t in thaw or ()],
    }
    path.write_text(json.dumps(data, indent=1, default=str))


def plot(results: list[RunResult], profile: Profile, path: Path) -> Path:
    """One panel per (scenario, engine): prefill inflight-queue length over time, both
    arms overlaid, aligned on the moment the fault took effect."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in results if r.arm in ("without", "with")]  # (not the advice's)
    engines = list(dict.fromkeys(r.engine for r in results))
    scenarios = list(dict.fromkeys(r.scenario for r in results))
    fig, axes = plt.subplots(
        len(scenarios),
        len(engines),
        figsize=(6.2 * len(engines), 2.9 * len(scenarios)),
        squeeze=False,
    )
    colors = {"without": "#c0392b", "with": "#1f77b4"}
    labels = {"without": "without stallguard", "with": "with stallguard"}
    for i, scenario in enumerate(scenarios):
        for j, engine in enumerate(engines):
            ax = axes[i][j]
            for r in results:
                if r.engine != engine or r.scenario != scenario:
                    continue
                zero = r.fault_start if r.fault_start is not None else r.t0
                xs = [s[1] - zero for s in r.samples]
                ys = [s[2] for s in r.samples]
                ax.step(xs, ys, where="post", color=colors[r.arm], lw=1.4, label=labels[r.arm])
                sg = [t - zero for t, kind in r.releases if kind == "stallguard"]
                if sg:
                    ax.plot(
                        sg,
                        [-0.6] * len(sg),
                        "|",
                        color=colors[r.arm],
                        ms=7,
                        label="released by stallguard",
                    )
                if r.arm == "without" and r.observed_at is not None:
                    obs = r.observed_at - zero
                    ax.axvspan(0, obs, color="0.9", zorder=0)
                    ax.axvline(obs, color="0.4", ls=":", lw=1)
            pinned = {
                r.arm: r.pinned for r in results if r.engine == engine and r.scenario == scenario
            }
            top = max(
                (
                    s[2]
                    for r in results
                    for s in r.samples
                    if r.engine == engine and r.scenario == scenario
                ),
                default=1,
            )
            ax.set_ylim(-1.5, top * 1.55 + 1)
            ax.text(
                0.01,
                0.97,
                "pinned at the observation point (dotted):\n"
                + "\n".join(f"{labels[arm]}: {n}" for arm, n in pinned.items()),
                transform=ax.transAxes,
                va="top",
                ha="left",
                fontsize=7,
                bbox={"facecolor": "white", "edgecolor": "0.8", "alpha": 0.9},
            )
            side = next(r.side for r in results if r.scenario == scenario)
            where = "prefill inflight queue" if side == "prefill" else "decode queues"
            ax.set_title(f"{engine}: {scenario} ({where} guarded)", fontsize=10)
            ax.set_xlabel("seconds since the fault took effect (grey: fault window)", fontsize=8)
            ax.set_ylabel(f"requests in {where}", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=7, loc="upper right")
    # the deadlines in force: the profile's, scaled by the rigs' warm-up measurements
    cal = {r.side: r.calibration for r in results if r.calibration}
    deadlines = cal["prefill"]["deadlines"] if "prefill" in cal else profile.deadlines
    decode = cal["decode"]["decode_deadlines"] if "decode" in cal else profile.decode_deadlines
    dl = ", ".join(f"{k} {v:g}s" for k, v in deadlines.items())
    ddl = "; ".join(
        f"{queue} " + ", ".join(f"{k} {v:g}s" for k, v in phases.items())
        for queue, phases in decode.items()
    )
    fig.suptitle(
        f"Prefill inflight queue under decode faults (deadlines: {dl});\ndecode queues "
        f"under prefill faults (deadlines: {ddl});\nscheduler loop "
        f"{profile.loop_interval * 1000:.0f} ms",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def thaw_section(thaw: list) -> str:
    """The thaw table (``_thaw.py``): per engine and arm, what the resumed prefill's late
    WRITE did to the next owner of the failed request's pages (markdown)."""
    if not thaw:
        return ""
    from ._thaw import RELEASE_TIMEOUT

    lines = [
        "## The thaw: a prefill frozen mid-WRITE, then resumed",
        "",
        "A 32 MiB room's WRITE frozen (SIGSTOP of the prefill) the moment its first bytes "
        "landed; the decode request failed; past SGLang's deferred-release timeout "
        f"({RELEASE_TIMEOUT:g} s here, SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_"
        "TIMEOUT; 30 s by default) the next request takes memory and writes its own "
        "pattern; SIGCONT; its bytes compared exactly once the prefill's WRITE settled.",
        "",
        "| engine | stallguard | landed before the freeze | failed after the freeze "
        "| failed request's pages | new owner's bytes overwritten after SIGCONT "
        "| late bytes in the quarantined pages | pages leaked |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in thaw:
        if r.problems:
            lines.append(
                f"| {r.engine} | {ARM_NAMES.get(r.arm, r.arm)} | PROBLEM: "
                f"{'; '.join(r.problems)[:300]} | | | | | |"
            )
            continue
        if r.held_ms is not None:
            pages = (
                f"quarantined ({r.quarantined_pages}), held {r.held_ms:.0f} ms, freed "
                f"{r.freed_after_thaw_ms:.0f} ms after SIGCONT (drain ACK)"
            )
        elif r.freed_before_thaw:
            pages = (
                f"freed {r.freed_after_failure_s:g} s after the failure "
                '("releasing anyway"), given to the new owner'
            )
        else:
            pages = "held, never freed"
        late = f"{r.late_in_quarantine:,}" if r.arm == "with" else "-"
        lines.append(
            f"| {r.engine} | {ARM_NAMES.get(r.arm, r.arm)} | {r.landed_before_freeze:,} of "
            f"{r.write_bytes:,} | {r.failed_after_s:g} s | {pages} | **{r.overwritten:,}** of "
            f"{r.owner_bytes:,} | {late} | {r.leaked_pages} |"
        )
    warm = [f"{r.engine}/{r.arm}: {len(r.warm_failed)}" for r in thaw if r.warm_failed]
    if warm:
        lines += [
            "",
            "Warm-up rooms failed by their deadline before a round (a first room on a new "
            "connection pays for its set-up) and sent again: " + ", ".join(warm),
        ]
    return "\n".join(lines)
