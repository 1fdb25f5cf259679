#!/usr/bin/env python3
"""What stallguard-sglang's ``.pth`` file costs every interpreter start of the environment.

Runs ``python -c pass`` with this interpreter (whose site-packages holds
``stallguard_sglang_activate.pth``) many times, the arms alternating run by run (the
order reversed every other round):

* ``disabled``: neither ``STALLGUARD_SGLANG_CONFIG`` nor ``STALLGUARD_SGLANG`` set, what
  every interpreter of an environment with the adapter installed pays;
* ``enabled, auto``: ``STALLGUARD_SGLANG=1``; the installed SGLang has its plugin
  framework, so the ``.pth`` path imports its module, finds ``sglang/srt/plugins/`` on
  disk and stands aside (the plugin entry point does the work inside SGLang);
* ``enabled, pth``: also ``STALLGUARD_SGLANG_ACTIVATION=pth``: the import hook is armed,
  as on SGLang builds without the plugin framework.

Byte-code caching is on for the children (``PYTHONDONTWRITEBYTECODE`` removed), as in a
deployed environment; one warm-up run per arm writes the caches. Prints the median
wall-clock time of each arm and the differences to ``disabled``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200, help="runs per arm")
    parser.add_argument("--importtime", type=int, default=31, help="-X importtime runs per arm")
    args = parser.parse_args(argv)
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("STALLGUARD_SGLANG") and k != "PYTHONDONTWRITEBYTECODE"
    }
    arms = {
        "disabled": base,
        "enabled, auto": {**base, "STALLGUARD_SGLANG": "1"},
        "enabled, pth": {**base, "STALLGUARD_SGLANG": "1", "STALLGUARD_SGLANG_ACTIVATION": "pth"},
    }
    cmd = [sys.executable, "-c", "pass"]
    for env in arms.values():  # warm-up: byte-code caches, page cache
        subprocess.run(cmd, env=env, check=True)
    samples: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    load0 = os.getloadavg()[0]
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            subprocess.run(cmd, env=arms[name], check=True)
            samples[name].append(time.perf_counter() - t0)
    load1 = os.getloadavg()[0]
    medians = {name: statistics.median(v) * 1000 for name, v in samples.items()}
    print("## Interpreter start-up with stallguard_sglang_activate.pth\n")
    print(
        f"Python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {load0:.2f} -> {load1:.2f}; `python -c pass`, {args.rounds} runs per "
        "arm, alternating.\n"
    )
    print("| arm | median | minus disabled | its imports (-X importtime) |")
    print("|---|---:|---:|---:|")
    for name, ms in medians.items():
        imports = statistics.median(import_times(arms[name]) for _ in range(args.importtime))
        print(
            f"| {name} | {ms:.1f} ms | {ms - medians['disabled']:+.1f} ms | "
            f"{imports / 1000:.2f} ms |"
        )
    print(
        "\nThe last column is the cumulative import time of the adapter's modules the .pth "
        "line imports (stallguard_sglang._activate and what it imports), from "
        "`python -X importtime -c pass`, median of runs: the adapter's own share, without "
        "the noise of process start-up."
    )
    return 0


def import_times(env: dict[str, str]) -> float:
    """Microseconds the interpreter spent importing the adapter's modules at start-up."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "pass"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    total = 0.0
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = line[len("import time:") :].split("|")
        # top-level imports made by a .pth line are indented by two spaces (under site)
        if len(name) - len(name.lstrip()) != 3 or not name.strip().startswith("stallguard_sglang"):
            continue
        total += float(cumulative)
    return total


if __name__ == "__main__":
    sys.exit(main())
