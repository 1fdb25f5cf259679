"""benchmarks/bench_core.py runs and prints its tables (a smoke test: speed is not
asserted here; docs/performance.md holds the measured numbers)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

OPERATIONS = (
    "state change",
    "same-state observe",
    "check(), nothing due",
    "expiry, 100 per check",
    "expiry, one per check",
    "expiry, lifetime+stall",
    "expiry, all N at once",
    "guarded poll, added",
    "memory per request",
    "memory, lifetime+stall",
    "threads per request",
    "timers per request",
)


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def test_bench_core_quick_prints_its_tables():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_core.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    header = "| operation | N | stallguard | asyncio call_at | naive scan | transitions Timeout |"
    assert header in lines, out.stdout
    rows = {(cells[0], cells[1]): cells[2:] for cells in map(_cells, lines) if len(cells) == 6}
    for op in OPERATIONS:
        for n in ("100", "1,000"):
            assert (op, n) in rows, f"no row for {op} at N={n}:\n{out.stdout}"
    # Every timed stallguard cell holds a measurement, not a placeholder.
    for op in OPERATIONS[:8]:
        assert re.fullmatch(r"[\d.]+ (ns|µs|ms) \(p90 [\d.]+ (ns|µs|ms)\)", rows[op, "100"][0])
    # Counted, not timed: stallguard starts no thread and no timer per request, while
    # transitions' Timeout starts one thread per request (its arm runs at N=100 only).
    assert rows["threads per request", "1,000"][0] == "0.00"
    assert rows["timers per request", "1,000"][0] == "0.00"
    assert rows["threads per request", "100"][3] == "1.00"
    assert rows["state change", "1,000"][3] == "not run (N > 100)"

    targets = lines[lines.index("| target | measured | result |") + 2 :]
    targets = [line for line in targets if line.startswith("|")]
    assert len(targets) == 11, out.stdout
    assert all(_cells(line)[-1] in ("PASS", "MISS") for line in targets)


def test_bench_engine_quick_compares_with_the_previous_engine():
    """bench_engine.py extracts the previous engine from git history and prints one row
    per operation with both engines measured (a smoke test: no figure is judged)."""
    if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", "0b9bc74"]).returncode:
        pytest.skip("a shallow clone without the previous engine's commit")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "--quick", "--sizes", "100"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    rows = {cells[0]: cells for cells in map(_cells, out.stdout.splitlines()) if len(cells) == 11}
    for op in ("state change", "same-state observe", "check(), nothing due"):
        assert re.fullmatch(r"[\d,]+ ns", rows[op][2]), out.stdout  # this checkout
        assert re.fullmatch(r"[\d,]+ ns", rows[op][3]), out.stdout  # the previous engine
    assert re.fullmatch(r"[\d,]+ ns", rows["state change"][5]), out.stdout  # a bare dict store


def _quick(script: str) -> subprocess.CompletedProcess[str]:
    """benchmarks/*script* --quick, run to success."""
    command = [sys.executable, str(ROOT / "benchmarks" / script), "--quick"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out


def test_bench_scale_quick_prints_every_arm_size_and_churn():
    """bench_scale.py (issue 25's cost that grows with the work) prints a timing row for
    every size, churn rate and arm, and a memory row for every size and arm; the
    transitions arm says where it is capped (a smoke test: no figure is judged)."""
    out = _quick("bench_scale.py")
    timing, memory = out.stdout.split("## memory", 1)
    arms = ("stallguard", "naive dict", "asyncio call_at", "transitions Timeout")
    number = r"[\d,.]+ (ns|µs|ms)"
    rows = {tuple(c[:3]): c[3:] for c in map(_cells, timing.splitlines()) if len(c) == 12}
    for n in ("100", "200"):
        for churn in ("0 %", "1 %", "10 %", "100 %"):
            for arm in arms:
                cells = rows.get((n, churn, arm))
                assert cells, f"no row for {arm} at N={n}, churn {churn}:\n{out.stdout}"
                if arm == "transitions Timeout" and n == "200":
                    assert cells[0] == "not run (N > 100)", cells
                    continue
                assert re.fullmatch(number, cells[0]), cells  # state change
                assert re.fullmatch(number, cells[4]), cells  # iteration, mean
                assert re.fullmatch(number, cells[5]), cells  # iteration, median batch
                if churn != "0 %":  # admissions and departures happen
                    assert re.fullmatch(number, cells[1]) and re.fullmatch(number, cells[2])
                if arm != "transitions Timeout":  # it has no check: its timers fire alone
                    assert re.fullmatch(number, cells[3]), cells
    mem = {tuple(c[:2]): c[2:] for c in map(_cells, memory.splitlines()) if len(c) == 11}
    for n in ("100", "200"):
        for arm in arms:
            cells = mem.get((n, arm))
            assert cells, f"no memory row for {arm} at N={n}:\n{out.stdout}"
            if arm == "transitions Timeout" and n == "200":
                assert cells[0] == "not run (N > 100)", cells
            else:
                assert all(re.fullmatch(r"-?[\d,]+ B", c) for c in cells), cells
