"""Real-vLLM scenarios for test_vllm_real.py, run in .venv-vllm:

    python vllm_scenarios.py SCENARIO[,SCENARIO] CONFIG.toml OUT.json

A prefill engine (vLLM's plain NIXL connector) runs in a child process, so it can be
frozen with SIGSTOP the way a hung peer freezes; decode engines run here, one with
vLLM's plain connector and one with stallguard's, stepped side by side. stallguard's
deadlines run on a FakeClock moved one second per step (the transfers, the freeze and
the NIXL/UCX traffic are real; only the deadline's clock is simulated, so no test sleeps
for a deadline). Results go to OUT.json; the process ends with os._exit (UCX may crash
at interpreter exit).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import socket
import subprocess
import sys
import time
import traceback
from typing import Any

from stallguard.testing import stop_and_wait

HERE = os.path.dirname(os.path.abspath(__file__))
SG_MODULE = "stallguard_vllm.connector"
SG_KEYS = ("stallguard_forced", "stallguard_reported", "stallguard_quarantine")


def subprocess_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment to run this script in (in .venv-vllm), from the caller's: vLLM on
    the CPU and offline, NIXL over UCX/TCP on loopback, and no stallguard-vllm setting
    of the caller's (each scenario configures its own)."""
    environ = dict(os.environ if environ is None else environ)
    env = {k: v for k, v in environ.items() if not k.startswith("STALLGUARD_VLLM")}
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        UCX_TLS="tcp,self",
        UCX_NET_DEVICES="lo",
        VLLM_LOGGING_LEVEL="WARNING",
    )
    return env


def read_result(out: str | os.PathLike[str], returncode: int | None, log: str) -> dict[str, Any]:
    """The results a run of a scenario script (this one, mooncake_scenarios.py) wrote
    to *out*.

    Raises:
        RuntimeError: the run wrote none (its exit status and *log*: where to look), or
            one of its scenarios raised (the traceback).
    """
    if not os.path.exists(out):
        raise RuntimeError(f"exited {returncode} without a result\n{log}")
    with open(out) as f:
        result = json.load(f)
    if "error" in result:
        raise RuntimeError(f"raised:\n{result['error']}\n{log}")
    return dict(result["ok"])


def run_script(
    python: str | os.PathLike[str],
    script: str,
    names: str,
    config_text: str,
    tmp: str | os.PathLike[str],
    timeout: float = 1200,
) -> dict[str, Any]:
    """Run *script* (in this directory) under *python* (.venv-vllm's) with the
    scenarios *names* (comma-separated) and a configuration file of *config_text* in
    *tmp*; its results (:func:`read_result`)."""
    config = os.path.join(tmp, "stallguard-vllm.toml")
    with open(config, "w") as f:
        f.write(config_text)
    out = os.path.join(tmp, "out.json")
    proc = subprocess.run(
        [str(python), os.path.join(HERE, script), names, config, out],
        cwd=HERE,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,  # vLLM start-ups: minutes at load 60 on 2 cores
        errors="replace",
    )
    log = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    return read_result(out, proc.returncode, log)


PORTS_VAR = "STALLGUARD_VLLM_SCENARIO_PORTS"


def _scenario_ports(n: int = 9) -> tuple[int, ...]:
    """The scenarios' ports (NIXL side channels, torch.distributed init): free ones,
    picked once per scenario run and handed to its spawned children through the
    environment (a child re-imports this module), so that two runs at the same time
    (two pytest-xdist workers, another checkout's tests) never share one."""
    raw = os.environ.get(PORTS_VAR)
    if raw:
        return tuple(int(p) for p in raw.split(","))
    # below the kernel's ephemeral range (where port 0 binds land, e.g. the Mooncake half
    # running beside it: a port taken there between this check and its use collided)
    ports_found: list[int] = []
    rng = random.Random()
    while len(ports_found) < n:
        port = rng.randrange(20000, 32000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports_found:
            ports_found.append(port)
    ports = tuple(ports_found)
    os.environ[PORTS_VAR] = ",".join(map(str, ports))
    return ports


(
    PULL_P_PORT,
    PUSH_P_PORT,
    PUSH_D_PLAIN_PORT,
    PUSH_D_SG_PORT,
    PREFILL_PLAIN_PORT,
    PREFILL_SG_PORT,
    PUSH_D_UNSAFE_PORT,
    PREFILL_INIT_PORT,
    SCENARIO_INIT_PORT,
) = _scenario_ports()
#: the prefill engines' KV contents (vllm_engine.pattern): what a late transfer carries
PULL_P_SEED, PUSH_P_SEED = 11, 12


def prometheus(e: Any, payloads: list[dict[str, Any]]) -> dict[str, float | None]:
    """Feed the shipped stats to vLLM's own KV-connector Prometheus layer (what the API
    server's stat logger does) and read stallguard's counters back."""
    from prometheus_client import REGISTRY
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    prom = KVConnectorProm(e.scheduler.vllm_config, ["model_name", "engine"], {0: ["tiny", "0"]})
    labels = {"model_name": "tiny", "engine": "0"}
    gauges: list[list[float | None]] = []  # (blocks, bytes, overdue) for peer P, per payload
    for data in payloads:
        full = dict(e.connector.build_kv_connector_stats().data)
        full.update(data)
        prom.observe(full, 0)
        if data.get("stallguard_quarantine"):
            gauges.append(
                [
                    REGISTRY.get_sample_value(name, {**labels, "peer": "P"})
                    for name in (
                        "vllm:stallguard_quarantined_blocks",
                        "vllm:stallguard_quarantined_bytes",
                        "vllm:stallguard_quarantine_overdue",
                    )
                ]
            )
    out: dict[str, Any] = {
        phase: REGISTRY.get_sample_value(
            "vllm:stallguard_forced_failures_total",
            # state and reason: the labels shared with stallguard-sglang; phase: 0.1's
            {**labels, "state": phase, "reason": "state", "phase": phase},
        )
        for phase in ("Receiving", "AbortedHeld")
    }
    out["quarantine_gauges"] = gauges
    return out


def prefill_process(inq: Any, outq: Any, port: int) -> None:
    """Two prefill engines in one process: ``pull`` (vLLM's NixlConnector, side channel
    PULL_P_PORT) and ``push`` (NixlPushConnector, PUSH_P_PORT); frozen together by
    SIGSTOP."""
    sys.path.insert(0, HERE)
    import vllm_engine as V

    V.init_process(port)
    engines = {
        "pull": V.engine("kv_producer", "P", port=PULL_P_PORT, seed=PULL_P_SEED),
        "push": V.engine(
            "kv_producer", "PP", connector="NixlPushConnector", port=PUSH_P_PORT, seed=PUSH_P_SEED
        ),
    }
    outq.put({"ready": True})
    while True:
        try:
            mode, rid = inq.get_nowait()
        except Exception:
            mode = None
        if mode is not None:
            try:
                outq.put(V.prefill(engines[mode], rid))
            except Exception:
                outq.put({"error": traceback.format_exc()})
        for e in engines.values():
            V.step(e)
        time.sleep(0.02)


class Prefill:
    """The prefill child process."""

    def __init__(self, port: int = PREFILL_INIT_PORT) -> None:
        ctx = mp.get_context("spawn")
        self.inq, self.outq = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(
            target=prefill_process, args=(self.inq, self.outq, port), daemon=True
        )
        self.proc.start()
        try:
            ready = self.outq.get(timeout=600)
        except BaseException:  # never leave the child holding its ports
            self.kill()
            raise
        assert isinstance(ready, dict) and ready.get("ready"), ready

    def prefill(self, rid: str, mode: str = "pull") -> dict[str, Any]:
        self.inq.put((mode, rid))
        params = self.outq.get(timeout=60)
        assert "error" not in params, params.get("error")
        return params

    def freeze(self) -> None:
        """SIGSTOP, then wait until every thread of the process is stopped: a group
        stop takes effect thread by thread, and on a loaded machine the NIXL/UCX
        progress threads could otherwise still serve a READ issued right after."""
        assert self.proc.pid is not None
        stop_and_wait(self.proc.pid)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        try:
            os.kill(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # already killed (the peer_killed scenario)
            pass


def _status(e: Any, rid: str) -> str:
    r = e.ran[rid]
    return r.status.name


def _in_flight(e: Any, rid: str) -> int:
    return len(e.worker.connector_worker._recving_transfers.get(rid, ()))


def _fail_the_old_way(e: Any, rid: str) -> None:
    """What stallguard-vllm did before quarantine (and what a backstop that frees does):
    release every in-flight handle (NIXL accepts it while the READ is PROC) and let vLLM
    report the request failed and done, which frees its blocks. The control arm."""
    w = e.worker.connector_worker
    for h in w._recving_transfers.pop(rid, []):
        w._handle_failed_transfer(rid, h, w._recv_failures)


def _stale_write_check(
    arms: dict[str, tuple[Any, str]],
    P: Prefill,
    tick: Any,
    seed: int,
    remote: dict[str, list[int]],
    gone: Any,
) -> dict[str, Any]:
    """After the forced failures: every block the allocator could hand out goes to a
    new owner (vllm_engine.NEW_OWNER); the frozen prefill resumes; once every late
    transfer is over, count the new owners' bytes that changed, and the bytes of the
    failed request's (quarantined) blocks that now hold the prefill's KV."""
    import vllm_engine as V

    before: dict[str, Any] = {}
    for name, (e, rid) in arms.items():
        held = e.block_ids(rid) if rid in e.scheduler.requests else []
        free = e.free_block_ids()
        V.give_to_new_owner(e, free)
        before[name] = {"held": held, "free": free, "content": V.snapshot(e, held)}
    P.thaw()
    thawed = time.monotonic()
    released_after: dict[str, float | None] = {name: None for name in arms}
    while time.monotonic() - thawed < 30:
        tick(0.05, advance=0.0)
        for name, (e, rid) in arms.items():
            if released_after[name] is None and gone(e, rid):
                released_after[name] = time.monotonic() - thawed
        if all(v is not None for v in released_after.values()):
            break
    for _ in range(10):  # a late write to a freed block would land now
        tick(0.05, advance=0.0)
    out: dict[str, Any] = {}
    for name, (e, rid) in arms.items():
        held, free = before[name]["held"], before[name]["free"]
        out[name] = {
            "held_at_failure": held,
            "new_owner_blocks": len(free),
            "new_owner_bytes": len(free) * 2 * V.BLOCK * 32 * 2 * len(V.LAYERS),
            "new_owner_bytes_changed": V.bytes_changed(e, free),
            "late_bytes_in_held_blocks": V.bytes_changed_since(e, before[name]["content"], held),
            "held_bytes": len(held) * 2 * V.BLOCK * 32 * 2 * len(V.LAYERS),
            "held_bytes_from_prefill": V.bytes_matching(e, held, seed, remote[name])
            if held and remote.get(name)
            else None,
            "released_after_thaw_s": released_after[name],
            "still_held": rid in e.scheduler.requests,
        }
    return out


def pull(P: Prefill, clock: Any) -> dict[str, Any]:
    """Pull mode: the freeze, the healthy slow transfer, the abort while waiting, and
    what a resumed prefill's late READ does to the memory of the failed requests."""
    import vllm_engine as V

    plain = V.engine("kv_consumer", "D-plain", seed=21)
    guarded = V.engine(
        "kv_consumer", "D-sg", connector="StallguardNixlConnector", module_path=SG_MODULE, seed=22
    )
    unsafe = V.engine("kv_consumer", "D-unsafe", seed=23)
    engines = (plain, guarded, unsafe)
    sg = guarded.connector.stallguard
    deadline = sg.config.receiving
    held_deadline = sg.config.aborted_held
    base = {"plain": plain.free_blocks(), "guarded": guarded.free_blocks()}
    out: dict[str, Any] = {"deadline": deadline, "aborted_held_deadline": held_deadline}
    outputs: dict[str, list[Any]] = {}
    payloads: list[dict[str, Any]] = []  # guarded engine's connector stats, as shipped

    def run(e: Any, rid: str, params: dict[str, Any]) -> None:
        V.add(e, V.request(rid, V.decode_params(params), 4))

    def freeze_run(attempt: int) -> dict[str, Any]:
        rid = {
            k: f"{k}{'' if attempt == 1 else attempt}"
            for k in ("f-plain", "f-sg", "f-unsafe", "a-plain", "a-sg")
        }
        frozen = {k: P.prefill(rid[k]) for k in rid}
        P.freeze()
        real0 = time.monotonic()
        run(plain, rid["f-plain"], frozen["f-plain"])
        run(guarded, rid["f-sg"], frozen["f-sg"])
        run(unsafe, rid["f-unsafe"], frozen["f-unsafe"])
        run(plain, rid["a-plain"], frozen["a-plain"])
        run(guarded, rid["a-sg"], frozen["a-sg"])
        start = clock()
        trace: list[dict[str, Any]] = []
        aborted_at = None
        unsafe_failed_at = None
        blocks_sg: list[int] = []
        counts0 = dict(sg.counts)
        while clock() - start < 3 * deadline:
            tick()
            now = clock() - start
            if not blocks_sg and _status(guarded, rid["f-sg"]) == "WAITING_FOR_REMOTE_KVS":
                blocks_sg = guarded.block_ids(rid["f-sg"])
            if unsafe_failed_at is None and now >= 1 + deadline:
                _fail_the_old_way(unsafe, rid["f-unsafe"])
                unsafe_failed_at = now
            if aborted_at is None and now >= 2:
                for e, k in ((plain, "a-plain"), (guarded, "a-sg")):
                    e.scheduler.finish_requests([rid[k]], V.RequestStatus.FINISHED_ABORTED)
                aborted_at = now
            trace.append(
                {
                    "t": now,
                    "f-plain": _status(plain, rid["f-plain"]),
                    "f-sg": _status(guarded, rid["f-sg"]),
                    "f-unsafe": _status(unsafe, rid["f-unsafe"]),
                    "a-plain": rid["a-plain"] in plain.scheduler.requests,
                    "a-sg": rid["a-sg"] in guarded.scheduler.requests,
                    "held_plain": base["plain"] - plain.free_blocks(),
                    "held_sg": base["guarded"] - guarded.free_blocks(),
                    "in_flight_plain": _in_flight(plain, rid["f-plain"])
                    + _in_flight(plain, rid["a-plain"]),
                    "in_flight_sg": _in_flight(guarded, rid["f-sg"])
                    + _in_flight(guarded, rid["a-sg"]),
                    "in_flight_unsafe": _in_flight(unsafe, rid["f-unsafe"]),
                    "quarantined_sg": _held(sg),
                }
            )
        counts = {
            f"{k}/{p}": n - counts0.get((k, p), 0)
            for (k, p), n in sg.counts.items()
            if n - counts0.get((k, p), 0)
        }
        return {
            "real_seconds": time.monotonic() - real0,
            "aborted_at": aborted_at,
            "trace": trace,
            "outputs": {k: outputs.get(rid[k], []) for k in rid},
            "counts": counts,
            "heartbeat_engines_plain": list(
                plain.connector.connector_scheduler._heartbeat_by_engine
            ),
            "heartbeat_engines_sg": list(
                guarded.connector.connector_scheduler._heartbeat_by_engine
            ),
            "fault_held": all(
                r["f-plain"] == "WAITING_FOR_REMOTE_KVS" and r["a-plain"] for r in trace
            )
            and all(r["in_flight_unsafe"] >= 1 for r in trace if r["t"] < 1 + deadline),
            "blocks_sg": blocks_sg,
            "remote_blocks": {k: _remote_blocks(frozen[k]) for k in rid},
            "quarantine": {
                "holds": [
                    {"key": h.key, "peer": h.peer, "units": h.units, "nbytes": h.nbytes}
                    for h in (sg.quarantine.holds() if hasattr(sg, "quarantine") else ())
                ]
            },
            "rids": rid,
        }

    def tick(real: float = 0.05, advance: float = 1.0) -> None:
        clock.advance(advance)
        for e in engines:
            eco, _ = V.step(e)
            for v in eco.values():
                stats = getattr(v, "scheduler_stats", None)
                data = getattr(stats, "kv_connector_stats", None)
                if e is guarded and data and any(data.get(k) for k in SG_KEYS):
                    payloads.append({k: data[k] for k in SG_KEYS if data.get(k)})
                for o in v.outputs:
                    outputs.setdefault(o.request_id, []).append(
                        {
                            "finish": None if o.finish_reason is None else o.finish_reason.name,
                            "tokens": list(o.new_token_ids),
                            "at": clock(),
                        }
                    )
        time.sleep(real)

    # ---- warm-up: one healthy request per decode (handshakes done, agents connected)
    warm = ((plain, "warm-plain"), (guarded, "warm-sg"), (unsafe, "warm-unsafe"))
    for e, rid in warm:
        run(e, rid, P.prefill(rid))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60 and any(
        _status(e, r) != "FINISHED_LENGTH_CAPPED" for e, r in warm
    ):
        # stallguard's clock stands still during the warm-up: how many steps the
        # handshake and READ take depends on the machine's load (at load 60, more than
        # the 10 s deadline's worth, and the tracker ordered warm-sg failed just as its
        # READ completed)
        tick(advance=0.0)
    out["warm"] = {"plain": _status(plain, "warm-plain"), "guarded": _status(guarded, "warm-sg")}

    # ---- a healthy transfer slower than half the deadline: P frozen for 0.6 x deadline
    # (run again, once, if the READ did not stall: see the freeze below)
    for attempt in (1, 2):
        slow = f"slow{attempt}"
        params = P.prefill(slow)
        P.freeze()
        run(guarded, slow, params)
        start = clock()
        frozen_trace = []
        while clock() - start < 0.6 * deadline:
            tick()
            frozen_trace.append((_status(guarded, slow), _in_flight(guarded, slow)))
        slow_in_flight = max(n for _, n in frozen_trace)
        P.thaw()
        # stallguard's clock stands still from the thaw until the READ completes: how
        # long that takes in real time depends on the machine's load, not the transfer
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30 and _status(guarded, slow) == "WAITING_FOR_REMOTE_KVS":
            tick(0.02, advance=0.0)
        received_at = clock() - start
        for _ in range(int(2 * deadline)):  # well past the deadline: nothing may fire late
            tick(0.0)
        if slow_in_flight:
            break
    out["slow"] = {
        "attempts": attempt,
        "in_flight_while_frozen": slow_in_flight,
        "frozen_trace": frozen_trace,
        "received_after": received_at,
        "status": _status(guarded, slow),
        "outputs": outputs.get(slow, []),
        "forced": dict((f"{k}/{p}", n) for (k, p), n in sg.counts.items()),
    }

    # ---- the freeze: P frozen after its prefill, mid-READ. Before Prefill.freeze()
    # waited for every thread to stop, some READs to the "frozen" prefill completed on
    # the busy CI machine (docs/vllm.md); as a guard, a freeze that did not hold is run
    # once more with fresh requests. The attempts are reported.
    for attempt in (1, 2):
        freeze = freeze_run(attempt)
        if freeze["fault_held"]:
            break
        P.thaw()
        for _ in range(10):
            tick(0.05, advance=0.0)
    freeze["attempts"] = attempt
    out["freeze"] = freeze
    freeze.pop("blocks_sg")
    rids = freeze["rids"]

    # ---- the thaw: new owners for every block the allocator could hand out, then the
    # prefill resumes and its late READs complete
    remote = freeze["remote_blocks"]
    out["after_thaw"] = _stale_write_check(
        {"guarded": (guarded, rids["f-sg"]), "unsafe": (unsafe, rids["f-unsafe"])},
        P,
        tick,
        PULL_P_SEED,
        {"guarded": remote["f-sg"], "unsafe": remote["f-unsafe"]},
        lambda e, rid: rid not in e.scheduler.requests,
    )
    out["after_thaw"].update(
        {
            "a-sg_held": rids["a-sg"] in guarded.scheduler.requests,
            "a-plain_held": rids["a-plain"] in plain.scheduler.requests,
            "f-plain": _status(plain, rids["f-plain"]),
            "held_plain": base["plain"] - plain.free_blocks(),
            "held_sg": base["guarded"] - guarded.free_blocks(),
            "quarantine": _quarantine_view(sg),
        }
    )
    for _ in range(5):
        tick(0.05, advance=0.0)

    out["forced_total"] = {p: n for (k, p), n in sg.counts.items() if k == "forced"}
    out["stats_payloads"] = payloads
    out["prometheus"] = prometheus(guarded, payloads)
    return out


def _remote_blocks(params: dict[str, Any]) -> list[int]:
    """The prefill's block ids a decode reads, from its kv_transfer_params."""
    ids = params["remote_block_ids"]
    if ids and isinstance(ids[0], (list, tuple)):
        ids = ids[0]
    return [int(b) for b in ids]


def _held(sg: Any) -> int:
    """How many requests the tracker quarantines (0 for a stallguard-vllm without
    quarantine, so that these scenarios also run against an older adapter)."""
    return len(sg.quarantine) if hasattr(sg, "quarantine") else 0


def _quarantine_view(sg: Any) -> dict[str, Any] | None:
    if not hasattr(sg, "quarantine"):
        return None
    snap = sg.quarantine.snapshot()
    return {
        "holds": snap.holds,
        "units": snap.units,
        "nbytes": snap.nbytes,
        "released": dict(snap.released),
        "escalated": snap.escalated,
    }


def push(P: Prefill, clock: Any) -> dict[str, Any]:
    """Push mode: the decode registered its blocks and waits for the prefill's WRITE and
    notification; the prefill is frozen after a healthy warm-up request."""
    import vllm_engine as V

    plain = V.engine(
        "kv_consumer", "DP-plain", connector="NixlPushConnector", port=PUSH_D_PLAIN_PORT, seed=31
    )
    guarded = V.engine(
        "kv_consumer",
        "DP-sg",
        connector="StallguardNixlPushConnector",
        module_path=SG_MODULE,
        port=PUSH_D_SG_PORT,
        seed=32,
    )
    unsafe = V.engine(
        "kv_consumer",
        "DP-unsafe",
        connector="NixlPushConnector",
        port=PUSH_D_UNSAFE_PORT,
        seed=33,
    )
    engines = (plain, guarded, unsafe)
    sg = guarded.connector.stallguard
    deadline = sg.config.receiving
    base = {"plain": plain.free_blocks(), "guarded": guarded.free_blocks()}
    outputs: dict[str, list[Any]] = {}
    coords = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "PP",
        "remote_host": "127.0.0.1",
        "remote_port": PUSH_P_PORT,
        "tp_size": 1,
    }

    def tick(real: float = 0.05, advance: float = 1.0) -> None:
        clock.advance(advance)
        for e in engines:
            eco, _ = V.step(e)
            for v in eco.values():
                for o in v.outputs:
                    outputs.setdefault(o.request_id, []).append(
                        {"finish": None if o.finish_reason is None else o.finish_reason.name}
                    )
        time.sleep(real)

    # warm-up: decode registers first, then the prefill runs the same request id and
    # WRITEs into the registered blocks
    warm = ((plain, "w-plain"), (guarded, "w-sg"), (unsafe, "w-unsafe"))
    for e, rid in warm:
        V.add(e, V.request(rid, {**coords, "remote_request_id": rid}, 4))
    # (stallguard's clock stands still during the warm-up: its length depends on the
    # machine's load, and only the frozen request below is under test)
    for _ in range(5):
        tick(advance=0.0)
    for _, rid in warm:
        P.prefill(rid, "push")
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60 and any(
        _status(e, r) != "FINISHED_LENGTH_CAPPED" for e, r in warm
    ):
        tick(advance=0.0)
    out: dict[str, Any] = {
        "deadline": deadline,
        "warm": {"plain": _status(plain, "w-plain"), "guarded": _status(guarded, "w-sg")},
    }
    # the prefill freezes with the three requests queued: the decodes register their
    # blocks and wait; on thaw the prefill runs them and WRITEs into those blocks
    P.freeze()
    x = ((plain, "x-plain"), (guarded, "x-sg"), (unsafe, "x-unsafe"))
    for e, rid in x:
        V.add(e, V.request(rid, {**coords, "remote_request_id": rid}, 4))
    for _, rid in x:
        P.inq.put(("push", rid))
    start = clock()
    trace = []
    unsafe_failed_at = None
    while clock() - start < 3 * deadline:
        tick()
        now = clock() - start
        if unsafe_failed_at is None and now >= 1 + deadline:
            # the old stallguard: vLLM's failed-receive queue, blocks freed at once
            unsafe.worker.connector_worker._failed_recv_reqs.put("x-unsafe")
            unsafe_failed_at = now
        trace.append(
            {
                "t": now,
                "x-plain": _status(plain, "x-plain"),
                "x-sg": _status(guarded, "x-sg"),
                "x-unsafe": _status(unsafe, "x-unsafe"),
                "held_plain": base["plain"] - plain.free_blocks(),
                "held_sg": base["guarded"] - guarded.free_blocks(),
                "quarantined_sg": _held(sg),
            }
        )
    out["trace"] = trace
    out["outputs"] = {k: outputs.get(k, []) for k in ("x-plain", "x-sg", "x-unsafe")}
    out["counts"] = dict((f"{k}/{p}", n) for (k, p), n in sg.counts.items())
    out["after_thaw"] = _stale_write_check(
        {"guarded": (guarded, "x-sg"), "unsafe": (unsafe, "x-unsafe")},
        P,
        tick,
        PUSH_P_SEED,
        {},
        lambda e, rid: rid not in e.scheduler.requests,
    )
    for _ in range(3):  # the prefill's answers to the three pushes
        try:
            P.outq.get(timeout=10)
        except Exception:
            break
    out["after_thaw"]["quarantine"] = _quarantine_view(sg)
    out["after_thaw"]["held_sg"] = base["guarded"] - guarded.free_blocks()
    out["after_thaw"]["x-plain"] = _status(plain, "x-plain")
    return out


def prefill_hold(P: Prefill, clock: Any) -> dict[str, Any]:
    """The prefill side: blocks held for a decode that never reads them. vLLM's lease is
    set to 300 s (real time, not reached here); stallguard's HeldForRead deadline runs
    on the fake clock. A plain and a stallguard prefill engine, stepped side by side."""
    import vllm_engine as V

    extra = {"kv_lease_duration": 300}
    plain = V.engine("kv_producer", "PH-plain", extra=extra, port=PREFILL_PLAIN_PORT)
    guarded = V.engine(
        "kv_producer",
        "PH-sg",
        connector="StallguardNixlConnector",
        module_path=SG_MODULE,
        extra=extra,
        port=PREFILL_SG_PORT,
    )
    deadline = guarded.connector.stallguard.config.held_for_read
    base = {"plain": plain.free_blocks(), "guarded": guarded.free_blocks()}
    V.prefill(plain, "h-plain")
    V.prefill(guarded, "h-sg")
    start = clock()
    trace = []
    while clock() - start < 3 * deadline:
        clock.advance(1.0)
        for e in (plain, guarded):
            V.step(e)
        trace.append(
            {
                "t": clock() - start,
                "h-plain": "h-plain" in plain.scheduler.requests,
                "h-sg": "h-sg" in guarded.scheduler.requests,
                "held_plain": base["plain"] - plain.free_blocks(),
                "held_sg": base["guarded"] - guarded.free_blocks(),
            }
        )
        time.sleep(0.02)
    counts = guarded.connector.stallguard.counts
    return {
        "deadline": deadline,
        "trace": trace,
        "counts": dict((f"{k}/{p}", n) for (k, p), n in counts.items()),
    }


def peer_killed(P: Prefill, clock: Any) -> dict[str, Any]:
    """The peer proven gone: the prefill is frozen mid-READ, stallguard fails the decode
    request (quarantined), then the prefill process is SIGKILLed. NIXL reports the READ
    ``ERR`` (the remote disconnected), vLLM's poll ends it, and the quarantine releases
    the blocks with proof ``transfer_error``: nothing leaks. Kills P: run it last."""
    import vllm_engine as V

    e = V.engine(
        "kv_consumer", "D-k", connector="StallguardNixlConnector", module_path=SG_MODULE, seed=24
    )
    sg = e.connector.stallguard
    deadline = sg.config.receiving
    base = e.free_blocks()

    def tick(real: float = 0.05, advance: float = 1.0) -> list[str | None]:
        clock.advance(advance)
        eco, _ = V.step(e)
        time.sleep(real)
        return [
            None if o.finish_reason is None else o.finish_reason.name
            for v in eco.values()
            for o in v.outputs
        ]

    V.add(e, V.request("k-warm", V.decode_params(P.prefill("k-warm")), 4))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60 and _status(e, "k-warm") != "FINISHED_LENGTH_CAPPED":
        tick(advance=0.0)
    params = P.prefill("k-sg")
    P.freeze()
    V.add(e, V.request("k-sg", V.decode_params(params), 4))
    finishes: list[str | None] = []
    start = clock()
    while clock() - start < deadline + 3:
        finishes += tick()
    failed = {
        "status": _status(e, "k-sg"),
        "in_flight": _in_flight(e, "k-sg"),
        "held": base - e.free_blocks(),
        "quarantined": _held(sg),
        "finishes": [f for f in finishes if f is not None],
    }
    P.kill()
    killed = time.monotonic()
    released_after = None
    while time.monotonic() - killed < 30:
        tick(advance=0.0)
        if "k-sg" not in e.scheduler.requests:
            released_after = time.monotonic() - killed
            break
    return {
        "deadline": deadline,
        "failed": failed,
        "released_after_kill_s": released_after,
        "held_after": base - e.free_blocks(),
        "quarantine": _quarantine_view(sg),
    }


def badconfig(P: Prefill, clock: Any) -> dict[str, Any]:
    """A bad configuration file, as vLLM meets it: the engine's scheduler builds the
    stallguard connector (EngineCore does this at start-up), and vLLM loads the general
    plugins (EngineCore and workers do this first)."""
    import tempfile

    import vllm.plugins as vllm_plugins
    import vllm_engine as V

    bad = os.path.join(tempfile.mkdtemp(), "bad.toml")
    with open(bad, "w") as f:
        f.write("[decode]\nReceiving = -1\n")
    saved = os.environ["STALLGUARD_VLLM_CONFIG"]
    os.environ["STALLGUARD_VLLM_CONFIG"] = bad
    out: dict[str, Any] = {"path": bad}
    try:
        try:
            V.engine(
                "kv_consumer", "D-bad", connector="StallguardNixlConnector", module_path=SG_MODULE
            )
            out["connector"] = None
        except Exception as e:
            out["connector"] = f"{type(e).__name__}: {e}"
        vllm_plugins.plugins_loaded = False
        try:
            vllm_plugins.load_general_plugins()
            out["plugin"] = None
        except Exception as e:
            out["plugin"] = f"{type(e).__name__}: {e}"
    finally:
        os.environ["STALLGUARD_VLLM_CONFIG"] = saved
    # and with a good file, the plugin registers the connector names with vLLM
    vllm_plugins.plugins_loaded = False
    vllm_plugins.load_general_plugins()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    out["registered"] = sorted(n for n in KVConnectorFactory._registry if "Stallguard" in n)
    return out


def _span_recorder() -> Any:
    """An OpenTelemetry SDK with an in-memory exporter, as an operator's tracing setup
    would install one: stallguard's core emits its spans through the global provider."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


T0 = time.monotonic()


def run_all(config_path: str, which: list[str]) -> dict[str, Any]:
    os.environ["STALLGUARD_VLLM_CONFIG"] = config_path
    P = Prefill()
    try:
        import stallguard_vllm.connector as sgc
        import vllm_engine as V

        from stallguard.testing import FakeClock

        clock = FakeClock(1000.0)
        sgc.set_clock(clock)
        V.init_process(SCENARIO_INIT_PORT)
        spans = _span_recorder()
        out: dict[str, Any] = {"timing": {"start": time.monotonic() - T0}}
        for name in which:
            out[name] = SCENARIOS[name](P, clock)
            out["timing"][name] = time.monotonic() - T0
        out["spans"] = [
            {"name": sp.name, "attributes": dict(sp.attributes or {})}
            for sp in spans.get_finished_spans()
        ]
        return out
    finally:
        P.kill()


SCENARIOS = {
    "pull": pull,
    "push": push,
    "prefill_hold": prefill_hold,
    "badconfig": badconfig,
    "peer_killed": peer_killed,  # last: it kills the prefill process
}


def main() -> None:
    name, config_path, out_path = sys.argv[1:4]
    sys.path.insert(0, HERE)
    import vllm_engine as V

    # one model path for every process: it is part of NIXL's compatibility hash
    os.environ["TINY_MODEL_DIR"] = V.model_dir()
    try:
        result = {"ok": run_all(config_path, name.split(","))}
    except BaseException:
        result = {"error": traceback.format_exc()}
    with open(out_path, "w") as f:
        json.dump(result, f, default=str)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
