"""Shadow -> advise -> enforce with stallguard-sglang, on the REAL SGLang inflight queue.

A fresh process (prometheus_client's multiprocess mode, as in a scheduler) runs seeded
traffic in report mode, reads the exported time-in-state histogram back through
prometheus_client's MultiProcessCollector, prints the advice with
``python -m stallguard_sglang advise --multiproc-dir``, loads its TOML block with the
adapter's own config parser, and runs the same traffic again in enforce mode under the
advised deadlines. The scenario is in sglang_advice_scenarios.py.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import tomllib

from stallguard._advice import round_up
from stallguard._stats import sample_quantile

HERE = Path(__file__).resolve().parent
try:
    import sglang_support as sgs
except ImportError:  # not run from the venv tools/dev.py built
    sys.path.append(str(HERE.parents[2] / "tests"))
    import sglang_support as sgs

SKIP = sgs.skip_reason("0.5.23")
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.skipif(SKIP is not None, reason=SKIP or ""),
]
N = 400


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    metrics_dir = tmp_path_factory.mktemp("prometheus")
    env = {k: v for k, v in os.environ.items() if not k.startswith("STALLGUARD_SGLANG")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    return sgs.run_in_python(
        sys.executable,
        "sglang_advice_scenarios:shadow_advise_enforce",
        args=(str(metrics_dir), N),
        timeout=240,
        env=env,
    )


def test_shadow_run_records_every_stay_and_the_would_be_false_positive(run):
    # report mode: nothing failed; the stuck request is still queued
    assert all(outcome == "success" for rid, outcome in run["shadow"].items() if rid[0] == "r")
    assert run["shadow"]["slow"] == "success"
    assert run["shadow"]["__inflight__"] == ["stuck"]
    # every request left WaitingForInput; all but "stuck" left Transferring
    assert run["counts"]["WaitingForInput"] == N + 2
    assert run["counts"]["Transferring"] == N + 1
    # the 20 s Transferring deadline fired on "slow" (which then succeeded) and "stuck"
    assert run["fired"]["Transferring"] == 2
    assert run["fired_completed"]["Transferring"] == 1
    assert 'sglang:stallguard_state_seconds_bucket{backend="nixl"' in run["metrics"]


def test_advice_follows_the_rule_on_the_real_stays(run):
    plan = run["plan"]
    transfers = [x for _, _, x in plan if x != math.inf]
    # the scrape's buckets are the ladder: the suggestion is never below the rule applied
    # to the exact stays (times in the scenario are multiples of its 0.1 s step, so the
    # recorded stays are the planned ones rounded up to the next iteration: at most 0.1 s)
    exact = round_up(max(sample_quantile(transfers, 0.999) * 2, 10))
    assert exact <= run["suggested"]["Transferring"] <= round_up((25 + 0.1) * 2 * 2.5)
    assert run["suggested"]["WaitingForInput"] == 10  # 0.3 s x 2 < the 10 s floor
    assert run["status"] == 0
    assert "== inflight queue, nixl" in run["printed"]


def test_toml_block_round_trips_through_the_config_loader(run):
    """The printed block is valid TOML that the adapter's own parser accepts, with the
    suggested deadlines and nothing else (Bootstrapping had no data: left out)."""
    data = tomllib.loads(run["toml"])
    assert {s: float(v) for s, v in data["prefill"]["deadlines"].items()} == run["suggested"]
    assert run["advised"] == run["suggested"]
    assert "Bootstrapping" not in run["suggested"]
    assert "# Bootstrapping: no suggestion (not enough data" in run["toml"]


def test_enforcing_the_advice_fails_the_stuck_request_and_no_healthy_one(run):
    enforce = run["enforce"]
    assert enforce["stuck"] == "transfer_failed"
    healthy = {rid: o for rid, o in enforce.items() if rid[0] == "r" or rid == "slow"}
    assert healthy and all(o == "success" for o in healthy.values())
    assert enforce["__inflight__"] == []
