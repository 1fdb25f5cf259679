"""Real-vLLM scenarios of the generic guard, run in .venv-vllm by test_vllm_generic.py:

    python mooncake_scenarios.py SCENARIO[,SCENARIO] CONFIG.toml OUT.json

``mooncake``: vLLM 0.33's real ``MooncakeConnector`` (scheduler and worker sides) over
the real Mooncake transfer engine's TCP transport. The prefill engine runs in a child
process, so it can be frozen with SIGSTOP while a decode's pull is outstanding; three
decode engines run here, stepped side by side: vLLM's plain ``MooncakeConnector``
(control: pinned), ``StallguardConnector`` wrapping it (guarded), and a plain one whose
request is freed at the deadline the way a backstop that frees would (the stale-write
control). stallguard's clock is a FakeClock moved one second per step; the transfers,
the freeze and the Mooncake/ZMQ traffic are real.

``unknown``: ``StallguardConnector`` wrapping ``late_connector.LateWriteConnector``, a
connector stallguard was never told about (the stand-in for LMCache and the others).

The one stand-in for Mooncake: ``torch.accelerator.current_device_index`` answers 0
(vLLM's Mooncake worker asks for the current GPU at start-up; there is none here, and
it uses the index only to bind its sender threads to the device).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
SG_MODULE = "stallguard_vllm.connector"
P_SEED = 31
MOONCAKE_EXTRA = {"mooncake_protocol": "tcp", "num_workers": 2}


def _no_gpu() -> None:
    """The one stand-in (see the module docstring)."""
    import torch

    torch.accelerator.current_device_index = lambda: 0  # type: ignore[assignment]


def prefill_process(inq: Any, outq: Any, bootstrap_port: int, init_port: int) -> None:
    """A Mooncake prefill engine (vLLM's plain MooncakeConnector, kv_producer), its
    bootstrap server (HTTP) on *bootstrap_port*."""
    os.environ["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(bootstrap_port)
    sys.path.insert(0, HERE)
    _no_gpu()
    import vllm_engine as V

    V.init_process(init_port)
    e = V.engine(
        "kv_producer", "MP", connector="MooncakeConnector", extra=MOONCAKE_EXTRA, seed=P_SEED
    )
    outq.put({"ready": True})
    while True:
        try:
            rid = inq.get_nowait()
        except Exception:
            rid = None
        if rid is not None:
            try:
                r = V.request(
                    rid,
                    {
                        "do_remote_prefill": False,
                        "do_remote_decode": True,
                        "transfer_id": f"t-{rid}",
                    },
                    1,
                )
                V.add(e, r)
                V.step(e)
                outq.put({"rid": rid, "blocks": e.block_ids(rid)})
            except Exception:
                outq.put({"error": traceback.format_exc()})
        V.step(e)
        time.sleep(0.02)


class Prefill:
    """The prefill child process (free ports: other runs may share the machine)."""

    def __init__(self) -> None:
        import vllm_scenarios as S
        from vllm.utils.network_utils import get_open_port

        self._S = S
        self.bootstrap_port = get_open_port()
        ctx = mp.get_context("spawn")
        self.inq, self.outq = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(
            target=prefill_process,
            args=(self.inq, self.outq, self.bootstrap_port, get_open_port()),
            daemon=True,
        )
        self.proc.start()
        try:
            ready = self.outq.get(timeout=600)
        except BaseException:  # never leave the child holding its ports
            self.kill()
            raise
        assert ready.get("ready"), ready

    def prefill(self, rid: str) -> dict[str, Any]:
        """Run *rid*'s prefill; returns the decode's kv_transfer_params (what a router
        forwards) and the prefill's block ids."""
        self.inq.put(rid)
        got = self.outq.get(timeout=60)
        assert "error" not in got, got.get("error")
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": f"t-{rid}",
            "remote_engine_id": "MP",
            "remote_bootstrap_addr": f"http://127.0.0.1:{self.bootstrap_port}",
        }
        return {"params": params, "blocks": got["blocks"]}

    def freeze(self) -> None:
        self._S.Prefill.freeze(self)  # type: ignore[arg-type]

    def thaw(self) -> None:
        self._S.Prefill.thaw(self)  # type: ignore[arg-type]

    def kill(self) -> None:
        self._S.Prefill.kill(self)  # type: ignore[arg-type]


def _drop_unknown(e: Any) -> None:
    """The stale-write control's engine: after its request was freed the backstop way,
    the late end Mooncake reports for it must not reach the scheduler (vLLM asserts
    every finished id is a live request)."""
    w = e.worker
    get = w.get_transfer_results

    def results(finished: set[str]) -> Any:
        r = get(finished)
        r.finished_recving = {x for x in r.finished_recving if x in e.scheduler.requests}
        return r

    w.get_transfer_results = results


def _free_like_a_backstop(e: Any, rid: str) -> None:
    """What a backstop that frees at the deadline does: fail the request and free its
    blocks now, while the prefill may still WRITE into them (the control arm)."""
    import vllm_engine as V

    req = e.scheduler.requests[rid]
    e.scheduler.finish_requests([rid], V.RequestStatus.FINISHED_ERROR)
    e.scheduler._free_blocks(req)


def mooncake(clock: Any) -> dict[str, Any]:
    import vllm_engine as V

    P = Prefill()
    try:
        return _mooncake(P, clock, V)
    finally:
        P.kill()


def _mooncake(P: Prefill, clock: Any, V: Any) -> dict[str, Any]:
    guarded_extra = {
        "inner": {"kv_connector": "MooncakeConnector", "kv_connector_extra_config": MOONCAKE_EXTRA}
    }
    plain = V.engine(
        "kv_consumer", "MD-plain", connector="MooncakeConnector", extra=MOONCAKE_EXTRA, seed=41
    )
    guarded = V.engine(
        "kv_consumer",
        "MD-sg",
        connector="StallguardConnector",
        module_path=SG_MODULE,
        extra=guarded_extra,
        seed=42,
    )
    unsafe = V.engine(
        "kv_consumer", "MD-unsafe", connector="MooncakeConnector", extra=MOONCAKE_EXTRA, seed=43
    )
    _drop_unknown(unsafe)
    engines = {"plain": plain, "guarded": guarded, "unsafe": unsafe}
    sg = guarded.connector.stallguard
    R = sg.config.receiving
    out: dict[str, Any] = {"deadline": R, "aborted_held_deadline": sg.config.aborted_held}
    outputs: dict[str, list[Any]] = {}
    payloads: list[dict[str, Any]] = []

    def tick(advance: float = 1.0, pause: float = 0.05) -> None:
        for name, e in engines.items():
            eco, _ = V.step(e)
            for v in eco.values():
                for o in v.outputs:
                    outputs.setdefault(o.request_id, []).append(
                        {
                            "finish": None if o.finish_reason is None else o.finish_reason.name,
                            "t": clock(),
                        }
                    )
            stats = getattr(eco.get(0), "scheduler_stats", None) if eco else None
            data = getattr(stats, "kv_connector_stats", None)
            if (
                name == "guarded"
                and data
                and any(data.get(k) for k in ("stallguard_forced", "stallguard_quarantine"))
            ):
                payloads.append(
                    {
                        k: data[k]
                        for k in (
                            "stallguard_forced",
                            "stallguard_reported",
                            "stallguard_quarantine",
                        )
                        if data.get(k)
                    }
                )
        time.sleep(pause)
        clock.advance(advance)

    def add(e: Any, rid: str, params: dict[str, Any], max_tokens: int = 3) -> None:
        V.add(e, V.request(rid, params, max_tokens))

    def status(e: Any, rid: str) -> str:
        return str(e.ran[rid].status.name)

    def held(e: Any) -> int:
        return V.BLOCKS - 1 - e.free_blocks()

    # warm-up: every decode learns the prefill from its bootstrap server and pulls once
    # (the clock stands still: its length depends on the machine's load)
    for name, e in engines.items():
        add(e, f"w-{name}", P.prefill(f"w-{name}")["params"])
    t0 = time.monotonic()
    while any(not e.ran[f"w-{n}"].is_finished() for n, e in engines.items()):
        if time.monotonic() - t0 > 120:
            raise RuntimeError("warm-up transfers did not finish in 120 s")
        tick(0.0)
    out["warm"] = {n: status(e, f"w-{n}") for n, e in engines.items()}
    base = {n: e.free_blocks() for n, e in engines.items()}
    # prefills of the requests the frozen prefill will owe
    rids = {
        "f-plain": plain,
        "f-sg": guarded,
        "f-unsafe": unsafe,
        "a-plain": plain,
        "a-sg": guarded,
        "h-sg": guarded,
    }
    pre = {rid: P.prefill(rid) for rid in rids}
    time.sleep(1.0)  # the prefill's next steps hand the last holds to its worker
    P.freeze()
    for rid in ("f-plain", "f-sg", "f-unsafe", "a-plain", "a-sg"):
        add(rids[rid], rid, pre[rid]["params"])
    trace: list[dict[str, Any]] = []
    start = clock()
    aborted_at = None
    healthy_added = None
    failed_blocks: dict[str, list[int]] = {}
    thaw_at = start + 3 * R + 1
    while clock() < thaw_at:
        t = clock() - start
        if t == 3 and aborted_at is None:
            for e, rid in ((plain, "a-plain"), (guarded, "a-sg")):
                e.scheduler.finish_requests([rid], V.RequestStatus.FINISHED_ABORTED)
            aborted_at = t
        if t == 1 + R:
            failed_blocks["f-unsafe"] = unsafe.block_ids("f-unsafe")
            _free_like_a_backstop(unsafe, "f-unsafe")
        if healthy_added is None and t >= 3 * R + 1 - 0.6 * R:
            add(guarded, "h-sg", pre["h-sg"]["params"])
            healthy_added = t
        tick()
        row = {
            "t": clock() - start,
            "f-plain": status(plain, "f-plain"),
            "f-sg": status(guarded, "f-sg"),
            "held_plain": held(plain) - (V.BLOCKS - 1 - base["plain"]),
            "held_sg": held(guarded) - (V.BLOCKS - 1 - base["guarded"]),
            "quarantined_sg": len(sg.quarantine),
            "a-plain_held": "a-plain" in plain.scheduler.requests,
            "a-sg_held": "a-sg" in guarded.scheduler.requests,
        }
        failed_now = row["f-sg"] == "FINISHED_ERROR" and "f-sg" not in failed_blocks
        if failed_now and "f-sg" in guarded.scheduler.requests:
            failed_blocks["f-sg"] = guarded.block_ids("f-sg")
        trace.append(row)
    out["trace"] = trace
    out["aborted_at"] = aborted_at
    out["healthy_added"] = healthy_added
    out["counts"] = {f"{k}/{p}": n for (k, p), n in sg.counts.items()}
    out["quarantine_before_thaw"] = {
        "holds": [
            {"key": h.key, "peer": h.peer, "units": h.units, "nbytes": h.nbytes}
            for h in sg.quarantine.holds()
        ]
    }
    # the stale-write check: every block the allocators could hand out goes to a new
    # owner, then the prefill resumes and answers the pulls it owes
    arms = {"guarded": (guarded, "f-sg"), "unsafe": (unsafe, "f-unsafe")}
    before: dict[str, Any] = {}
    for name, (e, rid) in arms.items():
        blocks = failed_blocks.get(rid, [])
        free = e.free_block_ids()
        V.give_to_new_owner(e, free)
        before[name] = {
            "held": blocks,
            "free": free,
            "content": V.snapshot(e, blocks),
            "still": rid in e.scheduler.requests,
        }
    out["outputs_before_thaw"] = {k: list(v) for k, v in outputs.items() if not k.startswith("w-")}
    P.thaw()
    thawed = time.monotonic()
    healthy_at = released_at = None
    while time.monotonic() - thawed < 60:
        tick(0.0)
        if healthy_at is None and status(guarded, "h-sg") != "WAITING_FOR_REMOTE_KVS":
            healthy_at = time.monotonic() - thawed
        if released_at is None and "f-sg" not in guarded.scheduler.requests:
            released_at = time.monotonic() - thawed
        done = (
            "f-sg" not in guarded.scheduler.requests
            and "a-sg" not in guarded.scheduler.requests
            and guarded.ran["h-sg"].is_finished()
            and "f-plain" in plain.ran
            and plain.ran["f-plain"].is_finished()
        )
        if done:
            break
    for _ in range(10):  # a late write into a freed block would land by now
        tick(0.0)
    block_bytes = 2 * V.BLOCK * 32 * 2 * len(V.LAYERS)
    after: dict[str, Any] = {}
    for name, (e, rid) in arms.items():
        b = before[name]
        after[name] = {
            "held_at_failure": b["held"],
            "held_when_new_owners_came": b["still"],
            "new_owner_bytes": len(b["free"]) * block_bytes,
            "new_owner_bytes_changed": V.bytes_changed(e, b["free"]),
            "late_bytes_in_held_blocks": V.bytes_changed_since(e, b["content"], b["held"]),
            # (the control's were freed at the failure: new owners have them)
            "held_bytes": len(b["held"]) * block_bytes if b["still"] else 0,
            "failed_bytes_from_prefill": V.bytes_matching(
                e, b["held"], P_SEED, pre[rid]["blocks"][: len(b["held"])]
            )
            if b["held"]
            else 0,
            "still_held": rid in e.scheduler.requests,
            "released_after_thaw_s": released_at if name == "guarded" else None,
        }
    after["healthy"] = {
        "status": status(guarded, "h-sg"),
        "finishes": [o["finish"] for o in outputs.get("h-sg", [])],
    }
    after["healthy_received_s"] = healthy_at
    after["f-plain"] = status(plain, "f-plain")
    after["held_sg"] = held(guarded) - (V.BLOCKS - 1 - base["guarded"])
    after["held_plain"] = held(plain) - (V.BLOCKS - 1 - base["plain"])
    snap = sg.quarantine.snapshot()
    after["quarantine"] = {
        "holds": snap.holds,
        "released": dict(snap.released),
        "escalated": snap.escalated,
    }
    out["after_thaw"] = after
    out["outputs"] = {k: v for k, v in outputs.items() if not k.startswith("w-")}
    out["stats_payloads"] = payloads
    out["refinement"] = type(guarded.worker.refinement).__name__
    out["block_bytes"] = block_bytes
    return out


def unknown(clock: Any) -> dict[str, Any]:
    """The generic guard over a connector it was never told about."""
    import late_connector as L
    import vllm_engine as V

    extra = {
        "inner": {
            "kv_connector": "LateWriteConnector",
            "kv_connector_module_path": "late_connector",
        }
    }
    plain = V.engine(
        "kv_consumer",
        "LD-plain",
        connector="LateWriteConnector",
        module_path="late_connector",
        seed=51,
    )
    guarded = V.engine(
        "kv_consumer",
        "LD-sg",
        connector="StallguardConnector",
        module_path=SG_MODULE,
        extra=extra,
        seed=52,
    )
    sg = guarded.connector.stallguard
    R = sg.config.receiving
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "LP"}
    out: dict[str, Any] = {"deadline": R, "refinement": type(guarded.worker.refinement).__name__}
    outputs: dict[str, list[str | None]] = {}

    def tick(advance: float = 1.0) -> None:
        for e in (plain, guarded):
            eco, _ = V.step(e)
            for v in eco.values():
                for o in v.outputs:
                    outputs.setdefault(o.request_id, []).append(
                        None if o.finish_reason is None else o.finish_reason.name
                    )
        time.sleep(0.01)
        clock.advance(advance)

    # warm: the gate open, both finish
    for e, rid in ((plain, "w-plain"), (guarded, "w-sg")):
        V.add(e, V.request(rid, params, 2))
    t0 = time.monotonic()
    while not (plain.ran["w-plain"].is_finished() and guarded.ran["w-sg"].is_finished()):
        if time.monotonic() - t0 > 60:
            raise RuntimeError("warm requests did not finish")
        tick(0.0)
    out["warm"] = {
        "plain": plain.ran["w-plain"].status.name,
        "guarded": guarded.ran["w-sg"].status.name,
    }
    L.GATE.clear()  # the peer freezes
    V.add(plain, V.request("u-plain", params, 2))
    V.add(guarded, V.request("u-sg", params, 2))
    start = clock()
    trace = []
    failed_blocks: list[int] = []
    while clock() - start < 3 * R:
        tick()
        row = {
            "t": clock() - start,
            "plain": plain.ran["u-plain"].status.name,
            "sg": guarded.ran["u-sg"].status.name,
            "sg_held": "u-sg" in guarded.scheduler.requests,
            "quarantined": len(sg.quarantine),
        }
        if row["sg"] == "FINISHED_ERROR" and not failed_blocks and row["sg_held"]:
            failed_blocks = guarded.block_ids("u-sg")
        trace.append(row)
    out["trace"] = trace
    out["counts"] = {f"{k}/{p}": n for (k, p), n in sg.counts.items()}
    free = guarded.free_block_ids()
    V.give_to_new_owner(guarded, free)
    content = V.snapshot(guarded, failed_blocks)
    L.GATE.set()  # the peer resumes: its late writes land
    t0 = time.monotonic()
    while "u-sg" in guarded.scheduler.requests or not plain.ran["u-plain"].is_finished():
        if time.monotonic() - t0 > 60:
            break
        tick(0.0)
    snap = sg.quarantine.snapshot()
    out["after"] = {
        "failed_blocks": failed_blocks,
        "new_owner_bytes": len(free) * 2 * V.BLOCK * 32 * 2 * len(V.LAYERS),
        "new_owner_bytes_changed": V.bytes_changed(guarded, free),
        "late_bytes_in_failed_blocks": V.bytes_changed_since(guarded, content, failed_blocks),
        "written_blocks": guarded.worker.inner.written.get("u-sg"),
        "late_pattern_bytes": sum(
            int((guarded.caches[name][b] == L.late_value("u-sg", b)).sum())
            * guarded.caches[name].element_size()
            for name in V.LAYERS
            for b in guarded.worker.inner.written.get("u-sg", [])
        ),
        "still_held": "u-sg" in guarded.scheduler.requests,
        "plain": plain.ran["u-plain"].status.name,
        "quarantine": {"holds": snap.holds, "released": dict(snap.released)},
    }
    out["outputs"] = {k: v for k, v in outputs.items() if k.startswith("u-")}
    return out


SCENARIOS = {"mooncake": mooncake, "unknown": unknown}


def main() -> None:
    name, config_path, out_path = sys.argv[1:4]
    try:
        _no_gpu()
        import vllm_engine as V

        os.environ["TINY_MODEL_DIR"] = V.model_dir()
        os.environ["STALLGUARD_VLLM_CONFIG"] = config_path
        import stallguard_vllm.connector as sgc

        from stallguard.testing import FakeClock

        clock = FakeClock(1000.0)
        sgc.set_clock(clock)
        from vllm.utils.network_utils import get_open_port

        V.init_process(get_open_port())
        result: dict[str, Any] = {"ok": {n: SCENARIOS[n](clock) for n in name.split(",")}}
    except BaseException:
        result = {"error": traceback.format_exc()}
    with open(out_path, "w") as f:
        json.dump(result, f, default=str)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
