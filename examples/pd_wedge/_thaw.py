"""The thaw: a prefill frozen **mid-WRITE**, the decode request failed, its pages' next
owner, and what the resumed prefill's late WRITE does to that owner's bytes.

The decode-side freezes of ``_ddriver.py`` stop the prefill *before* its WRITE (before
registration, or after decode's metadata arrived and before the KV is sent): on thaw
the prefill processes decode's queued ABORT first and never writes, so nothing can land
anywhere. The danger is a WRITE already under way when the prefill froze: the request is
failed, and if its pages are freed and handed to the next request, the rest of the WRITE
lands in that request's KV when the prefill resumes (issue 19; the quarantine in
docs/sglang-internals.md).

Per engine, four processes of their own, so that the rooms can be big (a WRITE of
8 pages x 1 MiB x 4 KV buffers = 32 MiB, long enough to be frozen in the middle of):

* a bootstrap server (its own process, as in the decode rig: it keeps answering while
  the prefill is frozen);
* a prefill (DP 2, ``_dp_prefill``) that sends a room's KV, filled with the room's byte
  pattern, as soon as decode's metadata is there;
* two decode servers, ``without`` and ``with``, SGLang's real decode queues over host
  pools of two requests (``_decode_queues``), identical but for
  ``STALLGUARD_SGLANG_CONFIG`` (the decode rig's file). Both have the same two SGLang
  knobs shortened so that a round takes seconds, not minutes:
  ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (300 s by default; what fails the request
  without stallguard) and ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``
  (30 s by default; how long SGLang holds a failed request's pages for the prefill's
  drain ACK before it frees them "anyway").

A round, per arm (one arm after the other, on the same prefill: two decodes cannot be
frozen mid-WRITE by one SIGSTOP reliably): a warm-up room (connection set-up; its 32 MiB
checked byte for byte), then the victim. The decode server watches the victim's pages and
SIGSTOPs the prefill the moment the first bytes land (the fault injector lives there
because only that process sees its memory within a millisecond); the victim is failed
(by SGLang's waiting timeout without stallguard, by its ``transfer WaitingForInput``
deadline with it); SGLang's deferred-release timeout passes; the next request gets
memory (the victim's pages if they were freed, other pages if not) and writes its own
pattern (254, a byte no room pattern has); SIGCONT; once the prefill's transfer worker
has nothing of the room left, every byte of the new owner's pages is compared.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from stallguard.testing import stop_and_wait

from . import _procs
from ._config import Profile, write_stallguard_config
from ._driver import ARMS, HarnessError

#: the thaw rooms' KV layout: 16 pages of 1 MiB in 4 buffers; a request is 8 pages
LAYOUT = dict(layers=2, page_bytes=1 << 20, num_pages=16, aux_rows=16)
PAGES = 8
WRITE_BYTES = PAGES * LAYOUT["page_bytes"] * 2 * LAYOUT["layers"]
OWNER = 254  # the new owner's byte: room patterns are 1..251
#: SGLang's deferred-release timeout in both thaw decode servers (30 s by default)
RELEASE_TIMEOUT = 1.0
#: after the failure, the new owner is allocated this long past SGLang's timeout
MARGIN = 0.5
ATTEMPTS = 3  # a round whose WRITE finished before the freeze took hold is run again


def waiting_timeout(transfer_deadline: float) -> int:
    """SGLang's waiting timeout for the thaw decodes (whole seconds: SGLang reads it as an
    int): twice stallguard's ``transfer WaitingForInput`` deadline, at least 2 s, so that
    with stallguard it is stallguard's deadline that fails the victim."""
    return max(2, math.ceil(2 * transfer_deadline))


# --------------------------------------------------------------------------- prefill


def run_prefill(conn: Connection, spec: dict) -> None:
    """The thaw prefill: ``submit(room)`` creates the room's sender; once decode's
    metadata is there the room's source pages are filled with its pattern and sent."""
    from sglang.srt.disaggregation.base import KVPoll

    from . import _dp_prefill, _kv, _rpc

    engine, port = spec["engine"], spec["bootstrap_port"]
    _dp_prefill.install_context(engine, port)
    ranks = _dp_prefill.PrefillRanks(engine, port, _kv.Layout(**spec["layout"]))
    live: dict[int, bool] = {}  # room -> sent
    import numpy as np

    def submit(room: int) -> None:
        ranks.register(room)
        live[room] = False

    def outstanding(room: int) -> int:
        """The room's chunks dequeued or posted and not settled (SGLang's count behind
        the drain ACK)."""
        return int(ranks.mgr._staging_outstanding.get(room, 0))

    running = True

    def shutdown() -> None:
        nonlocal running
        running = False

    handlers = {
        "submit": submit,
        "outstanding": outstanding,
        "ping": lambda: os.getpid(),
        "shutdown": shutdown,
    }
    conn.send(("ready", {"pid": os.getpid()}))
    while running:
        if not _rpc.drain(conn, handlers, wait=0.005):
            break
        for room in list(live):
            status = ranks.poll(room)
            if status == KVPoll.WaitingForInput and not live[room]:
                ranks.pool.fill(room, np.arange(PAGES), 0)  # the forward pass's KV
                ranks.send(room, PAGES)
                live[room] = True
            elif status in (KVPoll.Success, KVPoll.Failed):
                del live[room]
                ranks.forget(room)


# --------------------------------------------------------------------------- decode


def run_decode(conn: Connection, spec: dict) -> None:
    """A thaw decode server: SGLang's real decode queues, stepped every
    ``loop_interval``; a round is a small state machine advanced between the steps."""
    import numpy as np
    from sglang.srt.disaggregation import decode as sglang_decode
    from sglang.srt.environ import envs
    from sglang.srt.plugins import load_plugins

    from . import _decode_queues, _kv, _rpc

    before = sglang_decode.DecodeTransferQueue.__dict__["pop_transferred"]
    load_plugins()  # what run_scheduler_process does first
    hooked = sglang_decode.DecodeTransferQueue.__dict__["pop_transferred"] is not before
    engine, port = spec["engine"], spec["bootstrap_port"]
    _kv.install_context("decode", engine, port)
    layout = _kv.Layout(**spec["layout"])
    # the manager reads SGLANG_DISAGGREGATION_WAITING_TIMEOUT when it is created
    node = _decode_queues.DecodeNode(f"{_kv.HOST}:{port}", engine, layout)
    side = _decode_queues.DecodeSide(node, free_slots=2)
    # what DecodeTransferQueue.__init__ reads (the rig builds the queue without it)
    side.transfer.deferred_kv_release_timeout = (
        envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get()
    )
    slots = len(side.host.free)
    tick = float(spec["loop_interval"])
    r: dict = {"state": "idle"}

    def quarantine():
        guard = getattr(side.transfer, "_stallguard_decode_guard", None)
        return getattr(guard, "quarantine", None)

    def held() -> int:
        q = quarantine()
        return len(q.holds()) if q is not None else 0

    def room_bytes(room: int, pages) -> int:
        return sum(
            int(np.count_nonzero(buf[pages] == _kv.HostPool.pattern(room, i)))
            for i, buf in enumerate(side.kv.kv)
        )

    def changed(pages) -> int:
        return sum(int(np.count_nonzero(buf[pages] != OWNER)) for buf in side.kv.kv)

    def start(rid: str, room: int, prefill_pid: int, warm: bool) -> None:
        if r["state"] not in ("idle", "done"):
            raise RuntimeError(f"a round is under way ({r['state']})")
        for buf in side.kv.kv:
            buf[:] = 0
        r.clear()
        r.update(rid=rid, room=room, pid=prefill_pid, warm=warm, state="admitting")
        r["released_before"] = released_so_far()
        r["t_added"] = time.monotonic()
        side.add(rid, room, port).req.origin_input_ids = list(range(PAGES))

    def first_bytes() -> bool:
        return any(buf[x, 0] or buf[x, -1] for buf, x in r["probes"])

    def freeze() -> None:
        """SIGSTOP the prefill now (the victim's first bytes have landed)."""
        stop_and_wait(r["pid"])
        r["t_frozen"] = time.monotonic()
        r["landed"] = room_bytes(r["room"], r["pages"])
        if r["landed"] >= WRITE_BYTES or r["rid"] in side.done:
            r["missed"] = True  # the WRITE finished before the freeze took hold
            os.kill(r["pid"], signal.SIGCONT)
            r["t_thaw"] = time.monotonic()
            r["state"] = "thawed"
        else:
            r["state"] = "frozen"

    def released_so_far() -> dict:
        q = quarantine()
        return dict(q.snapshot().released) if q is not None else {}

    def settle() -> None:
        r["state"] = "settling"
        r["settle_deadline"] = time.monotonic() + 30

    def status() -> dict:
        return {k: v for k, v in r.items() if k not in ("pages", "probes")}

    def advance() -> None:
        """One step of the round (after the pass's queue calls)."""
        now = time.monotonic()
        state, rid = r["state"], r.get("rid")
        aborted = side.aborted()
        if state == "admitting":
            if rid in side.rids("transfer"):
                dreq = next(d for d in side.transfer.queue if d.req.rid == rid)
                r["slot"] = int(dreq.req.kv.req_pool_idx)
                r["pages"] = side.host.req_to_token[r["slot"]].numpy()
                p = r["pages"]
                r["probes"] = [(buf, int(x)) for buf in side.kv.kv for x in (p[0], p[-1])]
                r["state"] = "warm" if r["warm"] else "watching"
                r["t_metadata"] = now
            elif rid in aborted or rid in side.done:
                raise RuntimeError(f"{rid} left before its metadata was sent: {aborted}")
        elif state == "warm":
            if rid in side.done:
                r["verified"] = room_bytes(r["room"], r["pages"])
                r["t_done"] = now
                r["state"] = "done"
            elif rid in aborted:
                # (a first room on a new pair pays for the connection set-up: on a busy
                # machine it can overrun the deadline; the driver sends another)
                r["warm_failed"] = aborted[rid][:500]
                settle()
        elif state == "watching":
            if rid in side.done or first_bytes():
                freeze()
            elif now > r["t_metadata"] + 60:
                raise RuntimeError("no byte of the victim's WRITE landed within 60 s")
        elif state == "frozen":
            if "t_failed" not in r:
                if rid in aborted:
                    r["t_failed"] = now
                    r["reason"] = aborted[rid]
                elif now > r["t_frozen"] + 120:
                    raise RuntimeError("the victim was not failed within 120 s of the freeze")
                return
            if now < r["t_failed"] + RELEASE_TIMEOUT + MARGIN:
                if r["slot"] in side.host.free and "t_freed" not in r:
                    r["t_freed"] = now  # SGLang's deferred release gave up
                return
            # the next request: the allocator's next slot (the victim's if it was freed)
            host = side.host
            # what landed before the owner writes: bytes the prefill had sent before it
            # stopped keep landing for a moment after (socket buffers, the receiver's
            # thread: 1.2 MB of a Mooncake WRITE once), and the owner's pattern would
            # hide them from both this count and ``overwritten``
            r["landed_at_freeze"] = r["landed"]
            r["landed"] = room_bytes(r["room"], r["pages"])
            victim_free = r["slot"] in host.free
            owner = r["slot"] if victim_free else host.free[0]
            host.free.remove(owner)
            host.budget -= 1
            r["owner_slot"] = owner
            r["owner_pages"] = [int(x) for x in host.req_to_token[owner].numpy()]
            for buf in side.kv.kv:
                buf[r["owner_pages"]] = OWNER
            r["freed_before_thaw"] = victim_free
            r["held_at_thaw"] = held()
            r["held_pages_at_thaw"] = sum(h.units for h in quarantine().holds()) if held() else 0
            r["changed_before_thaw"] = changed(r["owner_pages"])
            os.kill(r["pid"], signal.SIGCONT)
            r["t_thaw"] = time.monotonic()
            r["state"] = "thawed"
        elif state in ("thawed", "settling"):
            if "t_released" not in r and r.get("held_at_thaw") and not held():
                r["t_released"] = now  # the drain ACK freed the quarantined pages
            if state == "thawed":
                return
            busy = side.transfer._deferred_releases or held() or side.rids("transfer")
            if busy and now < r["settle_deadline"]:
                return
            if "owner_slot" in r:
                r["overwritten"] = changed(r["owner_pages"])
                r["late_in_owner"] = room_bytes(r["room"], np.array(r["owner_pages"]))
                r["late_in_victim"] = (
                    room_bytes(r["room"], r["pages"]) if r["owner_slot"] != r["slot"] else 0
                )
                side.host.free_slot(r["owner_slot"])
            # the holds this round's victim left by (earlier rounds' subtracted)
            before = r["released_before"]
            r["released"] = {
                k: n - before.get(k, 0)
                for k, n in released_so_far().items()
                if n - before.get(k, 0)
            }
            r["deferred_left"] = len(side.transfer._deferred_releases)
            r["holds_left"] = held()
            r["leaked_pages"] = (slots - len(side.host.free)) * side.host.slot_pages
            r["metadata_leaked"] = side.allocator.size - side.allocator.available_size()
            r["state"] = "done"

    running = True

    def shutdown() -> None:
        nonlocal running
        running = False

    handlers = {
        "start": start,
        "settle": settle,
        "status": status,
        "ping": lambda: os.getpid(),
        "shutdown": shutdown,
    }
    conn.send(("ready", {"pid": os.getpid(), "hooked": hooked}))
    next_t = time.monotonic()
    while running:
        if not _rpc.drain(conn, handlers):
            break
        if r["state"] == "watching" and first_bytes():
            try:  # at once, before the next pass: the WRITE goes on meanwhile
                freeze()
            except Exception as exc:
                os.kill(r["pid"], signal.SIGCONT)
                r["state"], r["error"] = "error", f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= next_t:
            side.step()
            try:
                advance()
            except Exception as exc:
                if r.get("pid"):
                    os.kill(r["pid"], signal.SIGCONT)  # never leave the prefill stopped
                r["state"], r["error"] = "error", f"{type(exc).__name__}: {exc}"
            next_t += tick
            if next_t < time.monotonic():
                next_t = time.monotonic() + tick
        # watching for the first bytes: look every millisecond between the passes
        if r["state"] == "watching":
            time.sleep(0.001)
        else:
            time.sleep(max(0.0, min(0.005, next_t - time.monotonic())))


# --------------------------------------------------------------------------- driver


@dataclass
class ThawResult:
    """One arm's thaw round, on one engine (bytes and times as measured)."""

    engine: str
    arm: str
    write_bytes: int = WRITE_BYTES
    attempts: int = 0
    warm_verified: int = 0  # bytes of the warm-up room that arrived right
    #: warm-up rooms failed (connection set-up past the deadline on a busy machine)
    warm_failed: list[str] = field(default_factory=list)
    #: bytes of the victim's WRITE in its pages before the thaw: what the prefill sent
    #: before it stopped (read when the next owner takes memory: some of it lands only
    #: after the stop, from the socket buffers)
    landed_before_freeze: int = 0
    failed_after_s: float | None = None  # freeze -> the victim's error
    reason: str = ""
    #: the victim's pages were free when the next request came (SGLang gave up)
    freed_before_thaw: bool = False
    freed_after_failure_s: float | None = None  # SGLang's "releasing anyway"
    owner_bytes: int = WRITE_BYTES
    owner_same_pages: bool = False
    changed_before_thaw: int = 0
    overwritten: int = 0  # the new owner's bytes changed after SIGCONT
    late_in_owner: int = 0  # of them, the victim's prefill KV
    late_in_quarantine: int = 0  # the late WRITE's bytes in the victim's held pages
    quarantined_pages: int = 0
    held_ms: float | None = None  # failure -> freed (quarantine)
    freed_after_thaw_ms: float | None = None
    released: dict = field(default_factory=dict)
    leaked_pages: int = 0
    deferred_left: int = 0
    holds_left: int = 0
    metadata_leaked: int = 0
    problems: list[str] = field(default_factory=list)

    def fault_shown(self) -> bool:
        """The control: without stallguard the late WRITE really landed in the owner's
        pages (the fault was real: a WRITE in flight, frozen, resumed)."""
        return self.arm != "without" or (self.overwritten > 0 and not self.problems)

    def ok(self) -> bool:
        """The demo's pass criterion for the thaw (both arms: the "without" arm must
        show the corruption, or the round proved nothing)."""
        if self.arm == "without":
            return self.fault_shown()
        return (
            not self.problems
            and self.overwritten == 0
            and self.changed_before_thaw == 0
            and not self.freed_before_thaw
            and not self.owner_same_pages
            and self.quarantined_pages == PAGES
            and self.late_in_quarantine > 0
            and self.freed_after_thaw_ms is not None
            and self.released.get("transfer_done", 0) == 1
            and self.leaked_pages == 0
            and self.deferred_left == 0
            and self.holds_left == 0
            and self.metadata_leaked == 0
        )


class ThawRig:
    """The thaw's processes for one engine (see the module docstring)."""

    def __init__(self, engine: str, profile: Profile, out: Path, log=print) -> None:
        self.engine = engine
        self.profile = profile
        self.out = out
        self.log = log
        self.port = _procs.free_port()
        self.workers: dict[str, _procs.Worker] = {}
        self.room = 900_000_000
        self.deadline = profile.decode_deadline("transfer", "WaitingForInput")
        self.waiting_timeout = waiting_timeout(self.deadline)

    def _worker(self, name: str, role: str, **spec) -> _procs.Worker:
        spec.setdefault("engine", self.engine)
        spec["log"] = _procs.log_path(self.out, f"{self.engine}-{name}")
        worker = _procs.Worker(f"{self.engine}-{name}", role, spec)
        self.workers[name] = worker
        return worker

    def start(self) -> None:
        self._worker("thaw-bootstrap", "bootstrap", ports=[self.port]).wait_ready(60)
        prefill = self._worker("thaw-prefill", "tprefill", bootstrap_port=self.port, layout=LAYOUT)
        cfg = write_stallguard_config(self.profile, self.out / "stallguard-sglang-thaw.toml")
        knobs = {
            "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(self.waiting_timeout),
            "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": str(RELEASE_TIMEOUT),
        }
        for arm in ARMS:
            env = dict(knobs)
            if arm == "with":
                env["STALLGUARD_SGLANG_CONFIG"] = str(cfg)
            self._worker(
                f"thaw-{arm}",
                "tdecode",
                bootstrap_port=self.port,
                layout=LAYOUT,
                loop_interval=self.profile.loop_interval,
                env=env,
            )
        prefill.wait_ready(120)
        for arm in ARMS:
            info = self.workers[f"thaw-{arm}"].wait_ready(120)
            if info["hooked"] != (arm == "with"):
                raise HarnessError(
                    f"the thaw decode {arm!r} has pop_transferred "
                    f"{'not ' if arm == 'with' else ''}wrapped after load_plugins()"
                )

    def stop(self) -> None:
        for worker in self.workers.values():
            worker.stop()

    def _round(self, arm: str, warm: bool, timeout: float) -> dict:
        decode = self.workers[f"thaw-{arm}"]
        prefill = self.workers["thaw-prefill"]
        self.room += 1
        room = self.room
        prefill.rpc.call("submit", room=room)
        decode.rpc.call("start", rid=f"{arm}-{room}", room=room, prefill_pid=prefill.pid, warm=warm)
        deadline = time.monotonic() + timeout
        settling = False
        while True:
            st = decode.rpc.call("status")
            if st["state"] in ("done", "error"):
                return st
            if st["state"] == "thawed" and not settling:
                # the resumed prefill's transfer worker has nothing of the room left
                while prefill.rpc.call("outstanding", room=room):
                    if time.monotonic() > deadline:
                        raise HarnessError(f"{self.engine}: room {room}'s WRITE never settled")
                    time.sleep(0.02)
                decode.rpc.call("settle")
                settling = True
            if time.monotonic() > deadline:
                decode.signal(signal.SIGCONT)
                prefill.signal(signal.SIGCONT)
                raise HarnessError(f"{self.engine}: thaw round ({arm}) stuck in {st['state']}")
            time.sleep(0.02)

    def run(self) -> list[ThawResult]:
        out = []
        budget = 60 + 3 * self.waiting_timeout
        for arm in ARMS:
            res = ThawResult(self.engine, arm)
            for _ in range(ATTEMPTS):
                warm = self._round(arm, True, 60)
                if "warm_failed" not in warm:
                    break
                res.warm_failed.append(warm["warm_failed"])
            if warm["state"] == "error" or "warm_failed" in warm:
                res.problems.append(f"warm-up: {warm.get('error') or warm['warm_failed']}")
                out.append(res)
                continue
            res.warm_verified = warm["verified"]
            if warm["verified"] != WRITE_BYTES:
                res.problems.append(f"warm-up room: {warm['verified']} of {WRITE_BYTES} B right")
            for attempt in range(1, ATTEMPTS + 1):
                res.attempts = attempt
                st = self._round(arm, False, budget)
                if st["state"] == "error" or not st.get("missed"):
                    break
            self._fill(res, st)
            out.append(res)
        return out

    @staticmethod
    def _fill(res: ThawResult, st: dict) -> None:
        if st["state"] == "error":
            res.problems.append(st["error"])
            return
        if st.get("missed"):
            res.problems.append(
                f"the WRITE finished before the freeze took hold in {res.attempts} attempts"
            )
            return
        res.landed_before_freeze = st["landed"]
        res.failed_after_s = round(st["t_failed"] - st["t_frozen"], 3)
        res.reason = st["reason"][:500]
        res.freed_before_thaw = st["freed_before_thaw"]
        if "t_freed" in st:
            res.freed_after_failure_s = round(st["t_freed"] - st["t_failed"], 3)
        res.owner_same_pages = st["owner_slot"] == st["slot"]
        res.changed_before_thaw = st["changed_before_thaw"]
        res.overwritten = st["overwritten"]
        res.late_in_owner = st["late_in_owner"]
        res.late_in_quarantine = st["late_in_victim"]
        res.quarantined_pages = st["held_pages_at_thaw"]
        if "t_released" in st:
            res.held_ms = round(1000 * (st["t_released"] - st["t_failed"]), 1)
            res.freed_after_thaw_ms = round(1000 * (st["t_released"] - st["t_thaw"]), 1)
        res.released = st["released"]
        res.leaked_pages = st["leaked_pages"]
        res.deferred_left = st["deferred_left"]
        res.holds_left = st["holds_left"]
        res.metadata_leaked = st["metadata_leaked"]


def run(engine: str, profile: Profile, out: Path, log=print) -> list[ThawResult]:
    """The thaw on one engine, both arms; *profile* is the decode rig's (its derived
    ``transfer WaitingForInput`` deadline is the "with" arm's)."""
    t = time.monotonic()
    rig = ThawRig(engine, profile, out, log)
    try:
        rig.start()
        results = rig.run()
    finally:
        rig.stop()
    for r in results:
        log(thaw_line(r) + f" ({time.monotonic() - t:.1f}s)")
    return results


def thaw_line(r: ThawResult) -> str:
    if r.problems:
        return f"[{r.engine}] thaw ({r.arm}): PROBLEM {r.problems}"
    held = (
        f"quarantined {r.quarantined_pages} pages {r.held_ms:.0f} ms, freed "
        f"{r.freed_after_thaw_ms:.0f} ms after SIGCONT"
        if r.held_ms is not None
        else f"pages freed {r.freed_after_failure_s}s after the failure"
        if r.freed_after_failure_s is not None
        else "pages not quarantined"
    )
    return (
        f"[{r.engine}] thaw ({r.arm}): {r.landed_before_freeze:,} of {r.write_bytes:,} B "
        f"landed before the freeze; failed {r.failed_after_s}s after it; {held}; "
        f"{r.overwritten:,} of the new owner's {r.owner_bytes:,} B overwritten after SIGCONT; "
        f"{r.leaked_pages} pages leaked"
    )
