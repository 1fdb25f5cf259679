"""The decode-side faults: a prefill freezes, and the decode servers are the guarded side.

Per engine there is one *decode rig*: a bootstrap server process (the bootstrap servers of
both prefills, as SGLang runs them in the HTTP server process), prefills ``A`` and ``B``
(DP 2, ``round_robin``: decode must ask the bootstrap server which rank holds a room), and
two decode servers, ``without`` and ``with`` (identical but for
``STALLGUARD_SGLANG_CONFIG``). Faults only ever hit prefill A; B carries the healthy half
of the traffic throughout.

Both arms run *at once*, on the same stream and the same fault: every request is sent
twice, once through each decode server (its own room each), to the same prefill. A run
is one scenario: ``pre`` seconds of traffic, the fault, ``window`` seconds until the
observation point, the fault lifted (``SIGCONT``), ``post`` seconds of traffic, then the
queues drain; what is left is counted and aborted, so the next run starts clean.
"""

from __future__ import annotations

import itertools
import random
import signal
import time
from pathlib import Path

from . import _calibrate, _procs, _thaw
from ._config import THAW_SCENARIOS, Profile, write_stallguard_config
from ._driver import (
    ARMS,
    EPS,
    STALLGUARD_MARK,
    HarnessError,
    RunResult,
    _outcome,
    _reason_key,
    false_positive,
    progress_line,
)
from ._rpc import WorkerError

PREFILLS = ("A", "B")


class DecodeRig:
    """One engine's processes for the decode-side faults (see the module docstring)."""

    def __init__(self, engine: str, profile: Profile, out: Path, log=print):
        self.engine = engine
        self.profile = profile
        self.out = out
        self.log = log
        self.layout = dict(layers=2, page_bytes=1024, num_pages=2048, aux_rows=2048)
        self.ports = {name: _procs.free_port() for name in PREFILLS}
        self.workers: dict[str, _procs.Worker] = {}
        self.room = 100_000_000
        #: the warm-up measurement; ``profile`` is the derived one once it is done
        self.base_profile = profile
        self.calibration: dict = {}

    def _worker(self, name: str, role: str, **spec) -> _procs.Worker:
        spec.setdefault("engine", self.engine)
        spec["log"] = _procs.log_path(self.out, f"{self.engine}-{name}")
        worker = _procs.Worker(f"{self.engine}-{name}", role, spec)
        self.workers[name] = worker
        return worker

    def start(self) -> None:
        boot = self._worker("bootstrap", "bootstrap", ports=list(self.ports.values()))
        boot.wait_ready(60)
        for name in PREFILLS:
            self._worker(
                f"prefill-{name}", "ppeer", bootstrap_port=self.ports[name], layout=self.layout
            )
        for name in PREFILLS:
            self.workers[f"prefill-{name}"].wait_ready(120)
        # The decode server without stallguard first: warm-up, then the measurement that
        # sets the deadlines the "with" server is launched with.
        self._start_decodes(("without",))
        self.warm_up()
        self.calibrate()
        self._start_decodes(("with",))
        self.warm_up()

    def _start_decodes(self, arms: tuple[str, ...]) -> None:
        cfg = self.out / "stallguard-sglang.toml"
        if "with" in arms:
            write_stallguard_config(self.profile, cfg)
        for arm in arms:
            env = {"STALLGUARD_SGLANG_CONFIG": str(cfg)} if arm == "with" else {}
            self._worker(
                f"decode-{arm}",
                "dserver",
                bootstrap_ports=[self.ports[name] for name in PREFILLS],
                layout=self.layout,
                free_slots=200,
                loop_interval=self.profile.loop_interval,
                env=env,
            )
        for arm in arms:
            info = self.workers[f"decode-{arm}"].wait_ready(120)
            if info["hooked"] != (arm == "with"):
                raise HarnessError(
                    f"the {arm!r} decode server has pop_preallocated "
                    f"{'not ' if arm == 'with' else ''}wrapped after SGLang's load_plugins() "
                    "(is stallguard-sglang installed in this environment? log: "
                    f"{self.workers[f'decode-{arm}'].spec['log']})"
                )

    def arms(self) -> tuple[str, ...]:
        """The decode servers started so far."""
        return tuple(arm for arm in ARMS if f"decode-{arm}" in self.workers)

    def prefill(self, name: str) -> _procs.Worker:
        return self.workers[f"prefill-{name}"]

    def decode(self, arm: str) -> _procs.Worker:
        return self.workers[f"decode-{arm}"]

    def send(self, prefill: str, arms: tuple[str, ...] = ARMS) -> dict[str, str]:
        """One client request, through each decode server: arm -> rid."""
        rids = {}
        for arm in arms:
            self.room += 1
            rid = f"{arm}-{self.room}"
            self.prefill(prefill).rpc.send("submit", room=self.room, pages=4, tag=arm)
            self.decode(arm).rpc.send("add", rid=rid, room=self.room, port=self.ports[prefill])
            rids[arm] = rid
        return rids

    def warm_up(self) -> None:
        """First rooms on a new pair pay for connection set-up (UCX wire-up ~1-2 s)."""
        for name in PREFILLS:
            for _ in range(2):
                self.send(name, self.arms())
        deadline = time.monotonic() + 60
        for arm in self.arms():
            while self.decode(arm).rpc.call("snapshot")["rows"]:
                if time.monotonic() > deadline:
                    raise HarnessError(f"{self.engine}: decode warm-up rooms did not finish")
                time.sleep(0.05)
            got = self.decode(arm).rpc.call("collect")
            if not all(rel[1] for rel in got["released"].values()):
                raise HarnessError(f"{self.engine}: decode warm-up rooms failed: {got}")
        self.reset()

    def calibrate(self) -> None:
        """Measure healthy round trips through the decode server without stallguard, at
        the profile's rate, and derive the deadlines from them (``_calibrate.py``)."""
        p, arm = self.base_profile, "without"
        rng = random.Random(f"calibrate-{self.engine}")
        n = max(8, round(_calibrate.SECONDS * p.rate))
        sent: dict[str, float] = {}
        next_submit = time.monotonic()
        for i in range(n):
            delay = next_submit - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            now = time.monotonic()
            # two rooms per request, as in the runs (one through each decode server): the
            # prefills carry the runs' load (the one decode server here, twice its share)
            for _ in ARMS:
                for rid in self.send(PREFILLS[i % 2], (arm,)).values():
                    sent[rid] = now
            next_submit += rng.uniform(0.6, 1.4) / p.rate
        deadline = time.monotonic() + 60
        while self.decode(arm).rpc.call("snapshot")["rows"]:
            if time.monotonic() > deadline:
                raise HarnessError(f"{self.engine}: decode warm-up measurement did not finish")
            time.sleep(0.05)
        got = self.decode(arm).rpc.call("collect")
        rtts, failed = [], 0
        for rid, rel in got["released"].items():
            if rid not in sent:
                continue
            if rel[1]:
                rtts.append(rel[0] - sent[rid])
            else:
                failed += 1
        first = min(sent.values())
        gaps = _calibrate.pass_gaps(s[0] for s in got["samples"] if s[0] >= first)
        self.profile, self.calibration = _calibrate.derive(p, "decode", rtts, gaps, failed)
        self.reset()

    def reset(self) -> dict[str, dict]:
        """Clear the decode servers and both prefills; returns what the prefills said."""
        for arm in self.arms():
            left = self.decode(arm).rpc.call("reset", timeout=20)
            if left:
                raise HarnessError(f"{self.engine}: decode {arm} kept {left} requests")
        out = {}
        for name in PREFILLS:
            self.prefill(name).signal(signal.SIGCONT)
            out[name] = self.prefill(name).rpc.call("reset", timeout=20)
        return out

    def stop(self) -> None:
        for worker in self.workers.values():
            worker.stop()


class DecodeRun:
    """One decode-side scenario, both arms at once (see the module docstring)."""

    def __init__(self, rig: DecodeRig, scenario: str, seed: int):
        self.rig = rig
        self.p = rig.profile
        self.scenario = scenario
        self.rng = random.Random(f"{seed}-{rig.engine}-{scenario}")
        self.meta: dict[str, dict] = {}  # rid -> {prefill, t}
        self.results = {
            arm: RunResult(rig.engine, scenario, arm, side="decode", calibration=rig.calibration)
            for arm in ARMS
        }
        self.recovered: float | None = None  # prefill A worked through its backlog

    def _inject(self) -> None:
        a = self.rig.prefill("A").rpc
        if self.scenario == "prefill-freeze":
            a.call("flag", name="freeze_on_submit")
        else:  # a request pinned on each decode server, whichever is faster
            a.call("freeze_after_metadata", tags=list(self.rig.arms()))

    def execute(self) -> list[RunResult]:
        p = self.p
        a = self.rig.prefill("A")
        t0 = time.monotonic()
        for r in self.results.values():
            r.t0 = t0
        fault_armed = fault_start = observed = fault_end = None
        next_submit, stop_submit, phase, arm_deadline = t0, None, "pre", 0.0
        while True:
            now = time.monotonic()
            if stop_submit is None or now < stop_submit:
                while now >= next_submit:
                    prefill = self.rng.choice(PREFILLS)
                    for rid in self.rig.send(prefill).values():
                        self.meta[rid] = {"prefill": prefill, "t": now}
                    next_submit += self.rng.uniform(0.6, 1.4) / p.rate
            if phase == "pre" and now >= t0 + p.pre:
                fault_armed = now
                self._inject()
                # a loaded machine needs longer to bring a room of each server to it
                arming = 3.0 * self.rig.calibration.get("scale", 1.0)
                phase, arm_deadline = "arming", now + arming
            elif phase == "arming":
                if a.state() == "T":
                    fault_start, phase = now, "fault"
                elif now > arm_deadline:
                    raise HarnessError(
                        f"{self.rig.engine}/{self.scenario}: prefill A did not stop within "
                        f"{arming:g} s"
                    )
            elif phase == "fault" and now >= fault_start + p.window:
                observed = self._observe()
                a.signal(signal.SIGCONT)
                fault_end = time.monotonic()
                a.rpc.send("mark")  # handled once A has worked through its backlog
                phase, stop_submit = "post", fault_end + p.post
            elif phase == "post" and now >= stop_submit:
                break
            time.sleep(min(0.01, max(0.001, next_submit - time.monotonic())))
        for r in self.results.values():
            r.fault_armed, r.fault_start, r.fault_end = fault_armed, fault_start, fault_end
            r.observed_at = observed
        self._drain()
        return [self.results[arm] for arm in ARMS]

    def _overdue(self, snap: dict) -> list[tuple]:
        """Requests whose phase's deadline had passed when their queue's last call
        started, and that are still queued after it."""
        out = []
        for rid, queue, phase, since in snap["rows"]:
            if phase not in self.p.decode_deadlines[queue]:
                continue
            due = since + self.p.decode_deadline(queue, phase)
            last = snap["last_call"][queue]
            if due + EPS <= last:
                out.append((rid, queue, phase, round(last - due, 3)))
        return out

    def _observe(self) -> float:
        for arm in ARMS:
            snap = self.rig.decode(arm).rpc.call("snapshot")
            r = self.results[arm]
            r.pinned_detail = self._overdue(snap)
            r.pinned = len(r.pinned_detail)
        return time.monotonic()

    def _drain(self) -> None:
        # + the resumed prefill's backlog (longer on a slower machine, with a longer window)
        backlog = 2.0 * self.rig.calibration.get("scale", 1.0)
        deadline = time.monotonic() + self.p.drain + backlog
        rows = {arm: self.rig.decode(arm).rpc.call("snapshot")["rows"] for arm in ARMS}
        while any(rows.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
            rows = {arm: self.rig.decode(arm).rpc.call("snapshot")["rows"] for arm in ARMS}
        end = time.monotonic()
        collected = {}
        for arm in ARMS:
            r = self.results[arm]
            r.end = end
            r.left_detail = [
                (rid, queue, phase, round(end - since, 3)) for rid, queue, phase, since in rows[arm]
            ]
            r.left = len(rows[arm])
            try:
                collected[arm] = self.rig.decode(arm).rpc.call("collect", timeout=20)
            except WorkerError as exc:
                r.problems.append(str(exc))
        marks = self.rig.reset().get("A", {}).get("marks", [])
        self.recovered = marks[0] if marks else None
        for r in self.results.values():
            r.recovered_at = self.recovered
        for arm, got in collected.items():
            self._tally(self.results[arm], got, {row[0] for row in rows[arm]})

    def _faulted(self, rid: str, t_release: float | None) -> bool:
        """Was this request in the fault's way? B's requests never are; A's are if they
        were unfinished when the fault was triggered and reached A before it had worked
        through the requests that arrived while it was stopped (its registrations come
        late, by the backlog's length)."""
        m, r = self.meta[rid], self.results["without"]
        if m["prefill"] != "A" or r.fault_armed is None:
            return False
        before_recovery = self.recovered is None or m["t"] < self.recovered
        return before_recovery and (t_release is None or t_release > r.fault_armed)

    def _tally(self, r: RunResult, got: dict, left_ids: set[str]) -> None:
        p = self.p
        mine = [rid for rid in self.meta if rid.startswith(f"{r.arm}-")]
        r.sent = len(mine)
        r.loop_interval_ms = round(1000 * p.loop_interval, 1)
        # samples as the prefill side keeps them: (pass start, pass end, queued, pending)
        r.samples = [
            (s[0], s[2], s[3] + s[4], s[5]) for s in got["samples"] if r.t0 <= s[0] <= r.end
        ]
        # the guarded calls: prealloc from s[0] to s[1], transfer from s[1] to s[2]
        window = [s for s in got["samples"] if r.t0 <= s[0] <= r.end]
        r.measure_slack([d for s in window for d in (s[1] - s[0], s[2] - s[1])])
        starts = [s[0] for s in r.samples]
        r.max_pass_gap_ms = round(
            1000 * max((b - a for a, b in itertools.pairwise(starts)), default=0.0),
            1,
        )
        calls = {
            "prealloc": [s[0] for s in got["samples"]],
            "transfer": [s[1] for s in got["samples"]],
        }
        released = got["released"]
        for rid in mine:
            rel = released.get(rid)
            t_release = rel[0] if rel else None
            faulted = self._faulted(rid, t_release)
            r.faulted += faulted
            r.healthy += not faulted
            outcome = "left" if rid in left_ids else _outcome(rel)
            r.requests[rid] = [
                self.meta[rid]["prefill"],
                round(self.meta[rid]["t"] - r.t0, 4),
                None if rel is None else round(rel[0] - r.t0, 4),
                outcome,
                faulted,
                [],
            ]
            if rid in left_ids:
                continue
            if rel is None:
                r.problems.append(f"{rid}: neither released nor left in a queue")
                continue
            t, ok, reason, queue, phase, since = rel
            if ok:
                r.completed += 1
                r.releases.append((t, "completed"))
                continue
            key = (
                f"stallguard: {queue} {phase} deadline"
                if STALLGUARD_MARK in reason
                else _reason_key(reason)
            )
            r.reasons[key] = r.reasons.get(key, 0) + 1
            by_stallguard = STALLGUARD_MARK in reason
            if by_stallguard:
                r.failed_stallguard += 1
                r.releases.append((t, "stallguard"))
                r.forced(t, since + p.decode_deadline(queue, phase), calls[queue])
            else:
                r.failed_sglang += 1
                r.releases.append((t, "sglang"))
            if not faulted:
                r.healthy_failed += 1
                false_positive(
                    r,
                    rid,
                    self.meta[rid]["prefill"],
                    self.meta[rid]["t"],
                    t,
                    "stallguard" if by_stallguard else "SGLang",
                    reason,
                    phase=f"{queue} {phase}" if by_stallguard else None,
                    since=since if by_stallguard else None,
                    deadline=p.decode_deadline(queue, phase) if by_stallguard else None,
                )


def run_all(
    engines: list[str],
    scenarios: list[str],
    profile: Profile,
    out: Path,
    seed: int = 0,
    log=print,
    thaw: list | None = None,
) -> list[RunResult]:
    """Run every decode-side scenario (both arms at once) for each engine; the thaw
    (``prefill-freeze-write``, ``_thaw.py``: its own processes, the arms one after the
    other) after the others, with the rig's derived deadlines; its results are appended
    to *thaw*."""
    results: list[RunResult] = []
    thaw_wanted = [s for s in scenarios if s in THAW_SCENARIOS]
    scenarios = [s for s in scenarios if s not in THAW_SCENARIOS]
    for engine in engines:
        t = time.monotonic()
        rig = DecodeRig(engine, profile, out, log=log)
        try:
            rig.start()
            log(
                f"[{engine}] bootstrap + 2 prefills + 2 decode servers up and warm in "
                f"{time.monotonic() - t:.1f}s; {_calibrate.describe(rig.calibration)}"
            )
            for scenario in scenarios:
                t = time.monotonic()
                runs = DecodeRun(rig, scenario, seed).execute()
                results += runs
                for result in runs:
                    log(progress_line(result, time.monotonic() - t))
        finally:
            rig.stop()
        if thaw_wanted:
            got = _thaw.run(engine, rig.profile, out, log=log)
            if thaw is not None:
                thaw += got
    return results
