"""The code's shape, measured with radon (tools/shape.py; issue 23's targets): no block of
the watchdog's modules or the adapters graded worse than C, the Watchdog class at most
600 lines, each area's average complexity at most its ceiling, and the figures the tool
prints are the ones radon and the source give."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from _tools import load_tool

pytest.importorskip("radon")

ROOT = Path(__file__).resolve().parents[1]


shape = load_tool("shape")


def test_no_block_of_the_hot_path_or_the_adapters_is_worse_than_c():
    f = shape.figures()
    assert f["over_ceiling"] == [], shape.report(f)
    assert shape.main(["--check"]) == 0


def test_the_watchdog_length_is_the_classes_in_the_source():
    """The public class, and the core: its class and its module functions (its methods
    until the compiled core made them functions)."""
    tree = ast.parse((ROOT / "stallguard" / "_watchdog.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Watchdog"]
    core = ast.parse((ROOT / "stallguard" / "_core.py").read_text())
    defs = [n for n in core.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))]
    assert "WatchdogCore" in [n.name for n in defs]
    core_lines = sum(n.end_lineno - n.lineno + 1 for n in defs)  # type: ignore[operator]
    parts = {"public": cls.end_lineno - cls.lineno + 1, "core": core_lines}  # type: ignore[operator]
    assert shape.watchdog_parts() == parts
    assert shape.watchdog_lines() == max(parts.values())


def test_the_averages_are_radons():
    """`radon cc -a` over the same files prints the same averages."""
    radon = Path(sys.executable).with_name("radon")
    if not radon.exists():
        pytest.skip("no radon script beside this interpreter")
    f = shape.figures()
    for name, root in shape.AREAS.items():
        out = subprocess.run(
            [str(radon), "cc", "-a", str(root)], capture_output=True, text=True, check=True
        ).stdout
        said = float(out.rsplit("(", 1)[1].rstrip(")\n"))
        assert f["averages"][name] == pytest.approx(said), name


def test_a_block_over_the_ceiling_fails_the_check(monkeypatch):
    """The check can fail: a stand-in hot-path block of complexity 21 (grade D)."""
    real = shape.blocks

    def with_a_d(path):
        found = real(path)
        if path.name == "_guard.py" and path.parent.name == "stallguard":
            found.append(shape.Block("stallguard/_guard.py", "tangled", 21))
        return found

    monkeypatch.setattr(shape, "blocks", with_a_d)
    f = shape.figures()
    assert [b.name for b in f["over_ceiling"]] == ["tangled"]
    assert shape.main(["--check"]) == 1


def test_the_watchdog_is_at_most_600_lines_and_a_longer_one_fails_the_check(monkeypatch):
    f = shape.figures()
    assert f["watchdog_lines"] <= shape.WATCHDOG_LINES_TARGET, shape.report(f)
    monkeypatch.setattr(shape, "watchdog_lines", lambda: shape.WATCHDOG_LINES_TARGET + 1)
    assert shape.main(["--check"]) == 1


def test_each_average_is_within_its_ceiling_and_a_higher_one_fails_the_check(monkeypatch):
    """The averages reached stay reached: a ceiling per area (a little above the figure
    of 2026-12-04); an area above its ceiling (here: a ceiling lowered below today's
    figure) fails the check, named in the report."""
    f = shape.figures()
    assert shape.above_average_ceiling(f) == [], shape.report(f)
    assert set(shape.AVERAGE_CEILINGS) == set(shape.AREAS)
    lowered = {**shape.AVERAGE_CEILINGS, "stallguard-vllm": f["averages"]["stallguard-vllm"] - 0.01}
    monkeypatch.setattr(shape, "AVERAGE_CEILINGS", lowered)
    assert shape.above_average_ceiling(f) == ["stallguard-vllm"]
    assert "above in stallguard-vllm" in shape.report(f)[-1]
    assert shape.main(["--check"]) == 1
