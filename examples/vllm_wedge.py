"""The vLLM half of the demo: a decode pinned by a frozen prefill on vLLM 0.33's NIXL
connector (pull and push) and on its Mooncake connector, without stallguard and with
stallguard-vllm.

    .venv/bin/python -m examples.vllm_wedge [--out DIR]

Runs, side by side under ``.venv-vllm`` (built by ``python3 tools/dev.py env``), the
scenarios the test suite asserts on: ``adapters/vllm/tests/vllm_scenarios.py`` (NIXL
pull and push: real NIXL agents over UCX/TCP on loopback) and
``adapters/vllm/tests/mooncake_scenarios.py`` (vLLM's ``MooncakeConnector`` over the
real Mooncake transfer engine's TCP transport, guarded by ``StallguardConnector``
wrapping it). vLLM's real schedulers and connectors, prefill engines in child processes
frozen with SIGSTOP, and decode engines stepped side by side: one with vLLM's plain
connector, one with stallguard's, and a control that fails the request the way a
backstop that frees memory does (the stallguard-vllm of before quarantine).
stallguard's clock is simulated, one second per engine step (the freeze, the transfers
and the connectors are real).

Then the **thaw**: every block the allocator could hand out is given to a new owner
(written with a known value), the frozen prefill resumes, and its late READ / WRITE
lands: in the control, in the new owner's blocks; with stallguard, in the failed
request's quarantined blocks, which are freed once the transport proves the transfer
over (NIXL reports it done; Mooncake's prefill answers the pull).

Prints a table, writes ``vllm_wedge.png`` (the decode clients over time, and the thaw),
``vllm_results.json`` and ``vllm_results.md`` to ``--out`` (one log per run:
``vllm_nixl.log``, ``vllm_mooncake.log``). Exit status 0 when stallguard failed every
pinned request in the first step past its deadline, the plain connectors kept them
pinned, a healthy request held up by the freeze finished normally, the thaw changed 0
bytes of a new owner with stallguard (and some in the control), and nothing stayed
held; 1 otherwise; 2 if ``.venv-vllm`` is missing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "adapters" / "vllm" / "tests"
PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
#: run name -> (script in SCENARIOS, its scenarios); the runs go side by side
RUNS = {
    "nixl": ("vllm_scenarios.py", "pull,push"),
    "mooncake": ("mooncake_scenarios.py", "mooncake"),
}
TIMEOUT_S = 600
CONFIG = """
[decode]
Receiving = 10       # handshake + READ in flight (pull) / WRITE + notification (push)
AbortedHeld = 4      # an aborted request's blocks, held for its transfer
Quarantined = 8      # a failed request's blocks held this long is escalated (never freed)
[prefill]
HeldForRead = 6
"""


def run(out_dir: Path) -> dict[str, Any]:
    """Run every one of RUNS at once (each mostly waits: on its prefill child, on the
    transfers) and return their scenarios' results, merged (also ``vllm_results.json``).

    Raises:
        RuntimeError: a run failed (its traceback, or its log's name).
    """
    config = out_dir / "stallguard-vllm.toml"
    config.write_text(CONFIG)
    sys.path.insert(0, str(SCENARIOS))
    from vllm_scenarios import read_result, subprocess_env  # (standard library only)

    env = subprocess_env()
    procs = {}
    for name, (script, which) in RUNS.items():
        result = out_dir / f"vllm_{name}.json"
        result.unlink(missing_ok=True)
        with open(out_dir / f"vllm_{name}.log", "w") as log:
            cmd = [str(PYTHON), str(SCENARIOS / script), which, str(config), str(result)]
            proc = subprocess.Popen(cmd, cwd=SCENARIOS, env=env, stdout=log, stderr=log)
        procs[name] = (proc, result)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for proc, _ in procs.values():
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    merged: dict[str, Any] = {}
    for name, (proc, result) in procs.items():
        log = f"see {out_dir / f'vllm_{name}.log'}"
        try:
            merged.update(read_result(result, proc.returncode, log))
        except RuntimeError as e:
            raise RuntimeError(f"the {name} run {e}") from None
    (out_dir / "vllm_results.json").write_text(json.dumps(merged, default=str))
    return merged


def _first(trace: list[dict[str, Any]], key: str, value: str) -> float | None:
    return next((r["t"] for r in trace if r[key] == value), None)


def _mooncake_rows(mc: dict[str, Any]) -> tuple[list[tuple[str, ...]], bool]:
    """The Mooncake connector's rows of the table, and whether they show what the demo
    claims (pinned without stallguard, failed at the deadline with it, once)."""
    end = mc["trace"][-1]
    failed = _first(mc["trace"], "f-sg", "FINISHED_ERROR")
    holds = {h["key"]: h for h in mc["quarantine_before_thaw"]["holds"]}
    told = [o["finish"] for o in mc["outputs_before_thaw"].get("f-sg", [])]
    rows = [
        (
            "mooncake: pull from a frozen prefill",
            "without",
            end["f-plain"],
            str(end["held_plain"]),
            "nothing" if "f-plain" not in mc["outputs_before_thaw"] else "an answer",
        ),
        (
            "",
            "with",
            f"FINISHED_ERROR at t={failed:g} s" if failed is not None else end["f-sg"],
            f"{sum(h['units'] for h in holds.values())} (quarantined)",
            "error response" if told == ["ERROR"] else f"{told}",
        ),
        (
            "mooncake: aborted while pulling",
            "without",
            "held" if end["a-plain_held"] else "released",
            "(included above)",
            "-",
        ),
        (
            "",
            "with",
            "held, quarantined" if end["a-sg_held"] and "a-sg" in holds else "released",
            "(included above)",
            "-",
        ),
    ]
    ok = (
        end["f-plain"] == "WAITING_FOR_REMOTE_KVS"
        and end["held_plain"] > 0
        and failed == 1 + mc["deadline"]
        and told == ["ERROR"]
        and [o["finish"] for o in mc["outputs"]["f-sg"]] == ["ERROR"]  # once, ever
    )
    return rows, ok


def table(res: dict[str, Any]) -> tuple[str, bool]:
    pull, push, mc = res["pull"], res["push"], res["mooncake"]
    d = pull["deadline"]
    f = pull["freeze"]["trace"]
    p = push["trace"]
    end_f, end_p = f[-1], p[-1]
    fail_f = _first(f, "f-sg", "FINISHED_ERROR")
    fail_p = _first(p, "x-sg", "FINISHED_ERROR")
    mooncake_rows, mooncake_ok = _mooncake_rows(mc)
    rows = [
        (
            "pull: READ to a frozen prefill",
            "without",
            end_f["f-plain"],
            end_f["held_plain"],
            "nothing",
        ),
        (
            "",
            "with",
            f"FINISHED_ERROR at t={fail_f:g} s",
            f"{end_f['held_sg']} (quarantined)",
            "error response",
        ),
        (
            "pull: aborted while reading",
            "without",
            "held" if end_f["a-plain"] else "released",
            "(included above)",
            "-",
        ),
        ("", "with", "held, quarantined", "(included above)", "-"),
        ("push: WRITE never arrives", "without", end_p["x-plain"], end_p["held_plain"], "nothing"),
        (
            "",
            "with",
            f"FINISHED_ERROR at t={fail_p:g} s",
            f"{end_p['held_sg']} (quarantined)",
            "error response",
        ),
        *mooncake_rows,
    ]
    lines = [
        f"vLLM 0.33.0: NIXL over UCX/TCP, and the Mooncake connector over the Mooncake "
        f"transfer engine's TCP transport (StallguardConnector wrapping it); Receiving "
        f"deadline {d:g} s, AbortedHeld {pull['aborted_held_deadline']:g} s; state after "
        f"{end_f['t']:g} s (3 x the deadline)",
        "",
        "| scenario | stallguard | decode request | decode blocks held at the end | client saw |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {e} | {g} |" for a, b, c, e, g in rows]
    slow = pull["slow"]
    healthy = mc["after_thaw"]["healthy"]
    lines += [
        "",
        f"healthy READ held up {slow['received_after']:g} s (> half the deadline) by a short "
        f"freeze: {slow['status']}, never failed",
        f"mooncake: healthy pull held up {mc['trace'][-1]['t'] - mc['healthy_added']:g} s "
        f"(0.6 x the deadline) by the frozen prefill: {healthy['status']}, "
        + ("never failed" if "ERROR" not in healthy["finishes"] else "FAILED"),
        "",
        "Thaw: every free block given to a new owner, then the frozen prefill resumes",
        "",
        "| transfer | failure | new owners' bytes overwritten | late bytes in the failed "
        "request's blocks | freed after thaw |",
        "|---|---|---|---|---|",
    ]
    thaw_ok = True
    for name, r in (("pull (READ)", pull), ("push (WRITE)", push), ("mooncake (WRITE)", mc)):
        after = r["after_thaw"]
        for arm, label in (("unsafe", "frees at once (control)"), ("guarded", "stallguard")):
            a = after[arm]
            freed = a["released_after_thaw_s"]
            lines.append(
                f"| {name} | {label} | {a['new_owner_bytes_changed']:,} of "
                f"{a['new_owner_bytes']:,} | "
                + (
                    f"{a['late_bytes_in_held_blocks']:,} of {a['held_bytes']:,}"
                    if a["held_bytes"]
                    else "- (freed)"
                )
                + " | "
                + (
                    "at the failure"
                    if arm == "unsafe"
                    else f"{1000 * freed:.0f} ms"
                    if freed
                    else "never"
                )
                + " |"
            )
        guarded, unsafe = after["guarded"], after["unsafe"]
        thaw_ok &= (
            guarded["new_owner_bytes_changed"] == 0
            and unsafe["new_owner_bytes_changed"] > 0
            and guarded["late_bytes_in_held_blocks"] > 0
            and not guarded["still_held"]
            and after["held_sg"] == 0
            and after["quarantine"]["holds"] == 0
        )
    lines.append("")
    for name, r in (("pull", pull), ("mooncake", mc)):
        q = r["after_thaw"]["quarantine"]
        lines.append(
            f"quarantine ({name}): {sum(q['released'].values())} holds released "
            f"({', '.join(q['released'])}), {q['escalated']} escalated past Quarantined "
            "while the prefill was frozen (held, never freed)"
        )
    ok = (
        end_f["f-plain"] == "WAITING_FOR_REMOTE_KVS"
        and end_p["x-plain"] == "WAITING_FOR_REMOTE_KVS"
        and fail_f == 1 + d
        and fail_p == 1 + d
        and slow["status"] == "FINISHED_LENGTH_CAPPED"
        and mooncake_ok
        and healthy["status"] == "FINISHED_LENGTH_CAPPED"
        and "ERROR" not in healthy["finishes"]
        and thaw_ok
    )
    return "\n".join(lines), ok


def picture(res: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.4))
    waiting = "WAITING_FOR_REMOTE_KVS"
    for ax, (title, trace, plain, sg) in zip(
        axes[:3],
        (
            ("pull: frozen prefill mid-READ", res["pull"]["freeze"]["trace"], "f-plain", "f-sg"),
            ("push: WRITE + notification never come", res["push"]["trace"], "x-plain", "x-sg"),
            ("mooncake: frozen prefill, pull pending", res["mooncake"]["trace"], "f-plain", "f-sg"),
        ),
        strict=True,
    ):
        t = [r["t"] for r in trace]
        ax.step(t, [int(r[plain] == waiting) for r in trace], where="post", label="vLLM as shipped")
        ax.step(
            t,
            [int(r[sg] == waiting) for r in trace],
            where="post",
            ls="--",
            label="with stallguard-vllm",
        )
        ax.axvline(1 + res["pull"]["deadline"], color="grey", ls=":", lw=1)
        ax.set_ylim(-0.1, 1.3)
        ax.set_yticks([0, 1], ["answered", "pinned, no answer"])
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("seconds (stallguard's clock; one engine step per second)")
    axes[0].legend(fontsize=8, loc="center right")
    ax = axes[3]
    labels, control, guarded = [], [], []
    for name in ("pull", "push", "mooncake"):
        after = res[name]["after_thaw"]
        labels.append(name)
        control.append(after["unsafe"]["new_owner_bytes_changed"])
        guarded.append(after["guarded"]["new_owner_bytes_changed"])
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], control, width=0.4, label="failure frees at once (control)")
    ax.bar([i + 0.2 for i in x], guarded, width=0.4, label="stallguard (quarantine)")
    for i, v in enumerate(guarded):
        ax.text(i + 0.2, max(control) * 0.02, f"{v} B", ha="center", fontsize=8)
    ax.set_ylim(0, max([*control, 1]) * 1.45)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("new owners' bytes overwritten")
    ax.set_title("after the thaw: the late transfer lands where?", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.vllm_wedge", description=__doc__)
    parser.add_argument("--out", default="pd_wedge_out", help="output directory")
    args = parser.parse_args(argv)
    if not PYTHON.exists():
        print(f"{PYTHON} is missing: run python3 tools/dev.py env", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()  # the scenarios run in their own directory
    out.mkdir(parents=True, exist_ok=True)
    res = run(out)
    text, ok = table(res)
    print(text)
    (out / "vllm_results.md").write_text(text + "\n")
    if picture(res, out / "vllm_wedge.png"):
        print(f"picture: {out / 'vllm_wedge.png'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
