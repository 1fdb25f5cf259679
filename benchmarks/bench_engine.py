#!/usr/bin/env python3
"""The deadline engine, before and after, side by side with arms alternating.

bench_core.py runs each arm's series one after the other; on a shared 2-core machine
whose load moves by tens of percent in seconds, that makes its ratios drift. This
script times the same operations with the arms **alternating batch by batch** in one
process, so that every arm sees the same machine, and prints ratios:

* ``stallguard``: this checkout's watchdog (lazy per-clock FIFOs);
* ``previous``: the watchdog as of git revision ``--previous`` (default ``0b9bc74``, the
  ``OrderedDict`` engine), extracted from this repository's history into a temporary
  directory and imported as a separate package;
* ``naive scan``'s plain dict update and ``asyncio call_at`` (from bench_core.py).

Rows (issue 14's targets): state change (no slower than the naive dict update), same-state
observe, ``check()`` with nothing due (unchanged), one expiry per check (≤ 1.5 µs), the
guarded poll's added cost (at most 2x the asyncio arm's). ``--quick`` is a smoke test.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import bench_core as bc  # noqa: E402

import stallguard as sg  # noqa: E402
from stallguard.instrumentation import set_on_expire_hooks  # noqa: E402

pc = time.perf_counter_ns


def load_previous(rev: str) -> Any:
    """The ``stallguard`` package at git *rev*, imported as ``stallguard_previous``."""
    root = Path(tempfile.mkdtemp(prefix="stallguard-previous-"))
    archive = subprocess.run(
        ["git", "-C", str(HERE.parent), "archive", rev, "stallguard"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    (root / "stallguard").rename(root / "stallguard_previous")
    sys.path.insert(0, str(root))
    module = importlib.import_module("stallguard_previous")
    module.instrumentation.set_on_expire_hooks([])
    return module


class Arm:
    """A watchdog of either package, driven directly."""

    def __init__(self, name: str, pkg: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        spec = pkg.Spec(
            name="bench", deadlines=dict.fromkeys(bc.LIVE, bc.LONG), terminal=bc.TERMINAL
        )
        self.wd = pkg.Watchdog(spec, clock=clock)
        self.observe = self.wd.observe
        self.check = self.wd.check

    def guard(self, poll: Callable[[Any], int]) -> Callable[[Any], int]:
        return self.wd.guard(key=lambda s: s.room, failed=0, state=bc.KVPOLL)(poll)  # type: ignore[no-any-return]


#: collections the automatic collector ran, per arm (see charged())
COLLECTIONS: dict[str, int] = {}
_current: list[str] = [""]


class _Trigger:
    """Allocating one always goes through the collector's allocation count (a list or
    a tuple may come from a free list, which does not)."""


def _count_collections(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        COLLECTIONS[_current[0]] = COLLECTIONS.get(_current[0], 0) + 1


def charged(name: str, run: Callable[[int], tuple[int, int]]) -> Callable[[int], tuple[int, int]]:
    """*run* charged its own garbage collections. The automatic collector is off while
    the batch runs; right after it, one allocation with the collector back on runs
    whatever collection the batch's own allocations made due (CPython's own thresholds
    and generation rules decide which), timed and added to this arm's batch. So a
    collection that one arm's garbage makes due is never paid inside another arm's
    batch (before this, the arms' batches interleaved and each paid collections that the
    others had made due). The collections each arm ran are counted in COLLECTIONS."""

    def run_charged(b: int) -> tuple[int, int]:
        _current[0] = name
        timer = bc.pc  # the series' timer (--timer)
        gc.disable()
        try:
            dt, done = run(b)
            t0 = timer()
            gc.enable()
            _Trigger()  # a GC-tracked allocation (no free list): runs any collection due
            dt += timer() - t0
        finally:
            gc.enable()
            _current[0] = ""
        return dt, done

    return run_charged


def alternate(
    series: dict[str, Callable[[int], tuple[int, int]]], opts: bc.Opts
) -> dict[str, list[float]]:
    """Round-robin batches of every arm's series (about 1 ms each), each charged its own
    garbage collections (charged()); per-op samples."""
    gc.collect()
    series = {name: charged(name, run) for name, run in series.items()}
    batch = {}
    for name, run in series.items():
        dt, done = run(1)
        batch[name] = int(min(opts.max_batch, max(1, 1_000_000 / max(dt / max(done, 1), 1.0))))
    samples: dict[str, list[float]] = {name: [] for name in series}
    end = pc() + int(opts.budget_s * len(series) * 1e9)
    rounds = 0
    while rounds < opts.max_samples and (rounds < opts.min_samples or pc() < end):
        for name, run in series.items():
            dt, done = run(batch[name])
            samples[name].append(dt / done)
        rounds += 1
    return samples


def tracked(make: Callable[[], Any], keys: list[int]) -> Any:
    arm = make()
    for k in keys:
        arm.observe(k, "Bootstrapping")
    return arm


def expiry_one_per_check(
    makers: dict[str, Callable[[bc.SetClock], Any]], keys: list[int], opts: bc.Opts
) -> dict[str, list[float]]:
    """N tracked, entering one per second; each check finds exactly one due. The arms'
    checks alternate; wall time per check."""
    samples: dict[str, list[float]] = {name: [] for name in makers}
    end = pc() + int(opts.budget_s * len(makers) * 1e9)
    rounds = 0
    while rounds < opts.min_samples or (pc() < end and rounds < opts.max_samples):
        arms = {}
        for name, make in makers.items():
            clock = bc.SetClock()
            arm = make(clock)
            for k in keys:
                clock.now += 1.0
                arm.observe(k, "Transferring")
            arms[name] = (arm, clock)
        for j in range(1, min(100, len(keys)) + 1):
            for name, (arm, clock) in arms.items():
                clock.now = now = j + bc.LONG
                t0 = bc.pc()
                done = len(arm.check(now))
                dt = bc.pc() - t0
                if done != 1:
                    raise RuntimeError(f"{name}: expired {done}, expected 1")
                samples[name].append(dt)
        rounds += 1
    return samples


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test, not a measurement")
    parser.add_argument(
        "--sizes", default=None, help="comma-separated N (default 1000,10000,100000)"
    )
    parser.add_argument("--previous", default="0b9bc74", help="git revision of the previous engine")
    parser.add_argument(
        "--timer",
        choices=("wall", "cpu"),
        default="wall",
        help="time the batches by the wall clock (default) or by this thread's CPU time "
        "(time.thread_time_ns: on a loaded shared machine it leaves out the time the "
        "process waits for a core; cache contention stays in)",
    )
    args = parser.parse_args()
    if args.timer == "cpu":
        bc.pc = time.thread_time_ns
    opts = bc.Opts(args.quick)
    sizes = [
        int(s)
        for s in (args.sizes or ("100,1000" if args.quick else "1000,10000,100000")).split(",")
    ]
    set_on_expire_hooks([])
    gc.callbacks.append(_count_collections)
    prev = load_previous(args.previous)
    print(
        "# deadline engine: this checkout vs", args.previous, "(arms alternating batch by batch)\n"
    )
    print(
        f"- python {sys.version.split()[0]}, timer {args.timer}, load average "
        f"{os.getloadavg()[0]:.2f} at start\n"
    )
    print(
        "| operation | N | stallguard | previous | naive dict | asyncio call_at "
        "| stallguard / naive | stallguard / previous |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        keys = bc.make_keys(n)
        arms = {
            "stallguard": tracked(lambda: Arm("stallguard", sg), keys),
            "previous": tracked(lambda: Arm("previous", prev), keys),
            "naive": tracked(bc.NaiveArm, keys),
            "asyncio": tracked(bc.AsyncioArm, keys),
        }
        same = alternate(
            {name: bc.observe_series(a.observe, keys, same=True) for name, a in arms.items()}, opts
        )
        idle = alternate(
            {name: bc.check_series(arms[name].check) for name in ("stallguard", "previous")}, opts
        )
        change = alternate(
            {name: bc.observe_series(a.observe, keys, same=False) for name, a in arms.items()}, opts
        )
        arms["asyncio"].close()
        row("state change", n, change)
        row("same-state observe", n, same)
        row("check(), nothing due", n, idle)
        expiry = expiry_one_per_check(
            {
                "stallguard": lambda clock: Arm("stallguard", sg, clock),
                "previous": lambda clock: Arm("previous", prev, clock),
            },
            keys,
            opts,
        )
        row("expiry, one per check", n, expiry)
        senders = [bc.Sender(k) for k in keys]
        guards = {}
        for name, make in (
            ("stallguard", lambda: Arm("stallguard", sg)),
            ("previous", lambda: Arm("previous", prev)),
            ("asyncio", bc.AsyncioArm),
        ):
            arm = make()
            for s in senders:
                arm.observe(s.room, bc.KVPOLL[bc.TRANSFERRING])
            guards[name] = (arm, arm.guard(bc.Sender.poll))
        bare: list[float] = []
        polls = alternate(
            {name: bc.guard_series(g, senders, bare) for name, (_, g) in guards.items()}, opts
        )
        guards["asyncio"][0].close()
        row("guarded poll, added", n, polls)
    print(f"\n- load average at end {os.getloadavg()[0]:.2f}")
    shown = ", ".join(f"{name} {count:,}" for name, count in sorted(COLLECTIONS.items()) if name)
    print(f"- garbage collections charged to each arm's batches: {shown}")
    return 0


def row(op: str, n: int, samples: dict[str, list[float]]) -> None:
    def cell(name: str) -> str:
        xs = samples.get(name)
        return "—" if not xs else f"{med(xs):.0f} ns"

    sg_ = med(samples["stallguard"])
    naive = f"{sg_ / med(samples['naive']):.2f}" if "naive" in samples else "—"
    asyn = f"{sg_ / med(samples['asyncio']):.2f}" if "asyncio" in samples else "—"
    ref = naive if "naive" in samples else asyn
    print(
        f"| {op} | {n:,} | {cell('stallguard')} | {cell('previous')} | {cell('naive')} | "
        f"{cell('asyncio')} | {ref} | {sg_ / med(samples['previous']):.2f} |",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
