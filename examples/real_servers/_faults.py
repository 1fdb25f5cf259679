"""The fault matrix on real SGLang servers (docs/demo.md, "Real servers: the fault matrix").

    .venv/bin/python -m examples.real_servers faults [--out DIR] [--faults a,b,...]

Two server sets run side by side, one per arm, each an SGLang prefill and decode
(``python -m sglang.launch_server``, NIXL over UCX/TCP on loopback) behind its own Rust
``sglang-router``; the "with" arm's two servers have ``STALLGUARD_SGLANG_CONFIG``
(:data:`CONFIG`), nothing else differs. The faults run one after the other on the same
servers, both arms at once; for each, both servers' ``/metrics`` are scraped every
second (the prefill's bootstrap and inflight queues, the decode's prealloc and transfer
queues, the failure counters, stallguard's counter), and the clients' outcomes recorded:

``decode_frozen``
    the decode's process group SIGSTOPped while the prefill sends it a 2048-token
    prompt's KV (64 MB), at the placement the suite's test checks (``_main.Sync``: both
    arms between their first and last chunk); the prefill's inflight queue holds it (the
    seeds' incident).
``prefill_frozen_before_registration``
    the prefill's process group SIGSTOPped, then a request sent: the decode cannot
    register with the prefill's bootstrap server; its prealloc queue holds it.
``prefill_frozen_after_metadata``
    a 2048-token request; the prefill SIGSTOPped when it starts computing it (the decode
    has sent its KV indices, no KV has come back); the decode's transfer queue holds it.
``prefill_scheduler_frozen``
    only the prefill's scheduler process SIGSTOPped (its HTTP server and bootstrap server,
    in the launcher process, keep answering: a scheduler hung in a device call), then a
    512-token request sent: the decode registers, sends its KV indices and waits for KV
    that never comes. SGLang's decode heartbeats the prefill's bootstrap server, which
    answers, so nothing native notices.
``abort_storm``
    four 1024-token requests whose clients disconnect after 3 s (the router aborts
    their upstream requests): every queue must drain, and stallguard must count nothing.
``decode_killed``
    the decode's process group SIGKILLed mid-transfer of a 2048-token prompt; the
    decode is then started again on the same port, and the router must serve through it.

After each fault both arms must answer new requests. The observation point of a fault is
at the end of its window (the latest arm's entry + the deadline + 15 s); then the frozen
group gets SIGCONT. Results: ``faults.md`` (the table), ``faults.json``, ``faults.png``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._servers import (
    BACKEND_ENV,
    BACKENDS,
    PYTHON,
    ROOT,
    ServerSet,
    http,
    parse_metrics,
    server_env,
    spawn,
    wait_healthy,
)

#: the "with" arm's configuration. The prefill's deadlines start when the request enters
#: the inflight queue, after its forward passes: 20 s. The decode's start at its
#: pre-allocation and include the prefill's compute of the first chunk (up to ~30 s a
#: 512-token chunk at load 60-90 on 2 cores; 20 s failed a healthy request there): 60 s.
CONFIG = """\
# stallguard-sglang for the real-server fault matrix (examples/real_servers faults)
[prefill]
mode = "enforce"

[prefill.deadlines]
Bootstrapping = 60
WaitingForInput = {deadline}
Transferring = {deadline}

[decode]
mode = "enforce"

[decode.prealloc]
Bootstrapping = {decode_deadline}
WaitingForPrefill = {decode_deadline}
WaitingForInput = {decode_deadline}

[decode.transfer]
WaitingForInput = {decode_deadline}
Transferring = 180
"""

#: what is scraped: (server, key) -> metric name (summed over label sets)
METRICS = {
    ("prefill", "bootstrap"): "sglang:num_prefill_bootstrap_queue_reqs",
    ("prefill", "inflight"): "sglang:num_prefill_inflight_queue_reqs",
    ("prefill", "forced"): "sglang:stallguard_forced_failures_total",
    ("prefill", "transfer_failed"): "sglang:num_transfer_failed_reqs_total",
    ("prefill", "bootstrap_failed"): "sglang:num_bootstrap_failed_reqs_total",
    ("decode", "prealloc"): "sglang:num_decode_prealloc_queue_reqs",
    ("decode", "transfer"): "sglang:num_decode_transfer_queue_reqs",
    ("decode", "forced"): "sglang:stallguard_forced_failures_total",
    ("decode", "transfer_failed"): "sglang:num_transfer_failed_reqs_total",
    ("decode", "bootstrap_failed"): "sglang:num_bootstrap_failed_reqs_total",
}
COUNTERS = {"forced", "transfer_failed", "bootstrap_failed"}
#: how each fault is judged: "gauge" (the queue's gauge on /metrics: >= 1 without at the
#: observation point, 0 with), "counters" (no usable gauge: the client waiting and no
#: failure counted without), "native" (SGLang fails it on its own in both arms), "drain"
#: (every queue back to 0, nothing counted by stallguard), "report" (not judged)
EXPECT = {
    "decode_frozen": "gauge",
    "prefill_frozen_before_registration": "native",
    "prefill_frozen_after_metadata": "native",
    "prefill_scheduler_frozen": "counters",
    "abort_storm": "drain",
    "decode_killed": "report",
}
#: the keys of a scraped row ("prefill.inflight", ...)
METRICS_KEYS = tuple(f"{srv}.{key}" for srv, key in METRICS)

#: per fault: the queue that holds the request (server, key), the frozen/killed side
FAULTS: dict[str, tuple[tuple[str, str], str]] = {
    "decode_frozen": (("prefill", "inflight"), "decode"),
    "prefill_frozen_before_registration": (("decode", "prealloc"), "prefill"),
    "prefill_frozen_after_metadata": (("decode", "transfer"), "prefill"),
    "prefill_scheduler_frozen": (("decode", "transfer"), "prefill scheduler"),
    "abort_storm": (("prefill", "inflight"), ""),
    "decode_killed": (("prefill", "inflight"), "decode"),
}


def prompt(n: int, seed: int) -> list[int]:
    """n token ids, distinct per seed (no radix-cache hit across requests)."""
    return [(seed * 7919 + i * 31 + i * i) % 991 + 5 for i in range(n)]


@dataclass
class Client:
    """One request through the router in its own thread; *timeout* is the client's own
    limit (a short one is a client that disconnects)."""

    servers: ServerSet
    tokens: int
    seed: int
    timeout: float
    t0: float
    result: dict[str, Any] = field(default_factory=dict)
    thread: threading.Thread | None = None

    def start(self) -> Client:
        def go() -> None:
            body = {
                "input_ids": prompt(self.tokens, self.seed),
                "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            }
            status, text = http(
                "POST", self.servers.url("router") + "/generate", body, self.timeout
            )
            self.result.update(status=status, t_end_s=round(time.monotonic() - self.t0, 2))
            self.result["body"] = text[:400]

        self.thread = threading.Thread(target=go, daemon=True)
        self.thread.start()
        return self

    def waiting(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def outcome(self) -> dict[str, Any]:
        return dict(self.result) if self.result else {"status": None}


@dataclass
class Arm:
    name: str
    servers: ServerSet
    faults: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    seed: int = 10_000

    def next_seed(self) -> int:
        self.seed += 1
        return self.seed


def scrape(arm: Arm, t0: float) -> dict[str, float]:
    row: dict[str, float] = {"t": round(time.monotonic() - t0, 2)}
    for server in ("prefill", "decode"):
        proc = arm.servers.procs[server]
        status, text = (0, "")
        if proc.alive() and not proc.frozen:
            status, text = http("GET", arm.servers.url(server) + "/metrics", timeout=2)
        m = parse_metrics(text) if status == 200 else {}
        for (srv, key), name in METRICS.items():
            if srv != server:
                continue
            absent = 0.0 if m and key in COUNTERS else math.nan
            row[f"{srv}.{key}"] = m.get(name, absent) if m else math.nan
    return row


def small(arm: Arm, n: int = 16, timeout: float = 120.0) -> dict[str, Any]:
    c = Client(arm.servers, n, arm.next_seed(), timeout, time.monotonic()).start()
    assert c.thread is not None
    c.thread.join()
    return c.outcome()


def batch_lines(arm: Arm) -> int:
    return arm.servers.procs["prefill"].log_text().count("Prefill batch")


class Window:
    """The arms' shared timeline of one fault: one barrier, one end (the latest arm's)."""

    def __init__(self, parties: int) -> None:
        from ._main import Sync

        self.barrier = threading.Barrier(parties)
        self.lock = threading.Lock()
        self.ends: dict[str, float] = {}
        #: the fault's placement for ``decode_frozen`` (the rig's, see ``_main.Sync``)
        self.sync = Sync(parties, DECODE_FROZEN_CHUNKS, freeze_at=1)

    def wait(self) -> None:
        self.barrier.wait(timeout=900)

    def end(self, arm: str, at: float = 0.0) -> float:
        with self.lock:
            self.ends[arm] = max(at, self.ends.get(arm, 0.0))
            return max(self.ends.values())


def observe(
    arm: Arm,
    fault: str,
    t0: float,
    clients: list[Client],
    window: Window,
    deadline: float,
    at_least: float,
    rec: dict[str, Any],
    wait_entry: bool = False,
) -> None:
    """Scrape every second until the window ends: at least *at_least* s after t0, and
    deadline + 15 s after the request was first seen in its queue."""
    (server, key), _ = FAULTS[fault]
    window.end(arm.name, t0 + at_least)
    samples: list[dict[str, float]] = rec.setdefault("samples", [])
    while time.monotonic() < window.end(arm.name):
        if wait_entry and "entry_s" not in rec and time.monotonic() < t0 + 240:
            # not in its queue yet (the prefill still computing the prompt's chunks,
            # ~30 s each at load 60-90): the window waits for it, up to 240 s
            window.end(arm.name, time.monotonic() + 2)
        row = scrape(arm, t0)
        row["clients_waiting"] = float(sum(c.waiting() for c in clients))
        samples.append(row)
        if "entry_s" not in rec and row.get(f"{server}.{key}", 0) >= 1:
            rec["entry_s"] = row["t"]
            window.end(arm.name, min(t0 + row["t"] + deadline + 15, t0 + 3 * at_least + 60))
        time.sleep(1.0)
    obs = scrape_read(arm, t0, f"{server}.{key}")
    obs["clients_waiting"] = float(sum(c.waiting() for c in clients))
    rec["observation"] = obs


def scrape_read(arm: Arm, t0: float, key: str, limit: float = 30.0) -> dict[str, float]:
    """A scrape whose *key* was read (a busy server's ``/metrics`` can miss the 2 s
    scrape timeout: the observation of ``decode_frozen/with`` read NaN once, quiet
    machine), retried for up to *limit* s; a frozen server's page stays NaN."""
    deadline = time.monotonic() + limit
    row = scrape(arm, t0)
    server = key.split(".", 1)[0]
    while (
        math.isnan(row.get(key, math.nan))
        and not arm.servers.procs[server].frozen
        and time.monotonic() < deadline
    ):
        time.sleep(1.0)
        row = scrape(arm, t0)
    return row


def after_fault(arm: Arm, t0: float, clients: list[Client], rec: dict[str, Any]) -> None:
    """The clients' outcomes (bounded wait), the final scrape, then new requests."""
    limit = time.monotonic() + 120
    while any(c.waiting() for c in clients) and time.monotonic() < limit:
        row = scrape(arm, t0)
        row["clients_waiting"] = float(sum(c.waiting() for c in clients))
        rec["samples"].append(row)
        time.sleep(1.0)
    rec["clients"] = [c.outcome() for c in clients]
    rec["healthy_after"] = [small(arm, n) for n in (16, 512)]
    time.sleep(2)
    rec["final"] = scrape_read(arm, t0, "prefill.inflight")


# --------------------------------------------------------------------------- the faults


def _wait_chunks(arm: Arm, fault: str, before: int, n: int, client: Client) -> float:
    """Until the prefill logged *n* chunks since *before*; returns the seconds since the
    client's send."""
    while batch_lines(arm) - before < n:
        if time.monotonic() - client.t0 > 300 or not client.waiting():
            raise RuntimeError(f"{fault}: the prefill never reached chunk {n}: {client.outcome()}")
        time.sleep(0.02)
    return time.monotonic() - client.t0


def _placed_decode_freeze(arm: Arm, window: Window, rec: dict[str, Any]) -> Client:
    """The decode frozen at a checked placement, as in the suite's test (``_main.Sync``):
    both arms' prefills have logged the prompt's first chunk and neither its last, right
    before and :data:`~._main.RECHECK_S` after the SIGSTOP (the faster arm's prefill held
    until the other's first chunk). An attempt that fails the check is not frozen: its
    request completes, and the next one delays the faster arm's send. Returns the
    client of the placed attempt."""
    from ._main import ATTEMPTS

    sync, decode, prefill = window.sync, arm.servers.procs["decode"], arm.servers.procs["prefill"]
    attempts: list[dict[str, Any]] = rec.setdefault("attempts", [])
    for attempt in range(1, ATTEMPTS + 1):
        if not sync.wait():
            raise RuntimeError("decode_frozen: another arm gave up before the send")
        time.sleep(sync.delay.get(arm.name, 0.0))
        before = batch_lines(arm)
        client = Client(arm.servers, 2048, arm.next_seed(), 900, time.monotonic()).start()
        try:
            lead = _wait_chunks(arm, "decode_frozen", before, 1, client)
        except BaseException:
            sync.give_up()
            raise
        progress = lambda before=before: batch_lines(arm) - before  # noqa: E731
        placed = sync.arrive(arm.name, lead, progress, decode, prefill)  # type: ignore[arg-type]
        attempts.append({"attempt": attempt, "placed": placed, **sync.placement})
        if placed:
            return client
        assert client.thread is not None
        client.thread.join(timeout=600)  # not frozen: it completes
        rec.setdefault("unplaced", []).append(client.outcome())
    raise RuntimeError(f"decode_frozen: not placed in {ATTEMPTS} attempts: {attempts}")


def decode_frozen(arm: Arm, window: Window, deadline: float, killed: bool = False) -> None:
    fault = "decode_killed" if killed else "decode_frozen"
    rec = arm.faults.setdefault(fault, {})
    decode = arm.servers.procs["decode"]
    if killed:
        before = batch_lines(arm)
        client = Client(arm.servers, 2048, arm.next_seed(), 900, time.monotonic()).start()
        # the second chunk: the first one's KV posted
        _wait_chunks(arm, fault, before, 2, client)
        window.wait()
        decode.signal(9)
        t0 = time.monotonic()
    else:
        client = _placed_decode_freeze(arm, window, rec)
        t0 = window.sync.t0
    t_sent = client.t0
    client.t0 = t0
    rec["fault_after_send_s"] = round(t0 - t_sent, 2)
    observe(arm, fault, t0, [client], window, deadline, 30, rec, wait_entry=not killed)
    window.wait()
    if killed:
        rec["restart_s"] = round(time.monotonic() - t0, 2)
        restart_decode(arm, rec)
    else:
        decode.thaw()
        rec["thaw_s"] = round(time.monotonic() - t0, 2)
    after_fault(arm, t0, [client], rec)


def restart_decode(arm: Arm, rec: dict[str, Any]) -> None:
    """A new decode on the same port with the same flags and environment (a restarted
    pod); the router keeps the same URL. Waits for /health."""
    s = arm.servers
    s.procs["decode"].stop()
    config = s.stallguard_config if s.decode_stallguard else None
    s.procs["decode"] = spawn(
        f"{arm.name}-decode-restarted",
        s.server_argv("decode"),
        server_env(config, BACKEND_ENV[s.backend]),
        s.logs / f"{arm.name}-decode-restarted.log",
    )
    t = time.monotonic()
    while True:
        if not s.procs["decode"].alive():
            raise RuntimeError(f"{arm.name}: the restarted decode exited")
        if http("GET", s.url("decode") + "/health", timeout=3)[0] == 200:
            break
        if time.monotonic() - t > 600:
            raise TimeoutError(f"{arm.name}: the restarted decode not healthy in 600 s")
        time.sleep(3)
    rec["restarted_healthy_after_s"] = round(time.monotonic() - t, 1)


def prefill_frozen_before_registration(arm: Arm, window: Window, deadline: float) -> None:
    rec = arm.faults.setdefault("prefill_frozen_before_registration", {})
    prefill = arm.servers.procs["prefill"]
    window.wait()
    prefill.freeze()
    t0 = time.monotonic()
    client = Client(arm.servers, 512, arm.next_seed(), 900, t0).start()
    observe(arm, "prefill_frozen_before_registration", t0, [client], window, deadline, 20, rec)
    window.wait()
    prefill.thaw()
    rec["thaw_s"] = round(time.monotonic() - t0, 2)
    after_fault(arm, t0, [client], rec)


def prefill_frozen_after_metadata(arm: Arm, window: Window, deadline: float) -> None:
    rec = arm.faults.setdefault("prefill_frozen_after_metadata", {})
    prefill = arm.servers.procs["prefill"]
    before = batch_lines(arm)
    t_sent = time.monotonic()
    client = Client(arm.servers, 2048, arm.next_seed(), 900, t_sent).start()
    while batch_lines(arm) - before < 1:  # computing: bootstrapped, no KV sent yet
        if time.monotonic() - t_sent > 300 or not client.waiting():
            raise RuntimeError(f"the prefill never started the request: {client.outcome()}")
        time.sleep(0.02)
    prefill.freeze()  # at once: the first chunk's KV is not computed yet
    t0 = time.monotonic()
    client.t0 = t0
    rec["fault_after_send_s"] = round(t0 - t_sent, 2)
    window.wait()
    observe(arm, "prefill_frozen_after_metadata", t0, [client], window, deadline, 20, rec)
    window.wait()
    prefill.thaw()
    rec["thaw_s"] = round(time.monotonic() - t0, 2)
    after_fault(arm, t0, [client], rec)


def scheduler_pids(arm: Arm, server: str) -> list[int]:
    """The pids of *server*'s scheduler processes (process title ``sglang::scheduler``,
    in the server's process group)."""
    pgid = arm.servers.procs[server].pgid
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            comm = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[2]) == pgid and comm.startswith(b"sglang::sched"):
            pids.append(int(pid))
    return pids


def prefill_scheduler_frozen(arm: Arm, window: Window, deadline: float) -> None:
    rec = arm.faults.setdefault("prefill_scheduler_frozen", {})
    pids = scheduler_pids(arm, "prefill")
    if not pids:
        raise RuntimeError("no sglang::scheduler process in the prefill's group")
    rec["frozen_pids"] = pids
    window.wait()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        client = Client(arm.servers, 512, arm.next_seed(), 900, t0).start()
        # the decode's queue gauges are refreshed only when it logs a batch (never while
        # it idles), so the window is not extended from a gauge: deadline + 15 s
        observe(arm, "prefill_scheduler_frozen", t0, [client], window, 0, deadline + 15, rec)
        window.wait()
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    rec["thaw_s"] = round(time.monotonic() - t0, 2)
    after_fault(arm, t0, [client], rec)


def abort_storm(arm: Arm, window: Window, deadline: float) -> None:
    rec = arm.faults.setdefault("abort_storm", {})
    window.wait()
    t0 = time.monotonic()
    clients = [Client(arm.servers, 1024, arm.next_seed(), 3.0, t0).start() for _ in range(4)]
    observe(arm, "abort_storm", t0, clients, window, 0.0, 30, rec)
    window.wait()
    after_fault(arm, t0, clients, rec)


#: chunks of ``decode_frozen``'s 2048-token prompt (``--chunked-prefill-size 512``)
DECODE_FROZEN_CHUNKS = 4

#: fault -> runner(arm, window, prefill deadline, decode deadline)
RUNNERS: dict[str, Callable[[Arm, Window, float, float], None]] = {
    "decode_frozen": lambda arm, w, d, dd: decode_frozen(arm, w, d),
    "prefill_frozen_before_registration": lambda arm, w, d, dd: prefill_frozen_before_registration(
        arm, w, dd
    ),
    "prefill_frozen_after_metadata": lambda arm, w, d, dd: prefill_frozen_after_metadata(
        arm, w, dd
    ),
    "prefill_scheduler_frozen": lambda arm, w, d, dd: prefill_scheduler_frozen(arm, w, dd),
    "abort_storm": lambda arm, w, d, dd: abort_storm(arm, w, d),
    "decode_killed": lambda arm, w, d, dd: decode_frozen(arm, w, d, killed=True),
}


def run_matrix(
    out: Path,
    *,
    deadline: float = 20.0,
    decode_deadline: float = 60.0,
    faults: tuple[str, ...] = tuple(FAULTS),
    backend: str = "nixl",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Start both arms (both servers on *backend*: ``nixl`` or ``mooncake``), run
    *faults* in order on them, stop everything; returns what faults.json holds."""
    from ._main import ready_router

    out.mkdir(parents=True, exist_ok=True)
    config = out / "stallguard-sglang-faults.toml"
    config.write_text(CONFIG.format(deadline=deadline, decode_deadline=decode_deadline))
    t_all = time.monotonic()
    arms = [
        Arm("without", ServerSet("without", out / "logs", None, backend=backend)),
        Arm("with", ServerSet("with", out / "logs", config, backend=backend)),
    ]
    try:
        for a in arms:
            a.servers.start_servers()
        log("fault matrix: both arms' prefill + decode started, waiting for /health")
        wait_healthy([a.servers for a in arms])
        for a in arms:
            a.servers.start_router()
        for a in arms:
            from ._main import Arm as MainArm

            ready_router(MainArm(a.name, a.servers))
        for fault in faults:
            log(f"fault matrix: {fault}")
            window = Window(len(arms))

            def one(a: Arm, fault: str = fault, window: Window = window) -> None:
                try:
                    RUNNERS[fault](a, window, deadline, decode_deadline)
                except BaseException as e:
                    a.errors.append(f"{fault}: {type(e).__name__}: {e}")
                    window.barrier.abort()
                    window.sync.give_up()

            threads = [threading.Thread(target=one, args=(a,)) for a in arms]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for a in arms:
                a.servers.procs["prefill"].thaw()
                if a.servers.procs["decode"].alive():
                    a.servers.procs["decode"].thaw()
            if any(a.errors for a in arms):
                log(f"fault matrix: stopped after {fault}: {[a.errors for a in arms]}")
                break
    finally:
        for a in arms:
            a.servers.stop()
    results = {
        "deadline_s": deadline,
        "decode_deadline_s": decode_deadline,
        "backend": backend,
        "total_s": round(time.monotonic() - t_all, 1),
        "faults": list(faults),
        "arms": {
            a.name: {
                "healthy_after": a.servers.healthy_after,
                "faults": a.faults,
                "errors": a.errors,
            }
            for a in arms
        },
    }
    (out / "faults.json").write_text(json.dumps(results, indent=1))
    return results


# --------------------------------------------------------------------------- reporting


def delta(rec: dict[str, Any], key: str) -> float:
    """How much counter *key* ("prefill.forced") moved during the fault."""
    rows = [r for r in rec.get("samples", []) if not math.isnan(r.get(key, math.nan))]
    final = rec.get("final", {}).get(key, math.nan)
    if not rows:
        return math.nan
    last = final if not math.isnan(final) else rows[-1][key]
    return float(last - rows[0][key])


def released_at(rec: dict[str, Any], key: str) -> float | None:
    entry = rec.get("entry_s")
    if entry is None:
        return None
    for r in rec.get("samples", []):
        if r["t"] > entry and r.get(key) == 0:
            return float(r["t"])
    return None


def fmt(x: Any) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:g}" if isinstance(x, float) else str(x)


def table(results: dict[str, Any]) -> str:
    head = [
        "fault", "arm", "queue holding it", "in it from", "released at", "at obs.",
        "stallguard failed (P/D)", "SGLang failed (P/D)", "frozen/killed until",
        "clients", "new requests after",
    ]  # fmt: skip
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for fault in results["faults"]:
        (server, key), _side = FAULTS[fault]
        q = f"{server}.{key}"
        for name, a in results["arms"].items():
            rec = a["faults"].get(fault)
            if not rec:
                continue
            obs = rec.get("observation", {})
            clients = ", ".join(
                f"{c.get('status') or 'none'}@+{fmt(c.get('t_end_s'))}s"
                for c in rec.get("clients", [])
            )
            sg = f"{fmt(delta(rec, 'prefill.forced'))}/{fmt(delta(rec, 'decode.forced'))}"
            nat_p = delta(rec, "prefill.transfer_failed") + delta(rec, "prefill.bootstrap_failed")
            nat_d = delta(rec, "decode.transfer_failed") + delta(rec, "decode.bootstrap_failed")
            native = f"{fmt(nat_p)}/{fmt(nat_d)}"
            rel = released_at(rec, q)
            until = rec.get("thaw_s", rec.get("restart_s"))
            ha = rec.get("healthy_after", [])
            rows.append(
                f"| {fault} | {name} | `{q}` | +{fmt(rec.get('entry_s'))} s "
                f"| {'no' if rel is None else '+' + fmt(rel) + ' s'} "
                f"| {fmt(obs.get(q))} | {sg} | {native} | +{fmt(until)} s | {clients} "
                f"| {sum(r.get('status') == 200 for r in ha)}/{len(ha)} |"
            )
    rows.append("")
    rows.append(
        f"Deadline {results['deadline_s']:g} s. Times are seconds after the fault. "
        "'released at': first scrape with the queue back at 0 after the request was in it. "
        "Counters are the change over the fault on each server's own /metrics (P/D). "
        f"Total {results['total_s']:g} s."
    )
    return "\n".join(rows)


def verdict(results: dict[str, Any]) -> list[str]:
    """What did not happen as documented (empty: all as expected)."""
    bad: list[str] = []
    arms = results["arms"]
    for name, a in arms.items():
        bad += [f"{name}: {e}" for e in a["errors"]]
    for fault in results["faults"]:
        (server, key), _ = FAULTS[fault]
        q = f"{server}.{key}"
        w = arms.get("without", {}).get("faults", {}).get(fault)
        g = arms.get("with", {}).get("faults", {}).get(fault)
        if not w or not g:
            continue
        for name, rec in (("without", w), ("with", g)):
            ha = rec.get("healthy_after", [])
            if not ha or not all(r.get("status") == 200 for r in ha):
                bad.append(f"{fault}/{name}: new requests after the fault failed: {ha}")
        if fault == "abort_storm":
            for name, rec in (("without", w), ("with", g)):
                fin = rec.get("final", {})
                if any(
                    fin.get(k, 0)
                    for k in ("prefill.inflight", "decode.prealloc", "decode.transfer")
                ):
                    bad.append(f"abort_storm/{name}: a queue did not drain: {fin}")
            if delta(g, "prefill.forced") or delta(g, "decode.forced"):
                bad.append("abort_storm/with: stallguard counted a failure for aborted requests")
            continue
        expect = EXPECT[fault]
        if expect == "report":
            continue  # what SGLang does natively is the finding; reported, not judged
        if expect == "native":
            # the whole prefill group frozen: SGLang's decode heartbeats the prefill's
            # bootstrap server and fails the request ("Lost connection with prefill
            # instance") on its own, in both arms
            for name, rec in (("without", w), ("with", g)):
                if not native(rec, "decode") >= 1:
                    bad.append(f"{fault}/{name}: SGLang's decode did not fail it")
            continue
        if expect == "counters":
            # no decode queue gauge to read (refreshed only when the decode logs a
            # batch): pinned = the client still waiting, nothing counted on either side
            if not w.get("observation", {}).get("clients_waiting", 0) >= 1:
                bad.append(f"{fault}/without: the client was not waiting at the observation point")
            moved = [k for k in ("prefill", "decode") if native(w, k) or delta(w, f"{k}.forced")]
            if moved:
                bad.append(f"{fault}/without: a failure was counted on {moved} (no wedge)")
        else:
            if not w.get("observation", {}).get(q, 0) >= 1:
                bad.append(f"{fault}/without: {q} not >= 1 at the observation point (no wedge)")
            if g.get("observation", {}).get(q) != 0:
                bad.append(f"{fault}/with: {q} not 0 at the observation point")
        if not (delta(g, f"{server}.forced") >= 1):
            bad.append(f"{fault}/with: no stallguard failure counted on the {server}")
    return bad


def native(rec: dict[str, Any], server: str) -> float:
    """SGLang's own failure counters' change over the fault on *server* (0 when absent)."""
    total = 0.0
    for key in ("transfer_failed", "bootstrap_failed"):
        d = delta(rec, f"{server}.{key}")
        total += 0.0 if math.isnan(d) else d
    return total


def picture(results: dict[str, Any], path: Path) -> bool:
    """One panel per fault: the queue holding the request, per arm, over time, the
    fault's span shaded, each client's outcome marked where it ended."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    faults = [
        f for f in results["faults"] if any(f in a["faults"] for a in results["arms"].values())
    ]
    if not faults:
        return False
    fig, axes = plt.subplots(len(faults), 1, figsize=(9, 2.1 * len(faults)), squeeze=False)
    colors = {"without": "tab:red", "with": "tab:blue"}
    for ax, fault in zip(axes[:, 0], faults, strict=True):
        (server, key), side = FAULTS[fault]
        q = f"{server}.{key}"
        span = None
        for name, a in results["arms"].items():
            rec = a["faults"].get(fault)
            if not rec:
                continue
            s = rec.get("samples", [])
            ax.step(
                [r["t"] for r in s],
                [r.get(q, math.nan) for r in s],
                where="post",
                color=colors[name],
                lw=3.0 if name == "without" else 1.6,
                label=f"{name} stallguard: {q}",
            )
            ax.step(
                [r["t"] for r in s],
                [r.get("clients_waiting", math.nan) for r in s],
                where="post",
                color=colors[name],
                lw=0.9,
                ls="--",
                label=f"{name}: clients waiting",
            )
            for c in rec.get("clients", []):
                if c.get("t_end_s") is None:
                    continue
                ok = c.get("status") == 200
                ax.plot(
                    c["t_end_s"],
                    -0.25 if name == "without" else -0.45,
                    marker="o" if ok else "x",
                    color=colors[name],
                    ms=6,
                    ls="none",
                )
            span = span or rec.get("thaw_s") or rec.get("restart_s")
        if span and side:
            ax.axvspan(
                0,
                span,
                color="0.9",
                zorder=0,
                label=f"{side} {'killed' if 'killed' in fault else 'frozen'}",
            )
        ax.axvline(results["deadline_s"], color="k", ls=":", lw=0.8)
        ax.set_title(
            f"{fault}  (o: client 200, x: client error, at the time it returned)", fontsize=8
        )
        ax.set_ylabel("requests", fontsize=8)
        ax.set_ylim(-0.6, None)
        ax.legend(loc="upper right", fontsize=6)
    axes[-1, 0].set_xlabel("seconds since the fault (dotted: the deadline)")
    fig.suptitle(
        "real SGLang 0.5.23 PD servers + sglang-router: queues from their /metrics", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m examples.real_servers faults")
    p.add_argument("--out", type=Path, default=Path("real_servers_out"))
    p.add_argument("--deadline", type=float, default=20.0)
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument(
        "--backend",
        default="nixl",
        help=f"KV transfer backend of the servers: {', '.join(BACKENDS)} (Mooncake over TCP)",
    )
    args = p.parse_args(argv)
    if args.backend not in BACKENDS:
        p.error(f"--backend {args.backend!r}: must be one of {', '.join(BACKENDS)}")
    names = tuple(f for f in args.faults.split(",") if f)
    unknown = [f for f in names if f not in FAULTS]
    if unknown:
        p.error(f"--faults: unknown fault(s) {', '.join(unknown)}; known: {', '.join(FAULTS)}")
    if not PYTHON.exists():
        print(f"{PYTHON} is missing: run `python3 tools/dev.py env` (it builds .venv-realsrv)")
        return 2
    out = args.out.resolve()
    results = run_matrix(
        out,
        deadline=args.deadline,
        faults=names,
        backend=args.backend,
        log=lambda m: print(f"[real_servers] {m}", flush=True),
    )
    text = table(results)
    (out / "faults.md").write_text(text + "\n")
    print(text)
    if picture(results, out / "faults.png"):
        print(f"picture: {out / 'faults.png'}")
    bad = verdict(results)
    for b in bad:
        print(f"NOT OK: {b}")
    print(f"outputs in {out} (logs/, faults.json)")
    return 1 if bad else 0


__all__ = ["FAULTS", "METRICS_KEYS", "ROOT", "main", "run_matrix", "table", "verdict"]
