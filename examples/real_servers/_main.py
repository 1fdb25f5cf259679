"""The seeds' incident on real servers: a decode frozen while the prefill sends it a big
KV cache, without and with stallguard-sglang (docs/demo.md, "Real servers").

    .venv/bin/python -m examples.real_servers [--out DIR] [--observe S] [--sequential]

Per arm, three real processes groups: an SGLang prefill and decode
(``python -m sglang.launch_server``, NIXL over UCX/TCP on loopback) and the Rust
``sglang-router`` in PD mode in front, with a client talking only to the router. The two
arms differ in one environment variable of the two servers, ``STALLGUARD_SGLANG_CONFIG``
(docs/sglang.md, "Enable"). Timeline of one arm:

1. start prefill + decode and the router at once, poll ``/health``; a small request
   through the router until it answers (the router registers its workers once healthy;
   the first PD request wires NIXL up);
2. ``healthy-before``: one more small request;
3. the fault: a 2048-token request (64 MB of KV: 8 layers x 4 KV heads x 256 x fp16 x 2)
   is prefilled in 4 chunks of 512, each chunk's KV sent to decode after its forward
   pass; SGLang logs "Prefill batch" after each pass. The decode's whole process group
   is SIGSTOPped when the prefill logged ``--freeze-at-chunk`` chunks (it is
   bootstrapped with the decode) and not its last one (checked again a second after the
   freeze: the last chunk's KV goes to a frozen decode; see ``Sync``). Time 0 is that
   moment;
4. the observation window, event-driven: the prefill's ``/metrics`` is scraped every
   second (``sglang:num_prefill_inflight_queue_reqs``, stallguard's counter and its
   oldest age per state, ``sglang:num_transfer_failed_reqs_total``) until the request
   has been in the inflight queue for 2 x the deadline (and, with stallguard, its
   failure was counted), at least ``--observe`` s; the client keeps waiting;
5. the observation point at the end of the window; then SIGCONT;
6. the client's outcome (bounded wait), then ``healthy-after``: a small request and a
   fresh 256-token prompt that must succeed on the same servers.

Exit status 0 when the "without" arm reproduced the wedge (inflight >= 1 at the
observation point, past the deadline) and the "with" arm released it (stallguard failed
the request within a few seconds of its deadline, inflight back to 0, no healthy
request failed); 1 otherwise; 2 when the environment is missing (.venv-realsrv).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._servers import (
    BACKENDS,
    PYTHON,
    ROOT,
    Proc,
    ServerDied,
    ServerSet,
    group_processes,
    http,
    parse_metrics,
    parse_series,
    plugin_trace,
    stop_all,
    wait_healthy,
)

#: The "with" arm's configuration: short demo deadlines on prefill (the side guarded in
#: this fault), long ones on decode (which must outlast the prefill's ~20 s of compute
#: for this prompt on 2 busy cores).
CONFIG = """\
# stallguard-sglang for the real-server rig (examples/real_servers)
[prefill]
mode = "enforce"

[prefill.deadlines]
Bootstrapping = 60
WaitingForInput = {deadline}
Transferring = {deadline}

[decode]
mode = "enforce"

[decode.prealloc]
Bootstrapping = 180
WaitingForPrefill = 180
WaitingForInput = 180

[decode.transfer]
WaitingForInput = 180
Transferring = 180
"""

GAUGES = {
    "inflight": "sglang:num_prefill_inflight_queue_reqs",
    "bootstrap": "sglang:num_prefill_bootstrap_queue_reqs",
    "forced": "sglang:stallguard_forced_failures_total",
    "transfer_failed": "sglang:num_transfer_failed_reqs_total",
}

COUNTERS = ("forced", "transfer_failed")

#: stallguard-sglang's own gauge of the oldest request's age per state (its queue loop
#: exports it about once a second; docs/advice.md): read for the "inflight" queue
OLDEST_AGE = "sglang:stallguard_oldest_age_seconds"

PROMPT_TOKENS = 2048
CHUNK = 512
FREEZE_AT_CHUNK = 1
#: attempts at placing the fault before a run gives up (see :class:`Sync`)
ATTEMPTS = 3
#: seconds after the freeze at which the placement is checked again: a last chunk logged
#: by then may have been posted before the freeze (SGLang posts a chunk's KV a few ms
#: before it logs the chunk); a 512-token chunk takes ~0.4 s on an idle machine, so with
#: 4 chunks and the freeze at the first, 3 chunks (~1.2 s and more) are still to come
RECHECK_S = 0.5


def prompt(n: int, seed: int) -> list[int]:
    """n distinct-enough token ids (no radix-cache hit across seeds)."""
    return [(seed * 7919 + i * 31 + i * i) % 991 + 5 for i in range(n)]


def generate(s: ServerSet, n: int, seed: int, timeout: float) -> dict[str, Any]:
    body = {
        "input_ids": prompt(n, seed),
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
    }
    t0 = time.monotonic()
    status, text = http("POST", s.url("router") + "/generate", body, timeout=timeout)
    return {
        "tokens": n,
        "status": status,
        "latency_s": round(time.monotonic() - t0, 2),
        "t_end": time.monotonic(),
        "body": text[:600],
    }


def group_rss_mb(pgid: int) -> float:
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:
                continue
            total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    return total / 2**20


@dataclass
class Arm:
    name: str
    servers: ServerSet
    samples: list[dict[str, float]] = field(default_factory=list)
    events: dict[str, Any] = field(default_factory=dict)
    requests: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    fault: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def scrape(arm: Arm, t0: float) -> dict[str, float]:
    """One scrape of the arm's prefill ``/metrics``: SGLang's queue gauges and failure
    counter, stallguard's counter, and stallguard's oldest age in the inflight queue
    (``sg_oldest``, the largest over its states; ``sg_state`` names the state, as an
    index into :data:`SG_STATES`, -1 for none). NaN: the page could not be read."""
    status, text = http("GET", arm.servers.url("prefill") + "/metrics", timeout=3)
    row: dict[str, float] = {"t": round(time.monotonic() - t0, 2)}
    nan = float("nan")
    if status != 200:
        row.update({k: nan for k in (*GAUGES, "sg_oldest", "sg_state")})
        return row
    m = parse_metrics(text)
    for key, name in GAUGES.items():
        # a counter without a sample yet is 0 (prometheus_client exports a labelled
        # counter only once it was incremented)
        row[key] = m.get(name, 0.0 if key in COUNTERS else nan)
    oldest, state = 0.0, -1.0
    for name, labels, value in parse_series(text):
        if name == OLDEST_AGE and labels.get("queue") == "inflight" and value > oldest:
            oldest = value
            st = labels.get("state", "")
            state = float(SG_STATES.index(st)) if st in SG_STATES else -1.0
    row["sg_oldest"], row["sg_state"] = oldest, state
    return row


#: the KVPoll states stallguard's inflight lane labels its series with
SG_STATES = ("Bootstrapping", "WaitingForInput", "Transferring", "Success", "Failed")


def ready_router(arm: Arm, timeout: float = 180.0) -> None:
    """Small requests through the router until one answers 200 (the router registers its
    workers once it saw them healthy; the first PD request wires NIXL up)."""
    deadline = time.monotonic() + timeout
    tries: list[dict[str, Any]] = []
    seed = 1000
    router = arm.servers.procs["router"]
    while time.monotonic() < deadline:
        if not router.alive():
            raise ServerDied(router)
        seed += 1
        r = generate(arm.servers, 16, seed, timeout=120)
        tries.append(r)
        if r["status"] == 200:
            arm.requests["warmup"] = tries[-1:]
            arm.events["router_ready_tries"] = len(tries)
            return
        time.sleep(1)
    raise TimeoutError(f"{arm.name}: router never answered 200: {tries[-1]}")


def prefill_batch_lines(arm: Arm) -> int:
    return arm.servers.procs["prefill"].log_text().count("Prefill batch")


def chunks_since(arm: Arm, before: int) -> int:
    """Forward passes the prefill logged since it had logged *before*."""
    return prefill_batch_lines(arm) - before


class Sync:
    """Places the fault, for one arm or for the arms that share one decode, and keeps
    their timeline: one freeze, one observation window (the latest arm's end), one thaw.

    The placement is what makes a run prove something. A prompt of *chunks* chunks is
    prefilled one chunk per forward pass, and SGLang logs "Prefill batch" after each
    pass; a request is batched only once bootstrapped with its decode (optimistic
    prefill is off by default), and enters the prefill's inflight queue after its last
    pass, when its last chunk's KV is sent. So the freeze is placed when every arm
    logged at least *freeze_at* chunks of its prompt (bootstrapped: the decode has its
    KV indices) and none has logged its last one (its last chunk's KV cannot have
    reached the decode before the freeze): every arm's request then enters the inflight
    queue with KV to send to a frozen decode. The check runs in the barrier's action,
    right before the SIGSTOP and :data:`RECHECK_S` after it (SGLang posts a last chunk's
    KV a few ms before it logs the chunk: a last chunk logged that soon after the freeze
    may have been posted before it, and the attempt is thawed and not counted). If an
    arm finished its prompt before another one got to its first chunk (the arms run on
    two prefills sharing two cores: their pace differs), the attempt is not frozen: the
    requests complete, and the next attempt delays the faster arm's send by its
    measured lead.

    An arm that arrives before the others is *held*: its prefill's process group is
    SIGSTOPped at once (it has logged *freeze_at* chunks, so it is bootstrapped; a held
    prefill makes no progress towards its last chunk) and SIGCONTed right after the
    decode's freeze, or when the attempt is given up. On an idle machine a 512-token
    chunk takes about 0.4 s and the arms' leads differ by as much, so without the hold
    the faster arm often logged its last chunk while the slower one was still before its
    first, in every attempt (CI, 2026-12-02: 3 attempts out of 3); the hold makes the
    placement independent of the arms' relative pace. Holding a prefill for a moment
    before its request reaches the inflight queue changes nothing the run measures (the
    request's time in the inflight queue starts after its last chunk).
    """

    def __init__(self, parties: int, chunks: int = 0, freeze_at: int = 1) -> None:
        self.chunks = chunks
        self.freeze_at = freeze_at
        self.lock = threading.Lock()
        self.ends: dict[str, float] = {}
        self.arrivals: dict[str, tuple[float, Callable[[], int], Proc]] = {}
        #: prefills held (SIGSTOPped) until the others arrive: arm -> (process, since)
        self.held: dict[str, tuple[Proc, float]] = {}
        self.placed = False
        self.placement: dict[str, Any] = {}
        self.t0 = 0.0
        #: seconds each arm delays its send in the next attempt
        self.delay: dict[str, float] = {}
        self.barrier = threading.Barrier(parties)
        self.decision = threading.Barrier(parties, action=self._decide)

    def wait(self) -> bool:
        """Wait for the other arms (False: one of them gave up)."""
        try:
            self.barrier.wait(timeout=900)
            return True
        except threading.BrokenBarrierError:
            return False

    def arrive(
        self,
        arm: str,
        lead: float,
        progress: Callable[[], int],
        decode: Proc,
        prefill: Proc | None = None,
    ) -> bool:
        """*arm* logged ``freeze_at`` chunks *lead* s after its send; *progress* counts
        its chunks logged so far; *prefill*, if given, is held while the other arms have
        not arrived yet. Returns whether the fault was placed (the decode is frozen);
        raises BrokenBarrierError if an arm gave up."""
        with self.lock:
            self.arrivals[arm] = (lead, progress, decode)
            waiting = len(self.arrivals) < self.decision.parties
            if prefill is not None and waiting and progress() < self.chunks:
                prefill.freeze()
                self.held[arm] = (prefill, time.monotonic())
        try:
            self.decision.wait(timeout=900)
        finally:
            self._release_held()  # the barrier broke: nothing stays stopped
        return self.placed

    def _release_held(self) -> dict[str, float]:
        """SIGCONT every held prefill; returns how long each was held (s)."""
        with self.lock:
            held, self.held = self.held, {}
        now = time.monotonic()
        for proc, _ in held.values():
            proc.thaw()
        return {a: round(now - since, 2) for a, (_, since) in held.items()}

    def _decide(self) -> None:
        counts = {a: p() for a, (_, p, _) in self.arrivals.items()}
        ok = all(self.freeze_at <= c < self.chunks for c in counts.values())
        decodes = {d.pgid: d for _, _, d in self.arrivals.values()}
        after: dict[str, int] = {}
        if ok:
            for d in decodes.values():
                d.freeze()
            self.t0 = time.monotonic()
        held = self._release_held()  # after the freeze: the held arm's rest goes to it
        if ok:
            # SGLang posts a last chunk's KV a few ms before it logs that chunk: a last
            # chunk logged within a second after the freeze may have been posted before
            # it (a chunk's forward pass takes seconds; the post-to-log gap is ms)
            time.sleep(RECHECK_S)
            after = {a: p() for a, (_, p, _) in self.arrivals.items()}
            if any(c >= self.chunks for c in after.values()):
                for d in decodes.values():  # raced with a last chunk: not certain
                    d.thaw()
                ok = False
        leads = {a: round(lead, 2) for a, (lead, _, _) in self.arrivals.items()}
        self.placement = {
            "chunks": counts,
            "chunks_after_freeze": after,
            "leads_s": leads,
            "held_s": held,
        }
        self.placed = ok
        if not ok:
            slowest = max(leads.values())
            self.delay = {a: slowest - lead for a, lead in leads.items()}
        self.arrivals.clear()

    def give_up(self) -> None:
        self.barrier.abort()
        self.decision.abort()
        self._release_held()

    def end(self, arm: str, at: float = 0.0) -> float:
        """Record *arm*'s wanted end of the window; returns the end of the window."""
        with self.lock:
            self.ends[arm] = max(at, self.ends.get(arm, 0.0))
            return max(self.ends.values())


def run_fault(
    arm: Arm,
    observe: float,
    thaw_wait: float,
    deadline: float,
    sync: Sync | None = None,
    prompt_tokens: int = PROMPT_TOKENS,
    freeze_at_chunk: int = FREEZE_AT_CHUNK,
) -> None:
    """The decode frozen mid-transfer, for one arm (runs in its own thread)."""
    chunks = math.ceil(prompt_tokens / arm.servers.chunked_prefill_size)
    sync = sync or Sync(1, chunks, freeze_at_chunk)
    if not sync.chunks:
        sync.chunks, sync.freeze_at = chunks, freeze_at_chunk
    try:
        _run_fault(arm, observe, thaw_wait, deadline, sync, prompt_tokens, freeze_at_chunk)
    except BaseException as e:
        arm.errors.append(f"{type(e).__name__}: {e}")
        sync.give_up()


def wait_drained(arm: Arm, limit: float = 300.0) -> None:
    """Until the prefill's inflight and bootstrap gauges read 0 (SGLang publishes them
    when its scheduler goes idle, so an idle 0 is current)."""
    t = time.monotonic() + limit
    while time.monotonic() < t:
        row = scrape(arm, 0.0)
        if row["inflight"] == 0 and row["bootstrap"] == 0:
            return
        time.sleep(0.5)
    raise TimeoutError(f"{arm.name}: the prefill's queues did not drain in {limit:.0f} s")


def _run_fault(
    arm: Arm,
    observe: float,
    thaw_wait: float,
    deadline: float,
    sync: Sync,
    prompt_tokens: int,
    freeze_at_chunk: int,
) -> None:
    s = arm.servers
    decode = s.procs["decode"]
    guarded = s.stallguard_config is not None
    attempts: list[dict[str, Any]] = []
    arm.events["attempts"] = attempts
    for attempt in range(1, ATTEMPTS + 1):
        wait_drained(arm)  # nothing of an earlier request left in the gauges
        if not sync.wait():
            raise RuntimeError("another arm gave up before the send")
        time.sleep(sync.delay.get(arm.name, 0.0))
        before = prefill_batch_lines(arm)
        result: dict[str, Any] = {}
        seed = 7 + 100 * attempt  # a fresh prompt each attempt: no radix-cache hit
        client = threading.Thread(
            target=lambda seed=seed, result=result: result.update(
                generate(s, prompt_tokens, seed, timeout=observe + thaw_wait + 600)
            ),
            daemon=True,
        )
        t_sent = time.monotonic()
        client.start()
        limit = t_sent + 600
        while prefill_batch_lines(arm) - before < freeze_at_chunk:
            if time.monotonic() > limit or not client.is_alive():
                raise RuntimeError(f"the prefill never reached chunk {freeze_at_chunk}: {result}")
            time.sleep(0.02)
        lead = time.monotonic() - t_sent
        progress = functools.partial(chunks_since, arm, before)
        placed = sync.arrive(arm.name, lead, progress, decode, s.procs["prefill"])
        attempts.append({"attempt": attempt, "placed": placed, **sync.placement})
        if placed:
            break
        client.join(timeout=600)  # the decode was not frozen: it completes
        if client.is_alive():
            raise RuntimeError(f"attempt {attempt}: the request did not complete unfrozen")
        arm.requests.setdefault("unplaced", []).append(result)
    else:
        raise RuntimeError(f"the fault could not be placed in {ATTEMPTS} attempts: {attempts}")
    t0 = sync.t0
    arm.events["chunk_reached_after_send_s"] = round(lead, 2)
    arm.events["freeze_after_send_s"] = round(t0 - t_sent, 2)
    # the window, event-driven: it lasts until the request has been in the inflight
    # queue for 2 x the deadline (the control pinned well past the deadline), and for
    # the guarded arm until its failure was counted (at most 3 x the deadline); at least
    # `observe`. With a shared decode the latest arm's end is everybody's.
    entry_limit = t0 + 600  # its last chunk's compute, after the freeze: generous
    end = sync.end(arm.name, t0 + max(observe, 2.0))
    entry: float | None = None
    forced: float | None = None
    while time.monotonic() < end:
        row = scrape(arm, t0)
        row["client_waiting"] = float(client.is_alive())
        arm.samples.append(row)
        now = time.monotonic()
        if entry is None and (row["inflight"] >= 1 or row["sg_oldest"] > 0):
            entry = row["t"]
        if forced is None and row["forced"] >= 1:
            forced = row["t"]
        if entry is None and not client.is_alive():
            # answered before any scrape saw it queued: failed as it entered the queue
            # (on Mooncake/TCP, once the transport dropped the frozen decode's session)
            arm.fault["answered_before_entry_s"] = row["t"]
            want = now
        elif entry is None:
            want = min(now + 2, entry_limit)
        else:
            want = t0 + entry + 2 * deadline
            if guarded and forced is None:
                want = max(want, min(now + 2, t0 + entry + 3 * deadline))
        sync.end(arm.name, want)
        time.sleep(1.0)
        end = sync.end(arm.name)
    obs = scrape_read(arm, t0, limit=30.0)
    obs["client_waiting"] = float(client.is_alive())
    arm.fault["observation"] = obs
    if not sync.wait():
        arm.errors.append("another arm gave up before the thaw")
    decode.thaw()
    arm.events["thaw_s"] = round(time.monotonic() - t0, 2)
    t_thaw = time.monotonic()
    while client.is_alive() and time.monotonic() - t_thaw < thaw_wait:
        row = scrape(arm, t0)
        row["client_waiting"] = float(client.is_alive())
        arm.samples.append(row)
        time.sleep(1.0)
    client.join(timeout=0.1)
    if result:
        result["t_end_s"] = round(result.pop("t_end") - t0, 2)
    arm.fault["client"] = result or {
        "status": None,
        "note": f"no answer {thaw_wait:.0f} s after thaw",
    }
    arm.fault["t0"] = t0
    arm.events.update(events_from_samples(arm.samples))


def events_from_samples(samples: list[dict[str, float]]) -> dict[str, float]:
    """When the prefill's metrics first showed the request (``entry_s``; SGLang's gauge:
    ``inflight_from_s``; stallguard's oldest age: ``sg_from_s``), its release
    (``released_s``) and a stallguard failure (``forced_s``); the entry and the failure
    each with the time of the last scrape before that read the page (``..._after_s``:
    the event happened in between; a scrape that failed, the server busy, reads NaN and
    bounds nothing)."""
    ev: dict[str, float] = {}
    prev = 0.0
    for row in samples:
        if math.isnan(row["inflight"]):
            continue
        shown = row["inflight"] >= 1 or row["sg_oldest"] > 0
        if "inflight_from_s" not in ev and row["inflight"] >= 1:
            ev["inflight_from_s"] = row["t"]
        if "entry_s" not in ev and shown:
            ev["entry_s"], ev["entry_after_s"] = row["t"], prev
        if "sg_from_s" not in ev and row["sg_oldest"] > 0:
            ev["sg_from_s"] = row["t"]
        if "released_s" not in ev and "inflight_from_s" in ev and row["inflight"] == 0:
            ev["released_s"] = row["t"]
        if "forced_s" not in ev and row["forced"] >= 1:
            ev["forced_s"], ev["forced_after_s"] = row["t"], prev
        prev = row["t"]
    return ev


def after(arm: Arm, t0: float, sizes: tuple[int, ...] = (16, 256)) -> None:
    """New requests on the same servers after the fault: a small one and a fresh
    prompt (no radix-cache hit), then the final scrape."""
    rows = [generate(arm.servers, n, 2000 + i, timeout=300) for i, n in enumerate(sizes)]
    for r in rows:
        r["t_end_s"] = round(r.pop("t_end") - t0, 2)
    arm.requests["healthy_after"] = rows
    time.sleep(1.5)
    arm.fault["final"] = scrape_read(arm, t0)
    arm.fault["series"] = {
        m: per_series(arm.servers.metrics_text(m)) for m in ("prefill", "decode")
    }


#: the series :func:`per_series` keeps, by rank: which rank counted what
PER_RANK = (GAUGES["forced"], GAUGES["transfer_failed"], GAUGES["inflight"])


def per_series(text: str) -> list[dict[str, Any]]:
    """The :data:`PER_RANK` samples of a ``/metrics`` page, each with its labels (with
    ``--tp``/``--dp`` each scheduler rank has a series of its own: ``tp_rank``,
    ``dp_rank``), the ones that are not 0."""
    return [
        {"name": name, "labels": labels, "value": value}
        for name, labels, value in parse_series(text)
        if name in PER_RANK and value
    ]


def scrape_read(arm: Arm, t0: float, limit: float = 60.0) -> dict[str, float]:
    """A scrape that read the page: retried for up to *limit* s (a busy server's
    ``/metrics`` can take longer than a scrape's 3 s; at load 25 one did); the last
    attempt's row, NaN and all, if none did."""
    deadline = time.monotonic() + limit
    row = scrape(arm, t0)
    while math.isnan(row["inflight"]) and time.monotonic() < deadline:
        time.sleep(1.0)
        row = scrape(arm, t0)
    return row


#: the plugin loader's lines :func:`plugins_by_process` keeps (SGLang's wording, 0.5.23)
PLUGIN_LINES = ("Executed general plugin: stallguard", "(from: plugin=stallguard")


def plugins_by_process(arm: Arm) -> dict[str, dict[str, dict[str, Any]]]:
    """Per server, per process (its title, else its pid): whether SGLang's
    ``load_plugins()`` ran stallguard's entry point there (``executed``) and how many
    targets it then hooked for it (``hooks``), from the plugin trace (``--dp`` > 1:
    :func:`examples.real_servers._servers.dp_env`); empty without the trace."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    titles = arm.events.get("processes", {})
    for mode, proc in arm.servers.procs.items():
        if mode == "router" or not arm.servers.owns(mode):
            continue
        names = titles.get(mode, {})
        for pid, lines in plugin_trace(proc.log_text()).items():
            ours = [x for x in lines if any(k in x for k in PLUGIN_LINES)]
            out.setdefault(mode, {})[names.get(pid, f"pid {pid}")] = {
                "pid": pid,
                "executed": any(PLUGIN_LINES[0] in x for x in ours),
                "hooks": sum(PLUGIN_LINES[1] in x for x in ours),
            }
    return out


def forced_failure_log(arm: Arm) -> list[str]:
    return [
        line
        for line in arm.servers.procs["prefill"].log_text().splitlines()
        if "stallguard forced failure" in line
    ]


def in_parallel(fn: Callable[[Arm], None], arms: list[Arm]) -> None:
    """*fn* for every arm at once (threads); an exception is the arm's error."""

    def one(a: Arm) -> None:
        try:
            fn(a)
        except BaseException as e:
            a.errors.append(f"{getattr(fn, '__name__', 'step')}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(a,)) for a in arms]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run(
    out: Path,
    *,
    deadline: float = 20.0,
    observe: float = 50.0,
    thaw_wait: float = 90.0,
    sequential: bool = False,
    shared_decode: bool = False,
    prompt_tokens: int = PROMPT_TOKENS,
    freeze_at_chunk: int = FREEZE_AT_CHUNK,
    arms: tuple[str, ...] = ("without", "with"),
    backend: str = "nixl",
    tp: int = 1,
    dp: int = 1,
    dp_rank_fix: bool = True,
    log: Any = print,
) -> dict[str, Any]:
    """Run the scenario; returns what results.json holds. Always stops every process it
    started.

    *shared_decode*: one decode (started without stallguard) for both arms, each arm a
    prefill and a router of its own (5 processes groups instead of 6; one SIGSTOP is both
    arms' fault, so both run at once)."""
    out.mkdir(parents=True, exist_ok=True)
    config = out / "stallguard-sglang.toml"
    config.write_text(CONFIG.format(deadline=deadline))
    t_all = time.monotonic()
    phases: dict[str, float] = {}
    made: dict[str, Arm] = {}
    for name in arms:
        owner = next(iter(made.values())).servers if shared_decode and made else None
        servers = ServerSet(
            name,
            out / "logs",
            config if name == "with" else None,
            decode_from=owner,
            decode_stallguard=not shared_decode,
            decode_name="decode" if shared_decode else None,
            backend=backend,
            tp=tp,
            dp=dp,
            dp_rank_fix=dp_rank_fix,
        )
        made[name] = Arm(name, servers)
    batches = [list(made.values())] if not sequential else [[a] for a in made.values()]
    if shared_decode:
        batches = [list(made.values())]

    def mark(phase: str) -> None:
        phases[phase] = round(time.monotonic() - t_all, 1)

    try:
        for batch in batches:
            for a in batch:
                a.servers.start_servers()
            # the routers start with the servers (their own start-up, ~30 s of imports
            # at load 25, overlaps the servers'); each registers its workers once they
            # answer /health, checking every second
            for a in batch:
                a.servers.start_router()
            log(
                f"started {', '.join(a.name for a in batch)}: prefill + decode + router, "
                "waiting for /health"
            )
            wait_healthy([a.servers for a in batch])
            mark("healthy")
            for a in batch:
                log(f"{a.name}: healthy after {a.servers.healthy_after}")
            in_parallel(ready_router, batch)
            if any(a.errors for a in batch):
                raise RuntimeError(f"routers not ready: {[a.errors for a in batch]}")
            mark("routers_ready")

            def before(a: Arm) -> None:
                a.requests["healthy_before"] = [generate(a.servers, 16, 100, 120)]
                a.events["rss_mb"] = round(
                    sum(
                        group_rss_mb(p.pgid)
                        for m, p in a.servers.procs.items()
                        if a.servers.owns(m)
                    ),
                    0,
                )

            in_parallel(before, batch)
            for a in batch:  # every process is up: the DP controller, its schedulers...
                a.events["processes"] = {
                    m: group_processes(p.pgid)
                    for m, p in a.servers.procs.items()
                    if m != "router" and a.servers.owns(m)
                }
            log(
                f"routers ready; the fault: decode SIGSTOPped mid-transfer of a "
                f"{kv_mb(prompt_tokens):.0f} MB KV"
            )
            chunks = math.ceil(prompt_tokens / batch[0].servers.chunked_prefill_size)
            sync = Sync(len(batch), chunks, freeze_at_chunk) if shared_decode else None
            threads = [
                threading.Thread(
                    target=run_fault,
                    args=(a, observe, thaw_wait, deadline, sync, prompt_tokens, freeze_at_chunk),
                )
                for a in batch
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            mark("fault_done")
            in_parallel(lambda a: after(a, a.fault["t0"]) if "t0" in a.fault else None, batch)
            for a in batch:
                a.fault["stallguard_log"] = forced_failure_log(a)
                a.fault["plugins"] = plugins_by_process(a)
            mark("after_done")
            stop_all([p for a in batch for m, p in a.servers.procs.items() if a.servers.owns(m)])
            mark("stopped")
    finally:
        for a in made.values():
            a.servers.stop()
    results = {
        "deadline_s": deadline,
        "observe_s": observe,
        "prompt_tokens": prompt_tokens,
        "chunks": math.ceil(prompt_tokens / CHUNK),
        "kv_mb": kv_mb(prompt_tokens),
        "shared_decode": shared_decode,
        "backend": backend,
        "tp": tp,
        "dp": dp,
        "dp_rank_fix": dp_rank_fix if dp > 1 else None,
        "total_s": round(time.monotonic() - t_all, 1),
        "phases_s": phases,
        "arms": {
            a.name: {
                "healthy_after": a.servers.healthy_after,
                "events": a.events,
                "requests": a.requests,
                "fault": {k: v for k, v in a.fault.items() if k != "t0"},
                "samples": a.samples,
                "errors": a.errors,
                "ports": a.servers.ports,
            }
            for a in made.values()
        },
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return results


def kv_mb(tokens: int) -> float:
    """MB of KV for *tokens* tokens of the big-KV model (8 layers x 4 KV heads x 256 x
    fp16 x K and V)."""
    return tokens * 8 * 4 * 256 * 2 * 2 / 2**20


#: Backends whose KV sender never reports ``Transferring``: the request waits in
#: ``WaitingForInput`` until the transfer ends, and stallguard-sglang's deadline there is
#: ``WaitingForInput`` + ``Transferring`` (docs/sglang.md), here 2 x ``--deadline``.
MERGED_STATES = frozenset({"mooncake"})
#: Backends that bound a frozen decode natively: SGLang's Mooncake sender fails the
#: request itself when a write batch times out (``MC_TRANSFER_TIMEOUT``, 30 s), so the
#: control is released by SGLang, later than stallguard's deadline, not pinned.
NATIVELY_BOUNDED = frozenset({"mooncake"})


def effective_deadline(results: dict[str, Any]) -> float:
    """The seconds after the request entered the inflight queue at which stallguard
    fails it in this run's state (see :data:`MERGED_STATES`)."""
    d = float(results["deadline_s"])
    return 2 * d if results.get("backend", "nixl") in MERGED_STATES else d


def verdict(results: dict[str, Any]) -> list[str]:
    """What went wrong (empty: the wedge reproduced without, released with; on a backend
    that bounds the frozen decode itself, :data:`NATIVELY_BOUNDED`, the control is
    released by SGLang's own failure instead, and stallguard's must come first)."""
    bad: list[str] = []
    deadline = effective_deadline(results)
    native = results.get("backend", "nixl") in NATIVELY_BOUNDED
    arms = results["arms"]
    for name, a in arms.items():
        bad += [f"{name}: {e}" for e in a["errors"]]
        ok = [
            r["status"] == 200
            for k in ("warmup", "healthy_before", "healthy_after")
            for r in a["requests"].get(k, [])
        ]
        if not ok or not all(ok):
            bad.append(f"{name}: a healthy request failed or none ran")
    w = arms.get("without")
    if w and not w["errors"]:
        obs = w["fault"].get("observation", {})
        if w["fault"].get("stallguard_log"):
            bad.append("without: stallguard failed something")
        if native:
            bad += _natively_bounded(w, arms.get("with"), deadline)
        else:
            if not obs.get("inflight", 0) >= 1:
                bad.append(
                    f"without: inflight {obs.get('inflight')} at the observation point (no wedge)"
                )
            if not obs.get("client_waiting"):
                bad.append("without: the client was not waiting any more at the observation point")
    g = arms.get("with")
    if g and not g["errors"]:
        obs = g["fault"].get("observation", {})
        ev = g["events"]
        # the TP ranks conclude the request together; each rank whose own clock found
        # it overdue counts it under its own ``tp_rank`` (the others conclude it through
        # the all-reduce without an expiry of their own): the sum is 1 to tp
        forced = obs.get("forced", 0)
        if obs.get("inflight") != 0 or not 1 <= forced <= results.get("tp", 1):
            bad.append(
                f"with: at the observation point inflight={obs.get('inflight')} "
                f"forced={obs.get('forced')}"
            )
        if "forced_s" not in ev or "inflight_from_s" not in ev:
            bad.append("with: no forced failure seen on /metrics")
        elif ev["forced_s"] > ev["inflight_from_s"] + deadline + 5:
            bad.append(
                f"with: released at +{ev['forced_s']} s, later than inflight + deadline + 5 s"
            )
        # DP replicas share nothing: the replica holding the request fails it, the
        # others count nothing (the final scrape's series, by rank)
        replicas = {
            x["labels"].get("dp_rank", "")
            for x in g["fault"].get("series", {}).get("prefill", [])
            if x["name"] == GAUGES["forced"]
        }
        if len(replicas) > 1:
            bad.append(f"with: forced failures counted by DP ranks {sorted(replicas)}")
        client = g["fault"].get("client", {})
        if client.get("status") in (200, None):
            bad.append(f"with: the client did not get an error: {client}")
    return bad


def _natively_bounded(w: dict[str, Any], g: dict[str, Any] | None, deadline: float) -> list[str]:
    """The control on a backend that bounds a frozen decode itself: the request is
    still pinned at the observation point, or SGLang failed it (its own transfer-failure
    counter) and not before stallguard's deadline would have (else stallguard adds
    nothing on this fault, and the run shows nothing)."""
    obs = w["fault"].get("observation", {})
    if obs.get("inflight", 0) >= 1:
        return []  # pinned, as on NIXL
    ev = w["events"]
    final = w["fault"].get("final", {})
    failed = max(obs.get("transfer_failed", 0) or 0, final.get("transfer_failed", 0) or 0)
    if failed >= 1 and "inflight_from_s" not in ev:
        return [
            "without: SGLang failed it as it entered the inflight queue (the transport had "
            "dropped the frozen decode's session already): nothing for stallguard to bound "
            "in this run"
        ]
    if not failed >= 1 or "released_s" not in ev or "inflight_from_s" not in ev:
        return [f"without: not pinned and not failed by SGLang either: {obs}"]
    bound = ev["released_s"] - ev["inflight_from_s"]
    if bound < deadline:
        return [f"without: SGLang released it {bound:g} s after entry, before the deadline"]
    gev = (g or {}).get("events", {})
    if (
        "forced_s" in gev
        and "inflight_from_s" in gev
        and gev["forced_s"] - gev["inflight_from_s"] > bound
    ):
        return ["with: stallguard failed it later after entry than SGLang did in the control"]
    return []


def fmt(x: Any, unit: str = "") -> str:
    if x is None or x != x:
        return "-"
    return f"{x:g}{unit}" if isinstance(x, float) else f"{x}{unit}"


def table(results: dict[str, Any]) -> str:
    d = results["deadline_s"]
    head = [
        "arm", "healthy after (prefill/decode)", "RSS", "inflight >= 1 from",
        "stallguard failed it", "inflight at obs.", "forced failures", "transfer failed",
        "SIGCONT", "client", "healthy after the fault",
    ]  # fmt: skip
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, a in results["arms"].items():
        ev, f = a["events"], a["fault"]
        obs, fin = f.get("observation", {}), f.get("final", {})
        c = f.get("client", {})
        if c.get("status") == 200:
            outcome = f"200 at +{fmt(c.get('t_end_s'))} s"
        elif c.get("status"):
            outcome = f"{c['status']} at +{fmt(c.get('t_end_s'))} s"
        else:
            outcome = "no answer"
        waiting = " (waiting at obs.)" if obs.get("client_waiting") else ""
        ha = a["requests"].get("healthy_after", [])
        rows.append(
            f"| {name} | {fmt(round(a['healthy_after'].get('prefill', float('nan'))))}/"
            f"{fmt(round(a['healthy_after'].get('decode', float('nan'))))} s "
            f"| {fmt(ev.get('rss_mb'))} MB "
            f"| +{fmt(ev.get('inflight_from_s'))} s "
            f"| {'+' + fmt(ev['forced_s']) + ' s' if 'forced_s' in ev else 'never'} "
            f"| {fmt(obs.get('inflight'))} | {fmt(fin.get('forced', obs.get('forced')))} "
            f"| {fmt(fin.get('transfer_failed', obs.get('transfer_failed')))} "
            f"| +{fmt(ev.get('thaw_s'))} s | {outcome}{waiting} "
            f"| {sum(r['status'] == 200 for r in ha)}/{len(ha)} |"
        )
    rows.append("")
    rows.append(
        "Times are seconds after the decode was SIGSTOPped (mid-transfer of the "
        f"{results['prompt_tokens']}-token, {results['kv_mb']:.0f} MB KV); deadline {d:g} s "
        "(WaitingForInput, Transferring), "
        f"observation point and SIGCONT at +{results['observe_s']:g} s or 2 x the deadline "
        "after the request was first seen in the inflight queue (and, with stallguard, its "
        "failure counted), whichever is later. "
        f"Total {results['total_s']:g} s."
    )
    return "\n".join(rows)


def picture(results: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 3.2))
    colors = {"without": "tab:red", "with": "tab:blue"}
    widths = {"without": 3.5, "with": 1.8}
    for name, a in results["arms"].items():
        s = a["samples"]
        ax.step(
            [r["t"] for r in s],
            [r["inflight"] for r in s],
            where="post",
            color=colors.get(name),
            lw=widths.get(name, 2.0),
            label=f"{name} stallguard",
        )
        ev = a["events"]
        if "forced_s" in ev:
            ax.axvline(ev["forced_s"], color=colors.get(name), ls=":", lw=1)
        if name == "with" and "inflight_from_s" in ev:
            due = ev["inflight_from_s"] + results["deadline_s"]
            ax.axvline(due, color="k", ls="--", lw=0.8, label="deadline (with), from first sample")
    thaw = next(
        (a["events"].get("thaw_s") for a in results["arms"].values() if "thaw_s" in a["events"]),
        None,
    )
    if thaw:
        ax.axvspan(0, thaw, color="0.9", zorder=0, label="decode SIGSTOPped")
    ax.set_xlabel("seconds since the decode froze mid-transfer")
    ax.set_ylabel("prefill inflight queue")
    ax.set_yticks([0, 1])
    ax.set_title(
        "real SGLang 0.5.23 PD servers + sglang-router: sglang:num_prefill_inflight_queue_reqs"
    )
    ax.legend(loc="center right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m examples.real_servers", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", type=Path, default=Path("real_servers_out"))
    p.add_argument(
        "--deadline",
        type=float,
        default=20.0,
        help="prefill WaitingForInput/Transferring deadline (s)",
    )
    p.add_argument(
        "--observe", type=float, default=50.0, help="seconds the decode stays frozen, at least"
    )
    p.add_argument(
        "--sequential", action="store_true", help="one arm at a time (half the memory and CPU)"
    )
    p.add_argument(
        "--shared-decode",
        action="store_true",
        help="one decode (without stallguard) for both arms' prefills: both arms at once",
    )
    p.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    p.add_argument(
        "--freeze-at-chunk",
        type=int,
        default=FREEZE_AT_CHUNK,
        help="freeze once the prefill logged this many chunks of the prompt (not all)",
    )
    p.add_argument("--arms", default="without,with")
    p.add_argument(
        "--backend",
        default="nixl",
        help=f"KV transfer backend of the servers: {', '.join(BACKENDS)} (Mooncake over TCP)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor parallelism of every server (ranks on gloo, one core each)",
    )
    p.add_argument(
        "--dp",
        type=int,
        default=1,
        help="data parallelism of every server (--dp-size: replicas behind SGLang's DP "
        "controller, each rank on a core of its own)",
    )
    p.add_argument(
        "--no-dp-rank-fix",
        action="store_true",
        help="at --dp > 1, run SGLang 0.5.23's prefill DP rank as it is (requests sent to "
        "a replica other than 0 then fail at bootstrap: sgl-project/sglang#29725)",
    )
    args = p.parse_args(argv)
    if not 1 <= args.tp <= 8:
        p.error(f"--tp {args.tp}: must be 1 to 8")
    if not 1 <= args.dp <= 8:
        p.error(f"--dp {args.dp}: must be 1 to 8")
    if args.backend not in BACKENDS:
        p.error(f"--backend {args.backend!r}: must be one of {', '.join(BACKENDS)}")
    chunks = math.ceil(args.prompt_tokens / CHUNK) if args.prompt_tokens > 0 else 0
    if chunks < 2:
        p.error(f"--prompt-tokens {args.prompt_tokens}: needs at least 2 chunks of {CHUNK}")
    if not 1 <= args.freeze_at_chunk < chunks:
        p.error(
            f"--freeze-at-chunk {args.freeze_at_chunk}: must be 1 to {chunks - 1} "
            f"(the prompt has {chunks} chunks of {CHUNK})"
        )
    if not PYTHON.exists():
        print(
            f"{PYTHON} is missing: run `python3 tools/dev.py env` (it builds .venv-realsrv)",
            file=sys.stderr,
        )
        return 2
    results = run(
        args.out.resolve(),
        deadline=args.deadline,
        observe=args.observe,
        sequential=args.sequential,
        shared_decode=args.shared_decode,
        prompt_tokens=args.prompt_tokens,
        freeze_at_chunk=args.freeze_at_chunk,
        arms=tuple(args.arms.split(",")),
        backend=args.backend,
        tp=args.tp,
        dp=args.dp,
        dp_rank_fix=not args.no_dp_rank_fix,
        log=lambda m: print(f"[real_servers] {m}", flush=True),
    )
    text = table(results)
    (args.out / "results.md").write_text(text + "\n")
    print(text)
    if picture(results, args.out / "real_servers.png"):
        print(f"picture: {args.out / 'real_servers.png'}")
    for name, a in results["arms"].items():
        for line in a["fault"].get("stallguard_log", []):
            print(f"{name} prefill log: {line}")
        for mode, procs in a["fault"].get("plugins", {}).items():
            for title, got in procs.items():
                print(
                    f"{name} {mode}: {title} (pid {got['pid']}): stallguard entry point "
                    f"{'run' if got['executed'] else 'NOT run'}, {got['hooks']} target(s) hooked"
                )
    bad = verdict(results)
    for b in bad:
        print(f"NOT OK: {b}")
    print(f"outputs in {args.out} (logs/, results.json)")
    return 1 if bad else 0


__all__ = ["ROOT", "main", "run", "table", "verdict"]
