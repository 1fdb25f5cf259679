"""The process helpers of sglang_support (adapters/sglang/tests) fail fast instead of hanging.

`run_ranks(..., setup=False)` and `run_in_python` do not import sglang, so these only
need torch (they run wherever the .venv from `python3 tools/dev.py env` exists).
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

try:
    import sglang_support as sgs
except ImportError:  # not run from the venv that tools/dev.py built: find it anyway
    sys.path.append(str(Path(__file__).resolve().parents[2] / "adapters" / "sglang" / "tests"))
    import sglang_support as sgs

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="torch is not installed here; build .venv with `python3 tools/dev.py env`",
)


def _all_reduce_rank(info):
    import torch
    import torch.distributed as dist

    t = torch.tensor([info.rank + 1])
    dist.all_reduce(t, group=info.group)
    return int(t.item())


def _rank1_raises(info):
    import torch.distributed as dist

    if info.rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier(group=info.group)  # would wait forever for rank 1
    return "unreachable"


def _sleep(info, seconds):
    time.sleep(seconds)
    return "slept"


def test_run_ranks_returns_each_ranks_result():
    assert sgs.run_ranks(_all_reduce_rank, world=2, setup=False, timeout=60) == [3, 3]


def test_run_ranks_reports_a_failing_rank_and_does_not_wait_for_the_others():
    t0 = time.monotonic()
    with pytest.raises(sgs.RankError) as exc:
        sgs.run_ranks(_rank1_raises, world=2, setup=False, timeout=60, collective_timeout=60)
    text = str(exc.value)
    assert "rank 1 raised" in text and "ValueError: boom on rank 1" in text
    # rank 0 either sees the peer vanish inside the barrier or is killed after the grace
    assert ("--- rank 0 raised" in text) or ("rank 0: killed after another rank failed" in text)
    assert time.monotonic() - t0 < 40


def test_run_ranks_times_out():
    with pytest.raises(sgs.RankError, match=r"no result within 3\.0s"):
        sgs.run_ranks(_sleep, world=2, args=(60,), setup=False, timeout=3.0)


def test_run_in_python_returns_and_times_out():
    py = sys.executable
    assert sgs.run_in_python(py, "time:sleep", args=(0,)) is None
    with pytest.raises(sgs.SubprocessError, match="did not finish within 2"):
        sgs.run_in_python(py, "time:sleep", args=(30,), timeout=2)
    with pytest.raises(sgs.SubprocessError, match="ZeroDivisionError"):
        sgs.run_in_python(py, "operator:truediv", args=(1, 0))
