"""The seeds' incident on *real* SGLang servers (examples/real_servers; docs/demo.md).

One run of the rig, shared by the module: per arm, ``python -m sglang.launch_server``
prefill + decode (NIXL over UCX/TCP on loopback) and the real Rust ``sglang-router``
0.3.2 in PD mode, a client talking to the router; the "with" arm's servers get
``STALLGUARD_SGLANG_CONFIG`` and load stallguard-sglang through SGLang's plugin entry
point, as users enable it. The decode's process group is SIGSTOPped while the prefill
sends it the KV of a 2048-token prompt (64 MB).

* without stallguard, the prefill's ``sglang:num_prefill_inflight_queue_reqs`` stays at 1
  well past the deadline, nothing is failed, the client hangs;
* with it, the prefill fails the request at its deadline (the named state, once, on
  SGLang's failure path: ``sglang:stallguard_forced_failures_total`` and
  ``sglang:num_transfer_failed_reqs_total`` on the prefill's own ``/metrics``), the
  inflight queue is back to 0, the client gets an error through the router with
  stallguard's reason; healthy requests before and after the fault are answered.

And a bad configuration refuses to start: the server never reports healthy and its log
names the error, whether the launcher or (the file broken after the launcher read it)
the scheduler process meets it.

Needs .venv-realsrv (``python3 tools/dev.py env``); skipped, saying so, without it.
About 6 minutes on 2 quiet cores, 10 under load (each server takes ~90-180 s to start):
more than the whole suite's budget allows, so it is **opt-in**; the default suite runs
the same incident on one launch with a shared decode (tests/test_real_servers_shared.py):
``STALLGUARD_REAL_SERVERS=1 python3 tools/dev.py test tests/test_real_servers.py``
(docs/testing.md). Skipped, saying so, otherwise.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from examples.real_servers import _main as rig
from examples.real_servers import _servers as srv

ROOT = Path(__file__).resolve().parents[1]
Results = dict[str, Any]


def _environment_problem() -> str | None:
    if not srv.PYTHON.exists():
        return f"{srv.PYTHON} is missing: `python3 tools/dev.py env` builds .venv-realsrv"
    check = subprocess.run(
        [str(srv.PYTHON), "-c", "import sglang.launch_server, sglang_router.launch_router"],
        capture_output=True,
        text=True,
        env=srv.server_env(None),
        timeout=300,
    )
    if check.returncode != 0:
        return f".venv-realsrv cannot import SGLang's server or the router: {check.stderr[-800:]}"
    return None


OPT_IN = "STALLGUARD_REAL_SERVERS"
if os.environ.get(OPT_IN) != "1":
    PROBLEM: str | None = (
        f"opt-in: set {OPT_IN}=1 (two real server sets take 6-10 minutes, over the "
        "suite's budget; docs/testing.md)"
    )
elif not srv.PYTHON.exists():
    PROBLEM = f"{srv.PYTHON} is missing"
else:
    PROBLEM = _environment_problem()

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.engines,
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(PROBLEM is not None, reason=f"real servers: {PROBLEM}"),
]

DEADLINE = 20.0
OBSERVE = 50.0


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Results:
    out = tmp_path_factory.mktemp("real_servers")
    results = rig.run(out, deadline=DEADLINE, observe=OBSERVE, log=lambda m: print(m))
    print(rig.table(results))
    results["out"] = out
    return results


def _arm(run: Results, name: str) -> Results:
    arm: Results = run["arms"][name]
    assert not arm["errors"], arm["errors"]
    return arm


def test_both_arms_started_and_served_healthy_requests(run: Results) -> None:
    for name in ("without", "with"):
        arm = _arm(run, name)
        assert set(arm["healthy_after"]) == {"prefill", "decode"}
        reqs = arm["requests"]
        for kind in ("warmup", "healthy_before", "healthy_after"):
            assert reqs[kind], (name, kind)
            assert all(r["status"] == 200 for r in reqs[kind]), (name, kind, reqs[kind])


def test_stallguard_was_loaded_through_the_entry_point_only_in_the_with_arm(run: Results) -> None:
    logs = run["out"] / "logs"
    for mode in ("prefill", "decode"):
        with_log = (logs / f"with-{mode}.log").read_text(errors="replace")
        without_log = (logs / f"without-{mode}.log").read_text(errors="replace")
        assert "stallguard-sglang:" in with_log and "deadlines" in with_log, mode
        assert "stallguard" not in without_log.replace("stallguard-sglang.toml", ""), mode


def test_without_stallguard_the_request_stays_pinned_past_the_deadline(run: Results) -> None:
    arm = _arm(run, "without")
    obs = arm["fault"]["observation"]
    assert obs["inflight"] >= 1, obs
    assert obs["client_waiting"] == 1.0
    entered = arm["events"]["inflight_from_s"]
    thaw = arm["events"]["thaw_s"]
    assert thaw - entered >= DEADLINE + 10  # pinned well past the deadline
    # every sample from its entry to the thaw: still there, nothing failed it
    pinned = [r for r in arm["samples"] if entered <= r["t"] < thaw]
    assert pinned and all(r["inflight"] >= 1 for r in pinned), pinned
    assert all(r["transfer_failed"] == 0 and r["forced"] == 0 for r in pinned), pinned
    assert not arm["fault"]["stallguard_log"]


def test_with_stallguard_the_prefill_fails_it_at_its_deadline(run: Results) -> None:
    arm = _arm(run, "with")
    ev, fault = arm["events"], arm["fault"]
    # released on the prefill's /metrics (1 s scrapes, a gauge SGLang refreshes when it
    # logs: a few seconds of slack) around inflight entry + the deadline
    assert (
        ev["inflight_from_s"] + DEADLINE - 3
        <= ev["forced_s"]
        <= ev["inflight_from_s"] + DEADLINE + 5
    )
    obs = fault["observation"]
    assert obs["inflight"] == 0 and obs["forced"] == 1 and obs["transfer_failed"] == 1, obs
    # exactly once, in a state the frozen transfer is in, after exactly its deadline
    (line,) = fault["stallguard_log"]
    assert "spec=sglang.inflight.nixl" in line
    assert "state=Transferring" in line or "state=WaitingForInput" in line
    assert f"deadline_s={DEADLINE:g}" in line
    # the gauge stays down after the thaw; the counter did not move again
    assert fault["final"]["inflight"] == 0 and fault["final"]["forced"] == 1


def test_with_stallguard_the_client_gets_an_error_through_the_router(run: Results) -> None:
    client = _arm(run, "with")["fault"]["client"]
    assert client["status"] == 500, client
    assert "stallguard" in client["body"], client


def test_without_stallguard_the_client_waited_for_the_whole_freeze(run: Results) -> None:
    arm = _arm(run, "without")
    client = arm["fault"]["client"]
    # it hung for the whole window: an answer, if any, came only after the thaw
    assert client.get("t_end_s") is None or client["t_end_s"] >= arm["events"]["thaw_s"]


# --------------------------------------------------------------------------- bad config

BAD = "[prefill.deadlines]\nTransferring = -5\n"
NAMED = "stallguard-sglang: invalid configuration, refusing to start"


def _launch(tmp_path: Path, config: Path) -> tuple[srv.Proc, srv.ServerSet]:
    s = srv.ServerSet("bad", tmp_path / "logs", config)
    argv = s.server_argv("prefill")
    return srv.spawn("bad-prefill", argv, srv.server_env(config), tmp_path / "bad.log"), s


def _never_healthy(proc: srv.Proc, s: srv.ServerSet, timeout: float) -> float:
    """Polls /health until the server exits; returns when it did. Fails if it ever
    answers 200, or is still running after *timeout*."""
    t0 = time.monotonic()
    try:
        while proc.alive():
            status, _ = srv.http("GET", s.url("prefill") + "/health", timeout=2)
            assert status != 200, "a server with a bad stallguard config reported healthy"
            assert time.monotonic() - t0 < timeout, f"still running after {timeout} s"
            time.sleep(1)
        return time.monotonic() - t0
    finally:
        proc.stop()


def test_a_bad_config_stops_the_launcher(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(BAD)
    proc, s = _launch(tmp_path, config)
    _never_healthy(proc, s, timeout=240)
    assert proc.popen.returncode != 0
    log = proc.log_text()
    assert NAMED in log, log[-3000:]
    assert f"{config}: [prefill.deadlines] Transferring = -5: must be a positive" in log
    assert "Scheduler" not in log  # it stopped before starting any scheduler process


def test_a_config_broken_after_the_launcher_read_it_stops_the_scheduler(tmp_path: Path) -> None:
    """The scheduler process loads the plugins (and the file) again: a file that went bad
    in between stops it, and with it the server, which never reports healthy."""
    config = tmp_path / "sg.toml"
    config.write_text("[prefill.deadlines]\nTransferring = 20\n")
    proc, s = _launch(tmp_path, config)
    t0 = time.monotonic()
    try:
        # the launcher prints server_args after its own load_plugins(), long (the
        # scheduler's imports, ~40 s here) before a scheduler process loads them
        while "server_args=" not in proc.log_text():
            assert proc.alive(), proc.log_text()[-3000:]
            assert time.monotonic() - t0 < 240, "the launcher never got past its plugins"
            time.sleep(0.2)
        config.write_text(BAD)
    except BaseException:
        proc.stop()
        raise
    _never_healthy(proc, s, timeout=300)
    log = proc.log_text()
    assert NAMED in log, log[-3000:]
    assert f"{config}: [prefill.deadlines] Transferring = -5: must be a positive" in log
    # the launcher had passed its own load_plugins(): the refusal came from the
    # scheduler process, whose death the launcher reports before it exits
    assert "Rank 0 scheduler died during initialization (exit code: 1)" in log, log[-3000:]
    assert proc.popen.returncode != 0
