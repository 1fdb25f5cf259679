#!/usr/bin/env python3
"""One row of bench_engine.py, tighter: the state change only, three arms.

This checkout's watchdog, the engine at git ``--previous`` (or, with ``--compiled``,
this checkout's compiled core: bench_engine.load_compiled) and a naive locked dict
update take turns batch by batch (1,000 state changes each, every key moved to a live
state other than its own) in one process, each batch timed by this thread's CPU time
(``time.thread_time_ns``: on a loaded shared machine it leaves out the time the process
waits for a core) and charged the garbage collection its own allocations made due
(bench_engine.charged: the automatic collector off, each batch followed by the young
collections of its own allocations, and charged for its survivors the share of a full
collection that CPython's rule makes them cost).
A fourth arm, a bare dict store (``d[key] = state`` through the bound ``__setitem__``),
is the floor any tracking costs. Fewer arms and tighter alternation than
bench_engine.py: on this machine the ratio to the previous engine is stable to a few
percent where bench_engine's moves by tens. Prints the medians and the ratios.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import bench_core as bc  # noqa: E402
import bench_engine as be  # noqa: E402

import stallguard as sg  # noqa: E402
from stallguard.instrumentation import set_on_expire_hooks  # noqa: E402

BATCH = 1000


class Naive:
    """The naive arm: a dict of (state, entered_at) under a lock."""

    def __init__(self, n: int) -> None:
        self.lock = threading.Lock()
        self.d = {k: ("A", 0.0) for k in range(n)}

    def observe(self, key: int, state: str) -> None:
        with self.lock:
            self.d[key] = (state, time.monotonic())


def watchdog(pkg: Any, n: int) -> Any:
    spec = pkg.Spec(name="b", deadlines={"A": 1e6, "B": 1e6, "C": 1e6}, terminal=["S"])
    wd = pkg.Watchdog(spec)
    for k in range(n):
        wd.observe(k, "A")
    return wd


def series(observe: Callable[[int, str], None], n: int) -> Callable[[int], tuple[int, int]]:
    """Batches over consecutive keys; each pass over the keys moves them to B, then C."""
    pos = 0
    rnd = 0

    def run(b: int) -> tuple[int, int]:
        nonlocal pos, rnd
        b = min(b, n - pos)
        state = "BC"[rnd % 2]
        keys = range(pos, pos + b)
        t0 = bc.pc()
        for k in keys:
            observe(k, state)
        dt = bc.pc() - t0
        pos += b
        if pos == n:
            pos, rnd = 0, rnd + 1
        return dt, b

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,100000,1000000", help="comma-separated N")
    parser.add_argument("--rounds", type=int, default=100, help="batches per arm")
    parser.add_argument("--previous", default="b512bf4", help="git revision of the engine before")
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="the second arm is this checkout's compiled core, not --previous",
    )
    args = parser.parse_args()
    bc.pc = time.thread_time_ns
    set_on_expire_hooks([])
    prev = be.load_compiled() if args.compiled else be.load_previous(args.previous)
    other = "this checkout compiled (mypyc)" if args.compiled else args.previous
    print(f"# state change, CPU time, this checkout vs {other} vs a naive locked dict\n")
    label = "compiled" if args.compiled else "previous"
    print(
        f"| N | this | {label} | naive | dict store | this / {label} | this / naive "
        f"| {label} / naive | this / dict store | {label} / dict store | load |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    shares: list[str] = []
    for n in (int(s) for s in args.sizes.split(",")):
        arms = {
            "this": watchdog(sg, n).observe,
            "previous": watchdog(prev, n).observe,
            "naive": Naive(n).observe,
            "store": dict.fromkeys(range(n), "A").__setitem__,
        }
        runs = {name: be.charged(name, series(obs, n)) for name, obs in arms.items()}
        samples: dict[str, list[float]] = {name: [] for name in runs}
        be.measure_full_collection()
        gc.disable()  # (charged() runs each arm's collections itself)
        try:
            for _ in range(args.rounds):
                for name, run in runs.items():
                    dt, done = run(BATCH)
                    samples[name].append(dt / done)
        finally:
            gc.enable()
        samples = be.amortized(samples)
        med = {name: statistics.median(xs) for name, xs in samples.items()}
        this, other_, naive, store = (med[k] for k in ("this", "previous", "naive", "store"))
        print(
            f"| {n:,} | {this:,.0f} ns | {other_:,.0f} ns | {naive:,.0f} ns | {store:,.0f} ns "
            f"| {this / other_:.2f} | {this / naive:.2f} | {other_ / naive:.2f} "
            f"| {this / store:.2f} | {other_ / store:.2f} | {os.getloadavg()[0]:.1f} |",
            flush=True,
        )
        shares.append(
            f"{n:,}: "
            + ", ".join(
                f"{k} {v:,.0f} ({be.SURVIVORS_PER_OP[k]:.2f} survivors/op)"
                for k, v in be.GC_PER_OP.items()
            )
            + f"; a full collection {be._full_ns[0] / 1e6:,.1f} ms over "
            + f"{be._long_lived[0]:,} objects"
        )
    print("\n- of which garbage collection, ns per state change (in the figures above):")
    for line in shares:
        print(f"  - {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
