"""The driver: starts the processes, routes the request stream, injects the faults, and
turns what the prefill and decode processes measured into one result per run.

Per engine there is one *rig*: two prefill processes (the "without" arm and the "with
stallguard" arm, identical but for ``STALLGUARD_SGLANG_CONFIG``) and two decode processes,
A and B, that serve both prefills. Faults only ever hit decode A; B carries the healthy
half of the traffic throughout, so a healthy request failing is visible at once.

A run is one scenario on one arm: ``pre`` seconds of traffic, the fault, ``window``
seconds until the observation point (where pinned requests are counted), the fault is
lifted, ``post`` seconds of traffic, then the queues drain and whatever is left is counted
and aborted (as a client would give up), so the next run starts clean.
"""

from __future__ import annotations

import bisect
import itertools
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import _calibrate, _procs
from ._config import STATES, Profile, write_report_config, write_stallguard_config
from ._rpc import WorkerError

STALLGUARD_MARK = "stallguard:"  # the adapter's failure reasons start with it
ARMS = ("without", "with")
#: arms whose pass criterion is checked (:meth:`RunResult.ok`): stallguard enforcing
ENFORCING = ("with", "advised")
QUEUE_SIZE = 4  # SGLANG_DISAGGREGATION_QUEUE_SIZE: transfer worker shards on prefill
#: Clock-read slack: the harness stamps a pass's start just before calling the inflight
#: queue method; the adapter reads its clock a moment later, inside the call.
EPS = 0.005


class HarnessError(RuntimeError):
    """The demo itself could not run (a worker died, did not answer, ...)."""


# --------------------------------------------------------------------------- results


@dataclass
class RunResult:
    """What one run measured. Times are seconds on the shared monotonic clock."""

    engine: str
    scenario: str
    arm: str
    #: the guarded side: "prefill" (decode faults, the inflight queue) or "decode"
    #: (prefill faults, the decode queues)
    side: str = "prefill"
    sent: int = 0
    completed: int = 0
    failed_stallguard: int = 0
    failed_sglang: int = 0
    pinned: int = 0  # at the observation point: overdue by more than a loop interval
    left: int = 0  # still unfinished when the run ended (aborted by the harness)
    healthy: int = 0
    healthy_failed: int = 0
    faulted: int = 0
    release_latency_ms: list[float] = field(default_factory=list)
    loop_interval_ms: float = 0.0
    max_pass_gap_ms: float = 0.0  # longest time between two loop passes in the run
    late_releases: int = 0  # not released by the first loop pass after the deadline
    #: how far the harness's stamp of a call's start may precede the adapter's own clock
    #: read inside that call: the longest guarded call of the run (at least EPS). On an
    #: idle machine a call takes about a millisecond; under load, tens.
    clock_slack_ms: float = 1000 * EPS
    decode_bad_bytes: int = 0
    decode_verified: int = 0
    t0: float = 0.0
    fault_armed: float | None = None  # the driver triggered the fault
    fault_start: float | None = None  # the driver saw it take effect
    observed_at: float | None = None
    fault_end: float | None = None
    #: decode side: when prefill A had worked through its backlog after SIGCONT
    recovered_at: float | None = None
    #: the advice section: the deadlines the run was measured against (its arm's)
    deadlines: dict[str, float] = field(default_factory=dict)
    end: float = 0.0
    samples: list[tuple[float, float, int, int]] = field(default_factory=list)
    releases: list[tuple[float, str]] = field(default_factory=list)  # (t, kind)
    pinned_detail: list[tuple] = field(default_factory=list)
    left_detail: list[tuple] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    #: per request: rid -> [decode, sent at, released at or None, outcome, faulted,
    #: [(t, KVPoll state)...]]; times in seconds relative to ``t0``
    requests: dict[str, list] = field(default_factory=dict)
    #: the rig's warm-up measurement and the deadlines derived from it (_calibrate.py)
    calibration: dict = field(default_factory=dict)
    #: every healthy request that was failed: a false positive, with its timing (see
    #: :func:`false_positive`); never tolerated by :meth:`ok`
    false_positives: list[dict] = field(default_factory=list)

    def forced(self, t: float, due: float, calls: list[float]) -> None:
        """Count a release by stallguard at *t* of a deadline due at *due*; *calls* are
        the start times of the calls that check it (the loop passes, or one decode
        queue's calls). It is late if a call started after the deadline but before the
        one that released it, or if it came before the deadline."""
        self.release_latency_ms.append(round(1000 * (t - due), 1))
        slack = self.clock_slack_ms / 1000
        k = bisect.bisect_right(calls, t) - 1
        first_after = bisect.bisect_left(calls, due + slack)
        if first_after < k or t < due - slack:
            self.late_releases += 1

    def measure_slack(self, durations) -> None:
        """Set :attr:`clock_slack_ms` from the durations of the run's guarded calls."""
        self.clock_slack_ms = round(1000 * max([EPS, *durations]), 1)

    def ok(self) -> bool:
        """The demo's pass criterion for an arm where stallguard enforces ("with", and
        the advice section's "advised")."""
        if self.arm not in ENFORCING:
            return True
        return (
            self.pinned == 0
            and self.left == 0
            and self.healthy_failed == 0
            and not self.false_positives
            and self.late_releases == 0
            and not self.problems
        )


def false_positive(
    r: RunResult,
    rid: str,
    peer: str,
    sent: float,
    released: float,
    by: str,
    reason: str,
    phase: str | None = None,
    since: float | None = None,
    deadline: float | None = None,
) -> dict:
    """The record of a healthy request that was failed, and why that is a false positive
    (times relative to the run's start, durations in seconds)."""
    entry = {
        "rid": rid,
        "peer": peer,
        "by": by,
        "sent_s": round(sent - r.t0, 3),
        "released_s": round(released - r.t0, 3),
        "round_trip_s": round(released - sent, 3),
        "phase": phase,
        "in_phase_s": None if since is None else round(released - since, 3),
        "deadline_s": deadline,
        "reason": reason[:300],
    }
    r.false_positives.append(entry)
    return entry


def explain_false_positive(r: RunResult | dict, fp: dict) -> str:
    """One line: which healthy request, which phase, how long against which deadline."""
    get = r.get if isinstance(r, dict) else lambda k: getattr(r, k)
    where = f"{get('engine')}/{get('scenario')} ({get('side')} side, {get('arm')})"
    peer = f"{'decode' if get('side') == 'prefill' else 'prefill'} {fp['peer']}"
    text = (
        f"FALSE POSITIVE {where}: healthy request {fp['rid']} (to {peer}, sent at "
        f"{fp['sent_s']:.2f}s) failed by {fp['by']} at {fp['released_s']:.2f}s"
    )
    if fp["phase"] is not None and fp["in_phase_s"] is not None:
        text += (
            f" in {fp['phase']} after {fp['in_phase_s']:.2f}s there (deadline "
            f"{fp['deadline_s']}s, round trip so far {fp['round_trip_s']:.2f}s)"
        )
    else:
        text += f" after {fp['round_trip_s']:.2f}s: {fp['reason'][:120]}"
    cal = get("calibration") or {}
    if cal:
        text += (
            f"; warm-up round trip max {cal['rtt_ms']['max']} ms, loop gap max "
            f"{cal['max_pass_gap_ms']} ms, deadlines x{cal['scale']:g}"
        )
    return text


# --------------------------------------------------------------------------- the rig


class Rig:
    """One engine's processes: prefills ``without`` / ``with`` and decodes ``A`` / ``B``."""

    def __init__(self, engine: str, profile: Profile, out: Path, log=print, extra_arms: tuple = ()):
        self.engine = engine
        self.profile = profile
        self.out = out
        self.log = log
        self.layout = dict(
            layers=2,
            page_bytes=1024,
            num_pages=512 * profile.max_turn_tokens,
            aux_rows=2048,
            aux_row_bytes=64,
        )
        #: prefill arms started with the rig ("report": the advice section's shadow arm;
        #: arms added later, like "advised", get a port when they start)
        self.arms = (*ARMS, *extra_arms)
        self.ports = {arm: _procs.free_port() for arm in self.arms}
        #: STALLGUARD_SGLANG_CONFIG per arm ("with" is written at start)
        self.configs: dict[str, Path] = {}
        self.prefill: dict[str, _procs.Worker] = {}
        self.decode: dict[str, _procs.Worker] = {}
        self.shard: dict[str, int] = {}
        self.room = 0
        self.starts = 0
        #: the warm-up measurement; ``profile`` is the derived one once it is done
        self.base_profile = profile
        self.calibration: dict = {}

    # -- process management

    def _prefill_spec(self, arm: str) -> dict:
        env = {}
        if arm == "with" and arm not in self.configs:
            self.configs[arm] = write_stallguard_config(
                self.profile, self.out / "stallguard-sglang.toml"
            )
        if arm == "report" and arm not in self.configs:  # the advice section's shadow
            self.configs[arm] = write_report_config(
                self.profile, self.out / "stallguard-sglang-report.toml"
            )
        if arm in self.configs:
            env["STALLGUARD_SGLANG_CONFIG"] = str(self.configs[arm])
        return dict(
            engine=self.engine,
            bootstrap_port=self.ports[arm],
            gloo_file=str(self.out / "logs" / f"{self.engine}-{arm}-{time.time_ns()}.gloo"),
            layout=self.layout,
            slot_pages=self.profile.max_turn_tokens,
            loop_interval=self.profile.loop_interval,
            env=env,
            log=_procs.log_path(self.out, f"{self.engine}-prefill-{arm}"),
        )

    def _start_decode(self, name: str) -> _procs.Worker:
        """A decode connected to the bootstrap server of every prefill started so far
        (:meth:`connect_decodes` adds the later ones)."""
        self.starts += 1
        spec = dict(
            engine=self.engine,
            bootstrap_ports=[self.ports[arm] for arm in self.prefill],
            layout=self.layout,
            slot_pages=self.profile.max_turn_tokens,
            log=_procs.log_path(self.out, f"{self.engine}-decode-{name}"),
        )
        return _procs.Worker(f"{self.engine}-decode-{name}", "decode", spec)

    def _ready_prefill(self, arm: str) -> dict:
        """Wait for a prefill; if its bootstrap port was taken meanwhile (the port is
        picked here, bound there), start it again on another port."""
        for _ in range(3):
            try:
                return self.prefill[arm].wait_ready(120)
            except WorkerError as exc:
                if "address already in use" not in str(exc).lower():
                    raise
            self.prefill[arm].stop()
            self.ports[arm] = _procs.free_port()
            self.prefill[arm] = _procs.Worker(
                f"{self.engine}-prefill-{arm}", "prefill", self._prefill_spec(arm)
            )
        return self.prefill[arm].wait_ready(120)

    def start(self) -> None:
        """The prefill without stallguard and both decodes; warm-up; the measurement
        that sets the deadlines (:meth:`calibrate`); then the prefills that read
        ``STALLGUARD_SGLANG_CONFIG``, written with the derived deadlines."""
        self._start_prefills(("without",))
        for name in ("A", "B"):
            self.decode[name] = self._start_decode(name)
        for name in ("A", "B"):
            self._ready_decode(name)
        self.warm_up(("A", "B"))
        self.calibrate()
        later = tuple(arm for arm in self.arms if arm != "without")
        self._start_prefills(later)
        self.connect_decodes()
        self.warm_up(("A", "B"))

    def _start_prefills(self, arms: tuple[str, ...]) -> None:
        for arm in arms:
            # picked now, not when the rig was made: the guarded arms start a minute later
            # (after the warm-up measurement), time enough for the port to be taken
            self.ports[arm] = _procs.free_port()
            self.prefill[arm] = _procs.Worker(
                f"{self.engine}-prefill-{arm}", "prefill", self._prefill_spec(arm)
            )
        for arm in arms:
            info = self._ready_prefill(arm)
            if arm != "without" and not info["hooked"]:
                raise HarnessError(
                    "the 'with stallguard' prefill ran SGLang's load_plugins() with "
                    "STALLGUARD_SGLANG_CONFIG set, but process_disagg_prefill_inflight_queue "
                    "was not wrapped: is stallguard-sglang installed in this environment? "
                    f"(log: {self.prefill[arm].spec['log']})"
                )
            if arm == "without" and info["hooked"]:
                raise HarnessError("the 'without' prefill has the inflight queue wrapped")

    def connect_decodes(self) -> None:
        """Have both decodes fetch the parallel info of every prefill (as they do at
        start for the prefills that were up then)."""
        ports = [self.ports[arm] for arm in self.prefill]
        for name in ("A", "B"):
            self.decode[name].rpc.call("connect", ports=ports, timeout=90)

    def calibrate(self) -> None:
        """Measure healthy round trips through the prefill without stallguard, at the
        profile's rate, and derive the deadlines from them (``_calibrate.py``)."""
        p, arm = self.base_profile, "without"
        rng = random.Random(f"calibrate-{self.engine}")
        n = max(8, round(_calibrate.SECONDS * p.rate))
        next_submit = time.monotonic()
        for i in range(n):
            delay = next_submit - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            tokens = rng.randint(4, p.max_turn_tokens)
            self._send(arm, "AB"[i % 2], tokens, deliver=True)
            next_submit += rng.uniform(0.6, 1.4) / p.rate
        deadline = time.monotonic() + 60
        while self.prefill[arm].rpc.call("snapshot")["rows"]:
            if time.monotonic() > deadline:
                raise HarnessError(f"{self.engine}: warm-up measurement did not finish")
            time.sleep(0.05)
        got = self.prefill[arm].rpc.call("collect")
        rtts, failed = [], 0
        for rid, rel in got["released"].items():
            if rel[1]:
                rtts.append(rel[0] - got["submitted"][rid][0])
            else:
                failed += 1
        first = min((s[0] for s in got["submitted"].values()), default=0.0)
        gaps = _calibrate.pass_gaps(s[0] for s in got["samples"] if s[0] >= first)
        self.profile, self.calibration = _calibrate.derive(p, "prefill", rtts, gaps, failed)
        for name in ("A", "B"):
            self.decode[name].rpc.call("reset")

    def add_prefill(self, arm: str, config: Path) -> None:
        """Start one more prefill arm with *config* (the advice section's "advised"),
        then restart both decodes so that they know its bootstrap server."""
        self.ports[arm] = _procs.free_port()
        self.configs[arm] = config
        self.prefill[arm] = _procs.Worker(
            f"{self.engine}-prefill-{arm}", "prefill", self._prefill_spec(arm)
        )
        if not self._ready_prefill(arm)["hooked"]:
            raise HarnessError(f"the {arm!r} prefill has the inflight queue unwrapped")
        for name in ("A", "B"):
            old = self.decode.pop(name)
            old.stop()
            self.shard.pop(name, None)
        for name in ("A", "B"):
            self.decode[name] = self._start_decode(name)
        for name in ("A", "B"):
            self._ready_decode(name)
        self.warm_up(("A", "B"))

    def _ready_decode(self, name: str) -> None:
        """Wait for a decode; restart it if it shares a prefill transfer worker with the
        other decode (then a stall on A would also stall B's rooms, by design of SGLang's
        sharding, and "healthy" would stop meaning anything)."""
        for _ in range(8):
            worker = self.decode[name]
            worker.wait_ready(60)
            self.shard[name] = worker.rpc.call("shard_port") % QUEUE_SIZE
            other = "B" if name == "A" else "A"
            if other not in self.shard or self.shard[other] != self.shard[name]:
                return
            worker.stop()
            self.decode[name] = self._start_decode(name)
        raise HarnessError(f"decode {name}: no distinct transfer shard after 8 starts")

    def restart_decode(self, name: str) -> None:
        old = self.decode.pop(name)
        old.stop()
        self.shard.pop(name, None)
        self.decode[name] = self._start_decode(name)
        self._ready_decode(name)
        self.warm_up((name,))

    def warm_up(self, names) -> None:
        """First rooms on a new pair pay for connection set-up (UCX wire-up ~1-2 s)."""
        for arm in self.prefill:
            for name in names:
                for _ in range(2):
                    self._send(arm, name, tokens=4, deliver=True)
        deadline = time.monotonic() + 30
        for arm in self.prefill:
            while self.prefill[arm].rpc.call("snapshot")["rows"]:
                if time.monotonic() > deadline:
                    raise HarnessError(f"{self.engine}: warm-up rooms did not finish")
                time.sleep(0.05)
            got = self.prefill[arm].rpc.call("collect")
            if not all(rel[1] for rel in got["released"].values()):
                raise HarnessError(f"{self.engine}: warm-up rooms failed: {got['released']}")
        for name in names:
            self.decode[name].rpc.call("reset")

    def _send(self, arm: str, decode: str, tokens: int, deliver: bool) -> str:
        self.room += 1
        rid = f"{arm}-{self.room}"
        self.prefill[arm].rpc.send("submit", rid=rid, room=self.room, tokens=tokens, dest=decode)
        if deliver:
            # A killed decode loses the request (its pipe is closed), as a dead host would.
            self.decode[decode].rpc.send(
                "open", room=self.room, tokens=tokens, port=self.ports[arm]
            )
        return rid

    def stop(self) -> None:
        for worker in [*self.decode.values(), *self.prefill.values()]:
            worker.stop()


# --------------------------------------------------------------------------- one run


@dataclass
class _Session:
    """One agent conversation: pinned to a decode, its prompt grows every turn."""

    decode: str
    turn: int = 0


class Run:
    """One scenario on one arm (see the module docstring for the timeline)."""

    def __init__(
        self, rig: Rig, scenario: str, arm: str, seed: int, profile: Profile | None = None
    ):
        self.rig = rig
        #: the timeline and the deadlines the run is measured against (default: the rig's)
        self.p = profile or rig.profile
        self.scenario = scenario
        self.arm = arm
        # Same stream (sizes, routing, abort plan) for both arms of a scenario.
        self.rng = random.Random(f"{seed}-{rig.engine}-{scenario}")
        self.prefill = rig.prefill[arm]
        self.meta: dict[str, dict] = {}  # rid -> {decode, t, abort}
        self.decode_aborts: list[tuple[float, str, int]] = []
        self.sessions = [_Session("A" if i % 2 == 0 else "B") for i in range(8)]
        self.next_session = 0
        self.route_a = True  # False once the router gave up on a dead decode A
        self.a_dead = False
        self.storm = False
        self.result = RunResult(rig.engine, scenario, arm)

    # -- traffic

    def _submit(self, now: float) -> None:
        s = self.sessions[self.next_session]
        self.next_session = (self.next_session + 1) % len(self.sessions)
        if s.decode == "A" and not self.route_a:
            s.decode = "B"
        s.turn += 1
        if s.turn > 6:  # conversation over: a new one takes its place
            s.turn = 1
        tokens = min(self.p.max_turn_tokens, 4 * s.turn + self.rng.randint(0, 3))
        deliver = not (s.decode == "A" and self.a_dead)
        rid = self.rig._send(self.arm, s.decode, tokens, deliver)
        abort = False
        if self.storm and self.rng.random() < 0.5:
            abort = True
            self.prefill.rpc.send("abort", rid=rid, after_ticks=self.rng.choice((0, 0, 1)))
            if deliver and self.rng.random() < 0.5:
                delay = self.rng.uniform(0.0, 0.06)
                self.decode_aborts.append((now + delay, s.decode, self.rig.room))
        self.meta[rid] = {"decode": s.decode, "t": now, "abort": abort, "room": self.rig.room}

    # -- faults

    def _inject(self) -> None:
        a = self.rig.decode["A"]
        if self.scenario == "freeze":
            self.prefill.rpc.call("freeze_after_send", dest="A", pid=a.pid)
        elif self.scenario == "kill":
            a.rpc.call("flag", name="kill_after_init")
        elif self.scenario == "mute":
            a.rpc.call("flag", name="mute")
        elif self.scenario == "aborts":
            self.storm = True
        else:
            raise ValueError(f"unknown scenario {self.scenario!r}")

    def _fault_took_effect(self) -> bool:
        a = self.rig.decode["A"]
        if self.scenario == "freeze":
            return a.state() == "T"
        if self.scenario == "kill":
            if a.alive():
                return False
            self.a_dead = True
            return True
        return True

    def _lift(self) -> None:
        a = self.rig.decode["A"]
        if self.scenario == "freeze":
            a.signal(signal.SIGCONT)
        elif self.scenario == "kill":
            self.route_a = False  # the router noticed; A is restarted after the run
        elif self.scenario == "mute":
            a.rpc.call("flag", name="mute", value=False)
        elif self.scenario == "aborts":
            self.storm = False

    # -- the timeline

    def execute(self) -> RunResult:
        p, r = self.p, self.result
        interval = 1.0 / p.rate
        t0 = time.monotonic()
        r.t0 = t0
        next_submit = t0
        phase = "pre"
        stop_submit = None
        arm_deadline = None
        while True:
            now = time.monotonic()
            if stop_submit is None or now < stop_submit:
                while now >= next_submit:
                    self._submit(now)
                    next_submit += interval * self.rng.uniform(0.6, 1.4)
            if self.decode_aborts:
                due = [x for x in self.decode_aborts if x[0] <= now]
                self.decode_aborts = [x for x in self.decode_aborts if x[0] > now]
                for _, name, room in due:
                    worker = self.rig.decode[name]
                    if worker.alive() and worker.state() != "T":
                        worker.rpc.send("abort", room=room)
            if phase == "pre" and now >= t0 + p.pre:
                r.fault_armed = now
                self._inject()
                phase, arm_deadline = "arming", now + 3.0
            elif phase == "arming":
                if self._fault_took_effect():
                    r.fault_start = now
                    phase = "fault"
                elif now > arm_deadline:
                    raise HarnessError(
                        f"{self.rig.engine}/{self.scenario}: the fault did not take effect "
                        "within 3 s"
                    )
            elif phase == "fault" and now >= r.fault_start + p.window:
                self._observe(now)
                self._lift()
                r.fault_end = time.monotonic()
                phase = "post"
                stop_submit = r.fault_end + p.post
            elif phase == "post" and now >= stop_submit:
                break
            wake = next_submit if stop_submit is None or next_submit < stop_submit else now + 0.01
            if self.decode_aborts:
                wake = min(wake, min(x[0] for x in self.decode_aborts))
            time.sleep(min(0.01, max(0.001, wake - time.monotonic())))
        self._drain()
        return r

    def _overdue(self, snap: dict) -> list[tuple]:
        """Requests whose current state's deadline had passed when the last inflight-queue
        pass started, and that are still queued after it: what stallguard must have
        released by then."""
        out = []
        last_pass = snap["last_pass"]
        for rid, where, state, since in snap["rows"]:
            if state not in STATES:
                continue
            due = since + self.p.deadline(self.rig.engine, state)
            if due + EPS <= last_pass:
                out.append((rid, where, state, round(last_pass - due, 3)))
        return out

    def _observe(self, now: float) -> None:
        snap = self.prefill.rpc.call("snapshot")
        self.result.observed_at = time.monotonic()
        self.result.pinned_detail = self._overdue(snap)
        self.result.pinned = len(self.result.pinned_detail)

    def _drain(self) -> None:
        p, r = self.p, self.result
        deadline = time.monotonic() + p.drain
        rows = self.prefill.rpc.call("snapshot")["rows"]
        while rows and time.monotonic() < deadline:
            time.sleep(0.05)
            rows = self.prefill.rpc.call("snapshot")["rows"]
        r.end = time.monotonic()
        r.left_detail = [
            (rid, where, state, round(r.end - since, 3)) for rid, where, state, since in rows
        ]
        r.left = len(rows)
        left_ids = {row[0] for row in rows}
        if rows:
            self.prefill.rpc.call("abort_left")
            deadline = time.monotonic() + 5
            while self.prefill.rpc.call("snapshot")["rows"] and time.monotonic() < deadline:
                time.sleep(0.05)
        got = self.prefill.rpc.call("collect")
        if got["left"]:
            r.problems.append(f"{len(got['left'])} requests could not be cleared: {got['left']}")
        decode_stats = {}
        for name, worker in self.rig.decode.items():
            if worker.alive():
                worker.signal(signal.SIGCONT)
                try:
                    decode_stats[name] = worker.rpc.call("collect", timeout=10)
                    worker.rpc.call("reset", timeout=10)
                except WorkerError as exc:
                    r.problems.append(str(exc))
        self._tally(got, left_ids, decode_stats)

    # -- classification

    def _faulted(self, rid: str, t_release: float | None) -> bool:
        """Was this request in the fault's way? (B's requests never are.)"""
        m, r = self.meta[rid], self.result
        if self.scenario == "aborts":
            return m["abort"]
        if m["decode"] != "A" or r.fault_armed is None:
            return False
        # A's requests that were still unfinished when the fault was triggered, or that
        # were sent before it was lifted (a killed decode stays dead).
        started_before_end = r.fault_end is None or m["t"] < r.fault_end or self.a_dead
        return started_before_end and (t_release is None or t_release > r.fault_armed)

    def _tally(self, got: dict, left_ids: set[str], decode_stats: dict) -> None:
        r, p = self.result, self.p
        r.sent = len(self.meta)
        released = got["released"]
        passes = [s[0] for s in got["samples"]]
        r.samples = [tuple(s) for s in got["samples"] if r.t0 <= s[0] <= r.end]
        r.measure_slack(s[1] - s[0] for s in r.samples)  # (pass start, inflight call end)
        r.loop_interval_ms = round(1000 * p.loop_interval, 1)
        starts = [s[0] for s in r.samples]
        r.max_pass_gap_ms = round(
            1000 * max((b - a for a, b in itertools.pairwise(starts)), default=0.0), 1
        )
        for rid in self.meta:
            rel = released.get(rid)
            t_release = rel[0] if rel else None
            faulted = self._faulted(rid, t_release)
            r.faulted += faulted
            r.healthy += not faulted
            room = self.meta[rid]["room"]
            changes = [(round(t - r.t0, 4), st) for t, st in got["transitions"].get(room, ())]
            r.requests[rid] = [
                self.meta[rid]["decode"],
                round(self.meta[rid]["t"] - r.t0, 4),
                None if rel is None else round(rel[0] - r.t0, 4),
                "left" if rid in left_ids else _outcome(rel),
                faulted,
                changes,
            ]
            if rid in left_ids:
                continue  # counted in `left`
            if rel is None:
                r.problems.append(f"{rid}: neither released nor left in a queue")
                continue
            t, ok, reason = rel
            if ok:
                r.completed += 1
                r.releases.append((t, "completed"))
                continue
            by_stallguard = STALLGUARD_MARK in reason
            key = _reason_key(reason)
            r.reasons[key] = r.reasons.get(key, 0) + 1
            due = None
            if by_stallguard:
                r.failed_stallguard += 1
                r.releases.append((t, "stallguard"))
                due = self._due(rid, t, reason, got)
                if due is not None:
                    r.forced(t, due, passes)
            else:
                r.failed_sglang += 1
                r.releases.append((t, "sglang"))
            if not faulted:
                r.healthy_failed += 1
                state = next((s for s in STATES if f"KVPoll.{s}" in reason), None)
                limit = None if state is None else p.deadline(self.rig.engine, state)
                false_positive(
                    r,
                    rid,
                    self.meta[rid]["decode"],
                    self.meta[rid]["t"],
                    t,
                    "stallguard" if by_stallguard else "SGLang",
                    reason,
                    phase=state if by_stallguard else None,
                    since=None if due is None or limit is None else due - limit,
                    deadline=limit,
                )
        for stats in decode_stats.values():
            for status, verified, _ in stats["outcome"].values():
                if status == "ok":
                    r.decode_verified += verified
                    r.decode_bad_bytes += not verified

    def _due(self, rid: str, t_release: float, reason: str, got: dict) -> float | None:
        """When the deadline that failed *rid* was due: that of the state the reason names,
        counted from the later of the request joining the inflight queue and its room's
        last change into that state (as the prefill manager's status probe recorded it)."""
        state = next((s for s in STATES if f"KVPoll.{s}" in reason), None)
        enrolled = got["enrolled"].get(rid)
        if state is None or enrolled is None:
            self.result.problems.append(f"{rid}: cannot tell which deadline fired: {reason}")
            return None
        code = STATES.index(state) + 1  # KVPoll: Bootstrapping=1, WaitingForInput=2, ...
        since = enrolled
        for t, status in got["transitions"].get(self.meta[rid]["room"], ()):
            if status == code and t <= t_release:
                since = max(enrolled, t)
        return since + self.p.deadline(self.rig.engine, state)


def _outcome(rel) -> str:
    """How a request ended, from its release record ``(t, ok, reason, ...)``."""
    if rel is None:
        return "lost"
    if rel[1]:
        return "completed"
    return "stallguard" if STALLGUARD_MARK in rel[2] else "sglang"


def _reason_key(reason: str) -> str:
    """A short label for a failure reason (for the per-run reason counts)."""
    if STALLGUARD_MARK in reason:
        state = reason.split("KVPoll.", 1)[1].split(" ", 1)[0] if "KVPoll." in reason else "?"
        return f"stallguard: {state} deadline"
    text = reason.split(" with exception ", 1)[-1]
    if text.startswith("KVTransferError(") and "): " in text:
        text = text.split("): ", 1)[1]
    for marker in (
        "Aborted by AbortReq",
        "Aborted by decode-side abort",
        "unknown reason from another rank",
        "timed out after",
        "Failed to send kv chunk",
        "left a handle running",
        "REMOTE_DISCONNECT",
        "Decode",
    ):
        if marker in text:
            return marker
    return text[:60]


# --------------------------------------------------------------------------- all runs


def progress_line(r: RunResult, seconds: float) -> str:
    """The line the demo prints as each run ends."""
    return (
        f"[{r.engine}] {r.scenario:<19} {r.arm:<7} sent={r.sent} ok={r.completed} "
        f"sg={r.failed_stallguard} sglang={r.failed_sglang} pinned={r.pinned} "
        f"left={r.left} healthy_failed={r.healthy_failed} ({seconds:.1f}s)"
    )


def run_all(
    engines: list[str],
    scenarios: list[str],
    profile: Profile,
    out: Path,
    seed: int = 0,
    log=print,
    advice: bool = False,
) -> tuple[list[RunResult], dict[str, str]]:
    """Run every scenario on both arms for each engine, then (*advice*) the advice
    section; returns the results in order and the advice printed per engine."""
    from . import _shadow

    results: list[RunResult] = []
    advised: dict[str, str] = {}
    for engine in engines:
        t = time.monotonic()
        rig = Rig(engine, profile, out, log=log, extra_arms=(_shadow.SHADOW,) if advice else ())
        try:
            rig.start()
            log(
                f"[{engine}] {len(rig.arms)} prefills + 2 decodes up and warm in "
                f"{time.monotonic() - t:.1f}s; {_calibrate.describe(rig.calibration)}"
            )
            for scenario in scenarios:
                for arm in ARMS:
                    if not rig.decode["A"].alive():
                        rig.restart_decode("A")
                    t = time.monotonic()
                    result = Run(rig, scenario, arm, seed).execute()
                    result.calibration = rig.calibration
                    results.append(result)
                    log(progress_line(result, time.monotonic() - t))
            if advice:
                t = time.monotonic()
                runs, advised[engine] = _shadow.run(rig, seed, log=log)
                for result in runs:
                    result.calibration = rig.calibration
                results += runs
                for result in runs:
                    log(progress_line(result, time.monotonic() - t))
        finally:
            rig.stop()
    return results, advised
