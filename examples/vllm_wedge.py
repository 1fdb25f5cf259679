"""The vLLM half of the demo: a decode pinned by a frozen prefill on vLLM 0.33's NIXL
connector, without stallguard and with stallguard-vllm.

    .venv/bin/python -m examples.vllm_wedge [--out DIR]

Runs ``adapters/vllm/tests/vllm_scenarios.py`` (pull and push) under ``.venv-vllm`` (built
by ``python3 tools/dev.py env``): vLLM's real schedulers and NIXL connectors, real NIXL
agents over UCX/TCP on loopback, prefill engines in a child process frozen with SIGSTOP,
and two decode engines stepped side by side, one with vLLM's plain connector and one
with stallguard's. stallguard's clock is simulated, one second per engine step (the
freeze, the transfers and the connectors are real). Prints a table, writes
``vllm_wedge.png`` (blocks held by the decode over time) and ``vllm_results.json`` to
``--out``. Exit status 0 when stallguard released every pinned request in the first step
past its deadline and the plain connector kept them pinned; 1 otherwise; 2 if
``.venv-vllm`` is missing.
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
    rel_a = next((r["t"] for r in f if not r["a-sg"]), None)
    fail_p = next((r["t"] for r in p if r["x-sg"] == "FINISHED_ERROR"), None)
    rows = [
        (
            "pull: READ to a frozen prefill",
            "without",
            end_f["f-plain"],
            end_f["held_plain"],
            "nothing",
        ),
        ("", "with", f"FINISHED_ERROR at t={fail_f:g} s", end_f["held_sg"], "error response"),
        (
            "pull: aborted while reading",
            "without",
            "held" if end_f["a-plain"] else "released",
            "(included above)",
            "-",
        ),
        ("", "with", f"released at t={rel_a:g} s", "0", "-"),
        ("push: WRITE never arrives", "without", end_p["x-plain"], end_p["held_plain"], "nothing"),
        ("", "with", f"FINISHED_ERROR at t={fail_p:g} s", end_p["held_sg"], "error response"),
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
    ]
    ok = (
        end_f["f-plain"] == "WAITING_FOR_REMOTE_KVS"
        and end_p["x-plain"] == "WAITING_FOR_REMOTE_KVS"
        and fail_f == 1 + d
        and fail_p == 1 + d
        and end_f["held_sg"] == 0
        and end_p["held_sg"] == 0
        and slow["status"] == "FINISHED_LENGTH_CAPPED"
    )
    return "\n".join(lines), ok


def picture(res: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2), sharey=True)
    for ax, (title, trace, plain, sg) in zip(
        axes,
        (
            (
                "pull: frozen prefill mid-READ (+ an abort)",
                res["pull"]["freeze"]["trace"],
                "held_plain",
                "held_sg",
            ),
            (
                "push: WRITE + notification never come",
                res["push"]["trace"],
                "held_plain",
                "held_sg",
            ),
        ),
        strict=True,
    ):
        t = [r["t"] for r in trace]
        ax.step(t, [r[plain] for r in trace], where="post", label="vLLM as shipped")
        ax.step(t, [r[sg] for r in trace], where="post", label="with stallguard-vllm")
        ax.axvline(1 + res["pull"]["deadline"], color="grey", ls=":", lw=1)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("seconds (stallguard's clock; one engine step per second)")
    axes[0].set_ylabel("decode KV blocks held")
    axes[0].legend(fontsize=8)
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
