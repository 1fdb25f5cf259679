"""Shadow -> advise -> enforce on real SGLang servers (docs/demo.md, "Real servers:
report, advise, enforce"; docs/advice.md).

    .venv/bin/python -m examples.real_servers advice [--out DIR] [--requests N]

1. **Shadow.** A prefill + decode (``python -m sglang.launch_server``) behind the Rust
   ``sglang-router``, the prefill with ``STALLGUARD_SGLANG_CONFIG`` in report mode
   (:data:`SHADOW`): nothing is failed; the time every request spends in each state is
   recorded and exported on the prefill's own ``/metrics``. Steady traffic through the
   router (*requests* prompts of 16-1024 tokens, two clients).
2. **Advise.** ``python -m stallguard_sglang advise --url <prefill>/metrics`` against the
   live server: its table, and its TOML block (``--toml``).
3. **Enforce.** The servers stopped; a new launch whose prefill's configuration is
   ``mode = "enforce"`` plus that block, nothing else. The seeds' fault on it (the
   decode SIGSTOPped mid-transfer of a 2048-token prompt): the prefill must fail the
   request at the advised deadline; new requests must be served after it.

Results: ``advice.md`` (the advice, the configuration applied, the outcome),
``advice.json``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._faults import Arm, Window, decode_frozen, delta, small
from ._servers import PYTHON, ROOT, ServerSet, wait_healthy

#: the shadow's configuration: report mode, the deadlines it measures against
SHADOW = """\
# stallguard-sglang shadow (report mode) for examples/real_servers advice
[prefill]
mode = "report"

[prefill.deadlines]
Bootstrapping = 60
WaitingForInput = 30
Transferring = 30
"""

SIZES = (16, 64, 256, 1024, 32, 512)


def start(arm: Arm, log: Callable[[str], None]) -> None:
    from ._main import Arm as MainArm
    from ._main import ready_router

    arm.servers.start_servers()
    log(f"advice: {arm.name}: prefill + decode started, waiting for /health")
    wait_healthy([arm.servers])
    arm.servers.start_router()
    ready_router(MainArm(arm.name, arm.servers))


def traffic(arm: Arm, n: int, clients: int = 2) -> list[dict[str, Any]]:
    """*n* requests through the router, *clients* at a time, sizes cycling over SIZES."""
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    todo = list(range(n))

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            r = small(arm, SIZES[i % len(SIZES)], timeout=180)
            with lock:
                results.append(r)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def advise(url: str, *, rate: float, floor: float, min_samples: int, toml: bool) -> str:
    argv = [sys.executable, "-m", "stallguard_sglang", "advise", "--url", url]
    argv += ["--false-timeout-rate", f"{rate:g}", "--floor", f"{floor:g}"]
    argv += ["--min-samples", str(min_samples)]
    if toml:
        argv.append("--toml")
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'adapters' / 'sglang' / 'src'}"}
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=120, env={**os.environ, **env}
    )
    if proc.returncode != 0:
        raise RuntimeError(f"advise exited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def advised_deadline(block: str, state: str) -> float | None:
    m = re.search(rf"^{state}\s*=\s*([0-9.]+)", block, re.M)
    return float(m.group(1)) if m else None


def run_advice(
    out: Path,
    *,
    requests: int = 30,
    rate: float = 0.05,
    floor: float = 5.0,
    min_samples: int = 10,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.monotonic()
    shadow_cfg = out / "stallguard-sglang-shadow.toml"
    shadow_cfg.write_text(SHADOW)
    res: dict[str, Any] = {"requests": requests, "rate": rate, "floor": floor}
    shadow = Arm("shadow", ServerSet("shadow", out / "logs", shadow_cfg, decode_stallguard=False))
    try:
        start(shadow, log)
        log(f"advice: shadow: {requests} requests through the router")
        res["shadow_requests"] = traffic(shadow, requests)
        url = shadow.servers.url("prefill") + "/metrics"
        res["shadow_metrics"] = {
            k: v for k, v in shadow.servers.metrics("prefill").items() if "stallguard" in k
        }
        res["advice"] = advise(url, rate=rate, floor=floor, min_samples=min_samples, toml=False)
        res["block"] = advise(url, rate=rate, floor=floor, min_samples=min_samples, toml=True)
    finally:
        shadow.servers.stop()
    enforce_cfg = out / "stallguard-sglang-advised.toml"
    enforce_cfg.write_text('[prefill]\nmode = "enforce"\n\n' + res["block"])
    res["applied"] = enforce_cfg.read_text()
    deadline = advised_deadline(res["block"], "Transferring")
    res["advised_transferring_s"] = deadline
    advised = Arm(
        "advised", ServerSet("advised", out / "logs", enforce_cfg, decode_stallguard=False)
    )
    try:
        start(advised, log)
        log(f"advice: advised: the decode frozen mid-transfer (Transferring = {deadline})")
        decode_frozen(advised, Window(1), deadline or 30.0)
        res["fault"] = advised.faults["decode_frozen"]
        log_text = advised.servers.procs["prefill"].log_text()
        res["stallguard_log"] = [
            line for line in log_text.splitlines() if "stallguard forced failure" in line
        ]
    finally:
        advised.servers.stop()
    res["total_s"] = round(time.monotonic() - t_all, 1)
    (out / "advice.json").write_text(json.dumps(res, indent=1))
    return res


def verdict(res: dict[str, Any]) -> list[str]:
    bad = []
    if not all(r.get("status") == 200 for r in res.get("shadow_requests", [])):
        bad.append("shadow: a request failed (report mode must fail nothing)")
    if res.get("advised_transferring_s") is None:
        bad.append("advise suggested no Transferring deadline")
    fault = res.get("fault", {})
    if not fault:
        bad.append("advised: the fault did not run")
        return bad
    if fault.get("observation", {}).get("prefill.inflight") != 0:
        bad.append("advised: the inflight queue was not released by the observation point")
    if not delta(fault, "prefill.forced") >= 1:
        bad.append("advised: stallguard failed nothing")
    if not all(r.get("status") == 200 for r in fault.get("healthy_after", [])):
        bad.append("advised: new requests after the fault failed")
    return bad


def report(res: dict[str, Any]) -> str:
    fault = res.get("fault", {})
    ok = sum(r.get("status") == 200 for r in res.get("shadow_requests", []))
    lines = [
        f"shadow (report mode): {ok}/{len(res.get('shadow_requests', []))} requests answered",
        "",
        "advise --url <shadow prefill>/metrics "
        f"--false-timeout-rate {res['rate']:g} --floor {res['floor']:g}:",
        "",
        "```",
        res.get("advice", "").rstrip(),
        "```",
        "",
        "applied at the next launch (STALLGUARD_SGLANG_CONFIG of the new prefill):",
        "",
        "```toml",
        res.get("applied", "").rstrip(),
        "```",
        "",
    ]
    if fault:
        clients = fault.get("clients", [{}])
        lines.append(
            f"decode frozen mid-transfer on the advised servers: in the inflight queue from "
            f"+{fault.get('entry_s')} s; stallguard failed it "
            f"{delta(fault, 'prefill.forced'):g} time(s); inflight at the observation point "
            f"{fault.get('observation', {}).get('prefill.inflight')}; client "
            f"{clients[0].get('status')} at +{clients[0].get('t_end_s')} s; new requests "
            f"after: {sum(r.get('status') == 200 for r in fault.get('healthy_after', []))}/"
            f"{len(fault.get('healthy_after', []))}"
        )
        lines += [f"    {line}" for line in res.get("stallguard_log", [])]
    lines.append(f"total {res.get('total_s')} s")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m examples.real_servers advice")
    p.add_argument("--out", type=Path, default=Path("real_servers_out"))
    p.add_argument("--requests", type=int, default=30)
    args = p.parse_args(argv)
    if args.requests < 1:
        p.error(f"--requests: must be at least 1, got {args.requests}")
    if not PYTHON.exists():
        print(f"{PYTHON} is missing: run `python3 tools/dev.py env` (it builds .venv-realsrv)")
        return 2
    out = args.out.resolve()
    res = run_advice(
        out, requests=args.requests, log=lambda m: print(f"[real_servers] {m}", flush=True)
    )
    text = report(res)
    (out / "advice.md").write_text(text + "\n")
    print(text)
    bad = verdict(res)
    for b in bad:
        print(f"NOT OK: {b}")
    return 1 if bad else 0


__all__ = ["main", "report", "run_advice", "verdict"]
