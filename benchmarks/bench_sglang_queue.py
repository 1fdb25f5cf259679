#!/usr/bin/env python3
"""What stallguard-sglang costs an iteration of SGLang's prefill inflight queue.

Runs the REAL ``SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue``
of the installed SGLang over N inflight requests with real ``NixlKVSender`` objects
(managers without a transfer engine: ``sglang_support`` in adapters/sglang/tests), in
three arms that alternate in this one process:

* ``disabled``: SGLang as shipped;
* ``enabled``: stallguard-sglang as a server loads it: ``STALLGUARD_SGLANG_CONFIG`` names a
  config file and SGLang's own ``load_plugins()`` applies the hooks (the inflight-queue
  AROUND hook and the ``update_status`` hook that observes state changes where they
  happen);
* ``naive``: the re-poll design the adapter replaced, for comparison: before each
  iteration, poll every queued sender locally and ``observe()`` its state, ``check()``,
  then call the original and forget the requests that left.

``load_plugins()`` patches the classes once; the arms take turns by putting either the
functions it installed or the originals (``__wrapped__``) back on the classes. Each arm
has its own scheduler, manager and requests. Every iteration of every arm does the same
work: a few rooms change state through the manager's ``update_status`` (two reach
Success and leave the queue, two move from WaitingForInput to Transferring), then the
queue method runs; two new requests join the queue afterwards, outside the timing, so N
stays constant. The timing covers the ``update_status`` calls and the queue call.

Prints, per N, the median per-iteration time of each arm (and per request) and the
enabled/disabled and naive/disabled ratios of the medians. The garbage collector stays on.
``--interleave`` runs the churn mix of issue 14 instead of batches: the arms alternate
iteration by iteration (``--rounds`` x ``--batch`` iterations per arm, one at a time, no
collection between them). ``--breakdown`` also times, in the same iterations, where the
enabled arm's extra time goes: its ``update_status`` calls (against the disabled arm's),
and the queue guard's work before and after SGLang's method (the rest of the difference
is the hooks' call frames and what the adapter's work does to the caches SGLang's pass
then misses). ``--quick`` only checks that the script works.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# sglang_support lives with the adapter's tests (tools/dev.py's .pth also puts it there)
sys.path.insert(0, str(ROOT / "adapters" / "sglang" / "tests"))

from stallguard_sglang._kvpoll import KVPOLL, LIVE_STATES  # noqa: E402 (cheap: no SGLang)

WFI, TRANSFERRING, SUCCESS = 2, 3, 4
CONFIG = """
# nothing may expire while the queue is timed
[prefill.deadlines]
Bootstrapping = 1e6
WaitingForInput = 1e6
Transferring = 1e6
"""
# --watch-all: a progress window on Transferring, so that every request in Transferring
# also has a progress window in the watchdog (every repeated update_status renews it)
CONFIG_WATCH_ALL = """
[prefill.deadlines]
Bootstrapping = 1e6
WaitingForInput = 1e6
Transferring = { seconds = 1e6, stall = 1e6 }
"""
pc = time.perf_counter_ns


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Arm:
    """One scheduler with N inflight NIXL requests, driven identically in every arm."""

    def __init__(
        self, name: str, n: int, sgs: Any, install: dict[Any, Any], churn: int = 2
    ) -> None:
        self.name = name
        self.churn = churn
        self.sgs = sgs
        self.install = install  # {(class, attribute): function} for this arm
        self.sched = sgs.FakeScheduler()
        self.mgr = sgs.make_manager("nixl")
        self.n = n
        self.counter = 0
        self.samples: list[int] = []
        self.updates: list[int] = []  # the update_status calls' share of each sample
        self.round_medians: list[float] = []
        self.waiting: collections.deque[int] = collections.deque()  # rooms in WaitingForInput
        self.sched.disagg_prefill_inflight_queue.extend(self.new_request() for _ in range(n))

    def new_request(self) -> Any:
        sgs = self.sgs
        self.counter += 1
        sender = sgs.make_sender(self.mgr, sgs.next_room())
        sgs.set_status(sender, WFI)
        if self.counter % 2:
            sgs.set_status(sender, TRANSFERRING)
        else:
            self.waiting.append(sender.bootstrap_room)
        return sgs.make_request(f"{self.name}-{self.counter}", sender)

    def activate(self) -> None:
        for (cls, attr), fn in self.install.items():
            setattr(cls, attr, fn)

    def iterate(self, iterations: int) -> None:
        sched, mgr = self.sched, self.mgr
        queue_call = sched.process_disagg_prefill_inflight_queue
        for _ in range(iterations):
            queue = sched.disagg_prefill_inflight_queue
            # `churn` requests complete (the oldest), `churn` move on to Transferring
            churn = self.churn
            done = [r.bootstrap_room for r in queue[:churn]]
            moving = []
            while len(moving) < churn and self.waiting:
                room = self.waiting.popleft()
                if room not in done and mgr.request_status.get(room) == WFI:
                    moving.append(room)
            changes = [(room, SUCCESS) for room in done] + [(room, TRANSFERRING) for room in moving]
            update = mgr.update_status
            t0 = pc()
            for room, status in changes:
                update(room, status)
            t1 = pc()
            queue_call()
            self.samples.append(pc() - t0)
            self.updates.append(t1 - t0)
            # refill outside the timing: N stays constant
            missing = self.n - len(sched.disagg_prefill_inflight_queue)
            sched.disagg_prefill_inflight_queue.extend(self.new_request() for _ in range(missing))


class GuardTimer:
    """``--breakdown``: times the queue guard's ``before`` and ``after`` (patched on the
    guard *instance*, so only the enabled arm's calls are timed)."""

    def __init__(self) -> None:
        self.before: list[int] = []
        self.after: list[int] = []

    def install(self, guard: Any) -> None:
        cls = type(guard)

        def before(queue: Any) -> None:
            t = pc()
            cls.before(guard, queue)
            self.before.append(pc() - t)

        def after(*args: Any) -> None:
            t = pc()
            cls.after(guard, *args)
            self.after.append(pc() - t)

        guard.before = before
        guard.after = after


class NoStats:
    """The lane's time-in-state export switched off (``--statistics``; the watchdog's
    recording is switched off separately): the adapter's call remains, as a no-op."""

    def tick(self, now: float) -> None:
        pass


def naive_around(original: Any, sched: Any, *args: Any, **kwargs: Any) -> Any:
    """The re-poll design: local poll + observe of every queued sender, every iteration."""
    wd = sched.__dict__.get("_naive_wd")
    if wd is None:
        import stallguard as sg

        spec = sg.Spec(
            name="naive",
            deadlines=dict.fromkeys(LIVE_STATES, 1e6),
            terminal=("Success", "Failed"),
        )
        wd = sched._naive_wd = sg.Watchdog(spec)
    observe = wd.observe
    for req in sched.disagg_prefill_inflight_queue:
        observe(req.rid, KVPOLL[req.disagg_kv_sender.poll()])
    wd.check()
    done = original(sched, *args, **kwargs)
    for req in done:
        wd.forget(req.rid, remember=False)
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", default="100,1000,10000", help="inflight requests per run")
    parser.add_argument("--rounds", type=int, default=40, help="alternations of the arms")
    parser.add_argument("--batch", type=int, default=10, help="iterations per arm per round")
    parser.add_argument(
        "--churn",
        default="2",
        help="requests completing (and joining) per iteration, with as many moving from "
        "WaitingForInput to Transferring; a comma-separated list runs each",
    )
    parser.add_argument(
        "--watch-all",
        action="store_true",
        help="configure a progress window (stall) on Transferring as well",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="alternate the arms iteration by iteration (rounds x batch iterations per "
        "arm, one at a time) instead of in batches",
    )
    parser.add_argument(
        "--statistics",
        action="store_true",
        help="add a fourth arm: enabled, with the time-in-state statistics switched off "
        "(no-op recorder, no export), to measure what recording them costs",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time the enabled arm's update_status calls and its guard's work before "
        "and after the queue method (where its extra time goes)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny run: checks the script only")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    churns = [int(c) for c in args.churn.split(",")]
    if args.quick:
        counts, args.rounds, args.batch = [50], 2, 3
    if args.interleave:
        args.rounds, args.batch = args.rounds * args.batch, 1

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as config:
        config.write(CONFIG_WATCH_ALL if args.watch_all else CONFIG)
    os.environ["STALLGUARD_SGLANG_CONFIG"] = config.name
    os.environ.pop("STALLGUARD_SGLANG", None)

    t_import = time.monotonic()
    import sglang
    import sglang_support as sgs
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin
    from sglang.srt.plugins import load_plugins

    from stallguard.instrumentation import set_on_expire_hooks

    log(f"imported sglang {sglang.__version__} in {time.monotonic() - t_import:.1f}s")

    mixin, manager = SchedulerDisaggregationPrefillMixin, CommonKVManager
    queue_attr, status_attr = "process_disagg_prefill_inflight_queue", "update_status"
    # (locals, on purpose: load_plugins() rebinds every *module global* that holds the
    # original function to the hooked one (HookRegistry's _propagate_patch), so a harness
    # keeping the originals in module globals would time the adapter in every arm)
    original_queue = mixin.__dict__[queue_attr]
    original_status = manager.__dict__[status_attr]
    load_plugins()  # as run_scheduler_process does: the adapter's register() runs here
    enabled_queue = mixin.__dict__[queue_attr]
    enabled_status = manager.__dict__[status_attr]
    if enabled_queue.__wrapped__ is not original_queue or enabled_status is original_status:
        raise SystemExit("load_plugins() did not install stallguard-sglang's hooks")
    set_on_expire_hooks([])  # nothing expires; keep the hooks out of the picture anyway

    def naive_queue(self: Any, *a: Any, **k: Any) -> Any:
        return naive_around(original_queue, self, *a, **k)

    installs = {
        "disabled": {(mixin, queue_attr): original_queue, (manager, status_attr): original_status},
        "enabled": {(mixin, queue_attr): enabled_queue, (manager, status_attr): enabled_status},
        "naive": {(mixin, queue_attr): naive_queue, (manager, status_attr): original_status},
    }
    if args.statistics:
        installs["no stats"] = installs["enabled"]
    sgs.setup_context(0, 1)

    results = []
    breakdowns: list[tuple[int, dict[str, float]]] = []
    in_watchdog: list[str] = []  # per row: requests the enabled arm guards
    load0 = os.getloadavg()[0]
    for n, churn in [(n, c) for n in counts for c in churns]:
        log(f"N={n}, churn {churn}: building {3 * n} requests")
        arms = []
        for name, install in installs.items():
            arm = Arm(name, n, sgs, install, churn)
            arm.activate()  # creation goes through this arm's update_status
            arms.append(arm)
        for arm in arms:  # warm-up: enrolls the initial requests (not timed)
            arm.activate()
            arm.iterate(3)
            arm.samples.clear()
            arm.updates.clear()
        timer = GuardTimer()
        if args.breakdown:
            timer.install(arms[1].sched._stallguard_inflight_guard)
            if arm.name == "no stats":
                for lane in arm.sched._stallguard_inflight_guard.checks:
                    lane.stats = NoStats()
                    lane.wd._stats = None  # as with Watchdog(statistics=False)
                    for slot in lane.wd._live:
                        slot.hist = None
        for r in range(args.rounds):
            order = arms if r % 2 == 0 else arms[::-1]
            for arm in order:
                arm.activate()
                if not args.interleave:
                    gc.collect()
                start = len(arm.samples)
                arm.iterate(args.batch)
                arm.round_medians.append(statistics.median(arm.samples[start:]))
        medians = {arm.name: statistics.median(arm.samples) for arm in arms}
        # the same ratio from rounds run back to back: robust to slow drifts in load
        paired = {
            arm.name: statistics.median(
                a / b for a, b in zip(arm.round_medians, arms[0].round_medians, strict=True)
            )
            for arm in arms
        }
        for arm in arms:
            if len(arm.sched.disagg_prefill_inflight_queue) != n:
                raise SystemExit(f"{arm.name}: the queue no longer holds {n} requests")
        arms[1].activate()
        arms[1].sched.process_disagg_prefill_inflight_queue()  # enrolls the last refill
        guard = getattr(arms[1].sched, "_stallguard_inflight_guard", None)
        tracked = len(guard.entries) if guard else 0
        if tracked != n:
            raise SystemExit(f"enabled arm guards {tracked} requests, expected {n}")
        watched = sum(len(wd) for wd in guard.watchdogs.values())
        held = sum(entry.young for lane in guard.checks for entry in lane.young)
        if watched + held != n:
            raise SystemExit(
                f"the enabled arm's watchdogs track {watched} and its lanes hold {held} "
                f"young requests, not {n} in all"
            )
        in_watchdog.append(f"{watched + held:,} of {n:,} ({watched:,} + {held:,})")
        results.append((n, churn, medians, len(arms[0].samples), paired))
        if args.breakdown:
            disabled, enabled = arms[0], arms[1]
            parts = {
                "difference": medians["enabled"] - medians["disabled"],
                "update_status": statistics.median(enabled.updates)
                - statistics.median(disabled.updates),
                "before": statistics.median(timer.before),
                "after": statistics.median(timer.after),
            }
            parts["rest"] = (
                parts["difference"] - parts["update_status"] - parts["before"] - parts["after"]
            )
            breakdowns.append((n, parts))
        log(
            f"N={n}, churn {churn}: "
            + ", ".join(f"{k} {v / 1000:.1f} us" for k, v in medians.items())
        )
    load1 = os.getloadavg()[0]

    print("## SGLang inflight queue: per-iteration cost\n")
    print(
        f"SGLang {sglang.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs, load average {load0:.2f} -> {load1:.2f}; "
        f"{args.rounds} alternations x {args.batch} iterations per arm and N"
        f"{'; --watch-all (a progress window on Transferring)' if args.watch_all else ''}"
        f"{'; --interleave (arms alternate every iteration)' if args.interleave else ''}.\n"
    )
    print(
        "| inflight N | churn | disabled | enabled | naive re-poll | enabled/disabled "
        "| naive/disabled |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n, churn, med, _samples, paired in results:
        d, e, v = med["disabled"], med["enabled"], med["naive"]
        print(
            f"| {n:,} | {churn} | {d / 1000:,.1f} us ({d / n:.0f} ns/req) | {e / 1000:,.1f} us "
            f"({e / n:.0f} ns/req) | {v / 1000:,.1f} us ({v / n:.0f} ns/req) | "
            f"{e / d:.3f} (paired {paired['enabled']:.3f}) | {v / d:.2f} |"
        )
        if "no stats" in med:
            o = med["no stats"]
            print(
                f"|  | statistics off | | {o / 1000:,.1f} us | | {o / d:.3f} (paired "
                f"{paired['no stats']:.3f}); statistics on/off {e / o:.3f} (paired "
                f"{paired['enabled'] / paired['no stats']:.3f}) | |"
            )
    print(
        f"\nMedians of {results[0][3]} iterations per arm and row, in microseconds per "
        "iteration (2 x churn update_status calls + one process_disagg_prefill_inflight_"
        "queue; churn requests join the queue after each, untimed) and nanoseconds per "
        "inflight request. Ratios: of the medians, and (paired) the median over rounds of "
        "the ratio of the round medians of arms run back to back."
    )
    print(
        "Requests the enabled arm guards at the end of each row (in its watchdogs + "
        "held young by its lanes until half the shortest deadline passed): "
        + ", ".join(in_watchdog)
        + "."
    )
    if breakdowns:
        print(
            "\nWhere the enabled arm's extra time goes (medians per iteration, us): "
            "update_status = its update_status calls minus the disabled arm's; before / "
            "after = the queue guard's work around SGLang's method (timed, which adds a "
            "little); rest = the difference minus those three.\n"
        )
        print("| inflight N | difference | update_status | before | after | rest |")
        print("|---:|---:|---:|---:|---:|---:|")
        for n, parts in breakdowns:
            print(
                f"| {n:,} | "
                + " | ".join(
                    f"{parts[k] / 1000:.1f}"
                    for k in ("difference", "update_status", "before", "after", "rest")
                )
                + " |"
            )
    ratios = [
        max(med["enabled"] / med["disabled"], paired["enabled"])
        for n, churn, med, _, paired in results
        if n >= 1000 and churn == 2
    ]
    if ratios:
        worst = max(ratios)
        target = 1.05 if args.watch_all else 1.03
        verdict = "PASS" if worst <= target else "MISS"
        print(
            f"\nTarget enabled/disabled <= {target} at N >= 1,000 (churn 2"
            f"{', progress window' if args.watch_all else ''}): worst {worst:.3f} ({verdict})"
        )
    os.unlink(config.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
