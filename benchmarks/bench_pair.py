#!/usr/bin/env python3
"""Two arms only: this checkout's watchdog and the one at git ``--previous``, on the
operations whose code a change should leave as fast as it was (a same-state observe,
an idle ``check()``), alternating batches of 2,000 operations, in both orders.

bench_engine.py's first arm reads 1.04-1.28x slower than its second on identical code
(its A/A); this probe has no such bias (A/A within 1-3 %), so it is the one to read for
"no slower". CPU time of this thread; the collector is off (neither operation
allocates). Prints the medians and the ratio per order.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import bench_engine as be  # noqa: E402

import stallguard as sg  # noqa: E402
from stallguard.instrumentation import set_on_expire_hooks  # noqa: E402

BATCH = 2000


def arm(pkg: Any, keys: list[int], op: str) -> Callable[[list[int]], None]:
    wd = pkg.Watchdog(pkg.Spec("b", {"A": 3600.0, "B": 3600.0}, terminal=["S"]))
    for k in keys:
        wd.observe(k, "A")
    observe, check = wd.observe, wd.check

    def same(chunk: list[int]) -> None:
        for k in chunk:
            observe(k, "A")

    def idle(chunk: list[int]) -> None:
        for _ in chunk:
            check()

    return same if op == "same" else idle


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,100000", help="comma-separated N")
    parser.add_argument("--rounds", type=int, default=60, help="batches per arm")
    parser.add_argument("--previous", default="813b18e", help="git revision to compare")
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="the 'previous' arm is this checkout's core compiled with mypyc",
    )
    args = parser.parse_args()
    set_on_expire_hooks([])
    prev = be.load_compiled() if args.compiled else be.load_previous(args.previous)
    other = "this checkout compiled (mypyc)" if args.compiled else args.previous
    tt = time.thread_time_ns
    print(f"# this checkout vs {other}, two arms alternating, CPU time\n")
    print("| operation | N | order | this | previous | this / previous | load |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for n in (int(s) for s in args.sizes.split(",")):
        keys = [(1 << 62) + 7919 * i for i in range(n)]
        for op, label in (("same", "same-state observe"), ("idle", "check(), nothing due")):
            arms = {"this": arm(sg, keys, op), "previous": arm(prev, keys, op)}
            for order in ("this first", "previous first"):
                names = list(arms) if order == "this first" else list(reversed(arms))
                samples: dict[str, list[float]] = {name: [] for name in names}
                gc.disable()
                try:
                    for r in range(args.rounds):
                        start = (r * BATCH) % n
                        chunk = keys[start : start + BATCH]
                        for name in names:
                            t0 = tt()
                            arms[name](chunk)
                            samples[name].append((tt() - t0) / len(chunk))
                finally:
                    gc.enable()
                m = {name: statistics.median(xs) for name, xs in samples.items()}
                print(
                    f"| {label} | {n:,} | {order} | {m['this']:.0f} ns | "
                    f"{m['previous']:.0f} ns | {m['this'] / m['previous']:.3f} | "
                    f"{os.getloadavg()[0]:.1f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
