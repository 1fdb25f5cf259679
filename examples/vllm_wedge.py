"""The vLLM half of the demo: a decode pinned by a frozen prefill on vLLM 0.33's NIXL
connector, without stallguard and with stallguard-vllm.

    .venv/bin/python -m examples.vllm_wedge [--out DIR]

Runs ``adapters/vllm/tests/vllm_scenarios.py`` (pull and push) under ``.venv-vllm`` (built
by ``python3 tools/dev.py env``): vLLM's real schedulers and NIXL connectors, real NIXL
agents over UCX/TCP on loopback, prefill engines in a child process frozen with SIGSTOP,
and decode engines stepped side by side: one with vLLM's plain connector, one with
stallguard's, and a control that fails the request the way a backstop that frees memory
does (the stallguard-vllm of before quarantine). stallguard's clock is simulated, one
second per engine step (the freeze, the transfers and the connectors are real).

Then the **thaw**: every block the allocator could hand out is given to a new owner
(written with a known value), the frozen prefill resumes, and its late READ / WRITE
lands: in the control, in the new owner's blocks; with stallguard, in the failed
request's quarantined blocks, which are freed once NIXL reports the transfer over.

Prints a table, writes ``vllm_wedge.png`` (the decode clients over time, and the thaw) and
``vllm_results.json`` to ``--out``. Exit status 0 when stallguard failed every pinned
request in the first step past its deadline, the plain connector kept them pinned, the
thaw changed 0 bytes of a new owner with stallguard (and some in the control), and
nothing stayed held; 1 otherwise; 2 if ``.venv-vllm`` is missing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "adapters" / "vllm" / "tests" / "vllm_scenarios.py"
PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
CONFIG = """
[decode]
Receiving = 10       # handshake + READ in flight (pull) / WRITE + notification (push)
AbortedHeld = 4      # an aborted request's blocks, held for its transfer
Quarantined = 8      # a failed request's blocks held this long is escalated (never freed)
[prefill]
HeldForRead = 6
"""


def run(out_dir: Path) -> dict[str, Any]:
    config = out_dir / "stallguard-vllm.toml"
    config.write_text(CONFIG)
    result = out_dir / "vllm_results.json"
    sys.path.insert(0, str(SCENARIOS.parent))
    from vllm_scenarios import subprocess_env  # (standard library only, at import)

    env = subprocess_env()
    with open(out_dir / "vllm_scenarios.log", "w") as log:
        subprocess.run(
            [str(PYTHON), str(SCENARIOS), "pull,push", str(config), str(result)],
            cwd=SCENARIOS.parent,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=600,
            check=False,
        )
    data = json.loads(result.read_text())
    if "error" in data:
        raise RuntimeError(data["error"])
    return dict(data["ok"])


def table(res: dict[str, Any]) -> tuple[str, bool]:
    pull, push = res["pull"], res["push"]
    d = pull["deadline"]
    f = pull["freeze"]["trace"]
    p = push["trace"]
    end_f, end_p = f[-1], p[-1]
    fail_f = next((r["t"] for r in f if r["f-sg"] == "FINISHED_ERROR"), None)
    fail_p = next((r["t"] for r in p if r["x-sg"] == "FINISHED_ERROR"), None)
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
    ]
    lines = [
        f"vLLM 0.33.0, NIXL over UCX/TCP; Receiving deadline {d:g} s, AbortedHeld "
        f"{pull['aborted_held_deadline']:g} s; state after {end_f['t']:g} s (3 x the deadline)",
        "",
        "| scenario | stallguard | decode request | decode blocks held at the end | client saw |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {e} | {g} |" for a, b, c, e, g in rows]
    slow = pull["slow"]
    lines += [
        "",
        f"healthy READ held up {slow['received_after']:g} s (> half the deadline) by a short "
        f"freeze: {slow['status']}, never failed",
        "",
        "Thaw: every free block given to a new owner, then the frozen prefill resumes",
        "",
        "| transfer | failure | new owners' bytes overwritten | late bytes in the failed "
        "request's blocks | freed after thaw |",
        "|---|---|---|---|---|",
    ]
    thaw_ok = True
    for name, r in (("pull (READ)", pull), ("push (WRITE)", push)):
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
    q = pull["after_thaw"]["quarantine"]
    lines += [
        "",
        f"quarantine: {sum(q['released'].values())} pull holds released "
        f"({', '.join(q['released'])}), {q['escalated']} escalated past Quarantined while "
        "the prefill was frozen (held, never freed)",
    ]
    ok = (
        end_f["f-plain"] == "WAITING_FOR_REMOTE_KVS"
        and end_p["x-plain"] == "WAITING_FOR_REMOTE_KVS"
        and fail_f == 1 + d
        and fail_p == 1 + d
        and slow["status"] == "FINISHED_LENGTH_CAPPED"
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
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    waiting = "WAITING_FOR_REMOTE_KVS"
    for ax, (title, trace, plain, sg) in zip(
        axes[:2],
        (
            ("pull: frozen prefill mid-READ", res["pull"]["freeze"]["trace"], "f-plain", "f-sg"),
            ("push: WRITE + notification never come", res["push"]["trace"], "x-plain", "x-sg"),
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
    ax = axes[2]
    labels, control, guarded = [], [], []
    for name in ("pull", "push"):
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
