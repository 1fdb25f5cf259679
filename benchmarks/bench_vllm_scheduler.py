#!/usr/bin/env python3
"""What stallguard-vllm costs a vLLM scheduler step with N requests waiting for remote KV.

Runs in .venv-vllm (``.venv-vllm/bin/python benchmarks/bench_vllm_scheduler.py``). Two
decode engines' REAL ``Scheduler`` objects (vLLM 0.33.0), each building its KV
connector's scheduler side from its KV-transfer config:

* ``disabled``: vLLM's ``NixlConnector``;
* ``enabled``: ``StallguardNixlConnector`` (stallguard-vllm, deadlines of a day: nothing
  expires during the run).

With ``--connector mooncake`` the inner connector is vLLM's ``MooncakeConnector`` in both
arms: ``disabled`` is it alone, ``enabled`` is ``StallguardConnector`` wrapping it (the
generic guard, named in ``kv_connector_extra_config["inner"]``).

Each gets N decode requests with ``do_remote_prefill`` params, stepped until all N sit in
``WAITING_FOR_REMOTE_KVS`` (the worker side is not involved: no transfer completes, as
when the prefill is slow). The timed operation is one engine step of the scheduler:
``schedule()`` (which walks the waiting queue and builds the connector metadata, where
stallguard runs its deadline check) plus ``update_from_output()`` with an empty model
output. The arms alternate in rounds in this one process; prints the median per-step
time of each arm, the enabled/disabled ratio of the medians, and the median of the
per-round ratios (each round runs both arms back to back, so it pairs them in time).
``--quick`` only checks that the script works.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.pop("STALLGUARD_VLLM", None)
# deadlines of a day: nothing expires during the run however slow the machine is (the
# defaults' 120 s Receiving passed mid-run at load 60, failing requests in one arm)
_CONFIG = Path(tempfile.mkdtemp(prefix="sg-bench-")) / "stallguard-vllm.toml"
_CONFIG.write_text("[decode]\nQueued = 86400\nReceiving = 86400\n")
os.environ["STALLGUARD_VLLM_CONFIG"] = str(_CONFIG)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "adapters" / "vllm" / "tests"))


MOONCAKE_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "P-engine",
    "remote_bootstrap_addr": "http://127.0.0.1:5998",
}
NIXL_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "P-engine",
    "remote_request_id": "p",
    "remote_block_ids": [[0, 1, 2, 3]],
    "remote_host": "127.0.0.1",
    "remote_port": 5999,
    "tp_size": 1,
}


def build(n: int, connector: str, inner: str | None = None):  # type: ignore[no-untyped-def]
    import torch
    import vllm_engine as V
    from vllm.config import set_current_vllm_config
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    module = "stallguard_vllm.connector" if connector.startswith("Stallguard") else None
    extra = {"inner": {"kv_connector": inner}} if inner else None
    vc = V.vllm_config(
        "kv_consumer", f"D-{connector}", connector=connector, module_path=module, extra=extra
    )
    blocks = 4 * n + 64
    vc.cache_config.num_gpu_blocks = blocks
    vc.scheduler_config.max_num_seqs = 256
    spec = FullAttentionSpec(block_size=V.BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16)
    kvc = KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(V.LAYERS), spec)],
    )
    with set_current_vllm_config(vc):
        sched = Scheduler(
            vllm_config=vc,
            kv_cache_config=kvc,
            log_stats=False,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=V.BLOCK,
        )
    mooncake = "Mooncake" in (inner or connector)
    params = MOONCAKE_PARAMS if mooncake else NIXL_PARAMS
    for i in range(n):
        p = dict(params)
        if mooncake:
            p["transfer_id"] = f"t-{i}"
        sched.add_request(V.request(f"{connector}-{i}", p, 4))
    for _ in range(10 * n):
        if all(r.status.name == "WAITING_FOR_REMOTE_KVS" for r in sched.requests.values()):
            break
        step(sched)
    else:
        raise RuntimeError("requests did not all reach WAITING_FOR_REMOTE_KVS")
    return sched


def step(sched) -> None:  # type: ignore[no-untyped-def]
    from vllm.v1.outputs import ModelRunnerOutput

    so = sched.schedule()
    sched.update_from_output(
        so,
        ModelRunnerOutput(
            req_ids=[],
            req_id_to_index={},
            sampled_token_ids=[],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
        ),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=1000, help="requests waiting for remote KV")
    parser.add_argument("--rounds", type=int, default=30, help="alternations of the arms")
    parser.add_argument("--steps", type=int, default=50, help="steps per arm per round")
    parser.add_argument("--quick", action="store_true", help="smoke run")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also count the Python calls per step of each arm (cProfile; load-independent)",
    )
    parser.add_argument(
        "--connector",
        choices=("nixl", "mooncake"),
        default="nixl",
        help="the inner connector of both arms",
    )
    args = parser.parse_args()
    if args.quick:
        args.n, args.rounds, args.steps = 50, 2, 5
    import vllm_engine as V
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    _ = V.model_dir()
    if args.connector == "mooncake":
        arms = {
            "disabled": build(args.n, "MooncakeConnector"),
            "enabled": build(args.n, "StallguardConnector", inner="MooncakeConnector"),
        }
    else:
        arms = {
            "disabled": build(args.n, "NixlConnector"),
            "enabled": build(args.n, "StallguardNixlConnector"),
        }
    assert len(arms["enabled"].connector.stallguard.transfers) == args.n
    times: dict[str, list[float]] = {name: [] for name in arms}
    order = list(arms)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else reversed(order):
            sched = arms[name]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(sched)
            times[name].append((time.perf_counter() - t0) / args.steps)
    for sched in arms.values():
        assert all(r.status.name == "WAITING_FOR_REMOTE_KVS" for r in sched.requests.values())
    calls: dict[str, float] = {}
    if args.profile:
        import cProfile
        import pstats

        for name, sched in arms.items():
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.steps):
                step(sched)
            prof.disable()
            calls[name] = pstats.Stats(prof).total_calls / args.steps  # type: ignore[attr-defined]
    med = {name: statistics.median(v) for name, v in times.items()}
    print(
        f"python {platform.python_version()}, {os.cpu_count()} CPUs; inner {args.connector}; "
        f"N = {args.n}, "
        f"{args.rounds} rounds x {args.steps} steps per arm"
    )
    for name, m in med.items():
        print(
            f"{name:9s} median step {m * 1e6:9.1f} us  (p90 of rounds "
            f"{sorted(times[name])[int(0.9 * len(times[name]))] * 1e6:9.1f} us)"
        )
    print(f"enabled/disabled = {med['enabled'] / med['disabled']:.3f}x (ratio of medians)")
    paired = [e / d for e, d in zip(times["enabled"], times["disabled"], strict=True)]
    print(f"enabled/disabled = {statistics.median(paired):.3f}x (median of per-round ratios)")
    if calls:
        print(
            f"Python calls per step: disabled {calls['disabled']:.0f}, enabled "
            f"{calls['enabled']:.0f} (+{calls['enabled'] - calls['disabled']:.0f})"
        )
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
