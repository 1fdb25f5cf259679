"""benchmarks/bench_sglang_queue.py still runs (--quick: a smoke test, not a measurement)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sglang_support as sgs

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]

BENCH = ROOT / "benchmarks" / "bench_sglang_queue.py"
SKIP = sgs.skip_reason("0.5.23") or (
    None if BENCH.is_file() else f"{BENCH} is absent (not run from a repository checkout)"
)
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.skipif(SKIP is not None, reason=SKIP or ""),
]


@pytest.mark.parametrize("extra", [[], ["--watch-all"]], ids=["default", "watch-all"])
def test_bench_sglang_queue_quick(extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("STALLGUARD_SGLANG")}
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 50 |")]
    assert len(rows) == 1, proc.stdout
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[1] == "2"  # churn
    assert all(" us (" in c for c in cells[2:5])  # disabled, enabled, naive medians
    # the script itself checks that the enabled arm guards every request, in its
    # watchdog or held young by its lane; it reports how many
    assert "guards at the end of each row" in proc.stdout and "50 of 50 (" in proc.stdout
