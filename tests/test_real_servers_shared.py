"""The seeds' incident on *real* SGLang servers, in the default suite (docs/demo.md,
"Real servers"; examples/real_servers).

One launch, shared by the module: two prefills and one decode started with
``python -m sglang.launch_server`` (NIXL over UCX/TCP on loopback), and two real Rust
``sglang-router`` 0.3.2 in PD mode, each pairing one prefill with the shared decode. The
arms differ in one thing: the "with" prefill's environment has ``STALLGUARD_SGLANG_CONFIG``
(stallguard-sglang loaded through SGLang's plugin entry point, as users enable it); the
"without" prefill and the decode have none. Both arms' clients send a 2048-token prompt
(64 MB of KV, prefilled in 4 chunks of 512) at once, and the decode's process group is
SIGSTOPped once, for both arms, at a placement checked to be certain: every arm's
prefill has logged its first chunk (the request is bootstrapped with the decode) and
none has logged its last (its last chunk's KV is sent after the freeze). So each arm's
request enters its prefill's inflight queue with KV to send to a frozen decode
(examples/real_servers/_main.py, ``Sync``: the arm whose prefill logs its first chunk
first is held, its prefill SIGSTOPped, until the other one has too, and resumed right
after the decode's freeze; an attempt whose placement failed anyway is not frozen and is
retried, the faster arm's send delayed by its lead).

* control: without stallguard, the prefill's own ``sglang:num_prefill_inflight_queue_reqs``
  (which SGLang sets right after the request joins the queue and republishes only when
  the scheduler is fully idle, which it is not while the request is there) holds it
  from its entry to the thaw, 2 x the deadline and more, nothing counts a failure, and
  the client hangs until the decode resumes;
* with it, stallguard-sglang's own series show the request in the inflight queue
  (``sglang:stallguard_oldest_age_seconds``), its forced failure is counted on the
  prefill's ``/metrics`` one deadline after it entered (within the scrapes' resolution
  and a slack of half the deadline), its log line says it spent the deadline in the
  state, SGLang counts the transfer failed, and the client gets an error naming
  stallguard (through the router, which relays it once the decode resumes: docs/demo.md);
* healthy requests before the fault are answered, nothing else is failed, and both arms
  serve new requests (a fresh prompt too) after it.

Skipped, saying so, only when .venv-realsrv is missing or lacks SGLang, the router or
the CPU stand-ins (``python3 tools/dev.py env`` builds it). The rest of the real-server
matrix (a decode per arm, bad configurations at start-up, the other faults) is opt-in:
tests/test_real_servers.py.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path
from typing import Any

import pytest

from examples.real_servers import _main as rig
from examples.real_servers import _servers as srv

Results = dict[str, Any]


#: what the servers need from .venv-realsrv: SGLang, the router, the CPU stand-ins
NEEDED = ("sglang", "sglang_router", "_stallguard_realsrv")


def _environment_problem() -> str | None:
    """Why the real servers cannot run here (None: they can). Only looks the packages
    up (a fraction of a second; importing SGLang takes 10-60 s): a venv that has them
    but is broken fails the test instead, as it should."""
    if not srv.PYTHON.exists():
        return f"{srv.PYTHON} is missing: `python3 tools/dev.py env` builds .venv-realsrv"
    find = (
        "import importlib.util as u, sys; print(*[m for m in sys.argv[1:] if not u.find_spec(m)])"
    )
    check = subprocess.run(
        [str(srv.PYTHON), "-c", find, *NEEDED],
        capture_output=True,
        text=True,
        env=srv.server_env(None),
        timeout=120,
    )
    missing = check.stdout.split()
    if check.returncode != 0 or missing:
        return f".venv-realsrv lacks {missing or NEEDED} ({check.stderr[-400:]})"
    return None


PROBLEM = _environment_problem()

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.engines,
    pytest.mark.slow,
    # eight server processes and timing from their own metrics: by itself (tools/dev.py)
    pytest.mark.alone,
    # generous: the launch alone took up to 4 minutes at load 15-35
    pytest.mark.timeout(1500),
    pytest.mark.skipif(PROBLEM is not None, reason=f"real servers: {PROBLEM}"),
]

#: the "with" prefill's WaitingForInput and Transferring deadlines
DEADLINE = 10.0
#: slack on the failure's time: the watchdog's tick in a busy scheduler loop
SLACK = max(5.0, DEADLINE / 2)
PROMPT = 2048
CHUNKS = math.ceil(PROMPT / rig.CHUNK)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Results:
    out = tmp_path_factory.mktemp("real_servers_shared")
    results = rig.run(
        out,
        deadline=DEADLINE,
        observe=0.0,  # the window is event-driven (entry + 2 x the deadline, the failure)
        thaw_wait=180.0,
        shared_decode=True,
        prompt_tokens=PROMPT,
        freeze_at_chunk=1,
        log=lambda m: print(m),
    )
    print(rig.table(results))
    print("phases (s since start):", results["phases_s"], "attempts:", _attempts(results))
    results["out"] = out
    return results


def _attempts(run: Results) -> list[Any]:
    return [a["events"].get("attempts") for a in run["arms"].values()]


def _arm(run: Results, name: str) -> Results:
    arm: Results = run["arms"][name]
    assert not arm["errors"], arm["errors"]
    return arm


def _pinned_window(arm: Results) -> list[dict[str, float]]:
    """The scrapes from the request's first sighting to the thaw that read a page (a
    failed scrape, the server busy, reads NaN: it shows nothing either way)."""
    ev = arm["events"]
    rows = [r for r in arm["samples"] if ev["entry_s"] <= r["t"] < ev["thaw_s"]]
    return [r for r in rows if not math.isnan(r["inflight"])]


def test_the_fault_was_placed_mid_transfer_for_both_arms(run: Results) -> None:
    """The decode was frozen once, for both arms, after each prefill logged its first
    chunk and before either logged its last (checked right before and right after the
    SIGSTOP): each request still had its last chunk's KV to send."""
    placements = []
    for name in ("without", "with"):
        attempts = _arm(run, name)["events"]["attempts"]
        assert attempts and attempts[-1]["placed"], attempts
        placements.append({k: v for k, v in attempts[-1].items() if k != "attempt"})
    assert placements[0] == placements[1]  # one decision, for both arms
    last = placements[0]
    assert all(1 <= c < CHUNKS for c in last["chunks"].values()), last
    assert all(1 <= c < CHUNKS for c in last["chunks_after_freeze"].values()), last


def test_one_decode_served_both_arms_and_only_the_with_prefill_loaded_stallguard(
    run: Results,
) -> None:
    logs: Path = run["out"] / "logs"
    with_log = (logs / "with-prefill.log").read_text(errors="replace")
    # the lazily logged "active" line (load_plugins() runs before SGLang's logging is
    # set up) and the support table, both from the scheduler process
    assert "stallguard-sglang active on SGLang 0.5.23" in with_log, with_log[-3000:]
    assert "stallguard-sglang: deadlines (config" in with_log
    assert "stallguard" not in (logs / "without-prefill.log").read_text(errors="replace")
    # the decode may name stallguard only in the prefill's failure reason it relays
    assert "stallguard-sglang" not in (logs / "decode.log").read_text(errors="replace")
    assert not (logs / "with-decode.log").exists()
    assert run["arms"]["with"]["ports"]["decode"] == run["arms"]["without"]["ports"]["decode"]


def test_healthy_requests_before_and_new_requests_after_are_served(run: Results) -> None:
    for name in ("without", "with"):
        arm = _arm(run, name)
        reqs = arm["requests"]
        for kind in ("warmup", "healthy_before", "healthy_after"):
            assert reqs[kind], (name, kind)
            assert all(r["status"] == 200 for r in reqs[kind]), (name, kind, reqs[kind])
        # an attempt not frozen (placement retried) completed normally too
        assert all(r.get("status") == 200 for r in reqs.get("unplaced", [])), reqs
        # the servers answer a fresh 256-token prompt after the fault, not only cached ones
        assert [r["tokens"] for r in reqs["healthy_after"]] == [16, 256]
    # nothing but the frozen request was failed by stallguard, before or after
    final = _arm(run, "with")["fault"]["final"]
    assert final["forced"] == 1 and final["transfer_failed"] == 1, final
    assert final["inflight"] == 0 and final["sg_oldest"] == 0, final
    control = _arm(run, "without")["fault"]["final"]
    assert control["forced"] == 0 and control["transfer_failed"] == 0, control


def test_without_stallguard_the_request_stays_pinned_and_the_client_hangs(run: Results) -> None:
    """The control: the request held in the inflight queue from its entry to the thaw,
    2 x the deadline and more, nothing failing it, the client waiting; answered only
    after the decode resumed."""
    arm = _arm(run, "without")
    ev = arm["events"]
    assert "inflight_from_s" in ev and ev["entry_s"] == ev["inflight_from_s"], ev
    assert ev["thaw_s"] - ev["entry_s"] >= 2 * DEADLINE, ev
    pinned = _pinned_window(arm)
    assert len(pinned) >= 5, arm["samples"]  # ~1 scrape a second, fewer when busy
    assert all(r["inflight"] >= 1 for r in pinned), pinned
    assert all(r["transfer_failed"] == 0 and r["forced"] == 0 for r in pinned), pinned
    assert all(r["client_waiting"] == 1.0 for r in pinned), pinned
    assert arm["fault"]["observation"]["client_waiting"] == 1.0
    assert not arm["fault"]["stallguard_log"]
    client = arm["fault"]["client"]
    # the request was not lost, only held: answered once the decode resumed
    assert client["status"] == 200 and client["t_end_s"] >= ev["thaw_s"], client


def test_with_stallguard_the_prefill_fails_it_at_its_deadline(run: Results) -> None:
    arm = _arm(run, "with")
    ev, fault = arm["events"], arm["fault"]
    # stallguard's own gauge showed it in the inflight queue before it failed it
    assert "sg_from_s" in ev and ev["sg_from_s"] < ev["forced_s"], ev
    # the failure counted on /metrics one deadline after the entry: each event is known
    # to within the scrape before it ("..._after_s") and the scrape that showed it
    earliest = ev["forced_after_s"] - ev["entry_s"]
    latest = ev["forced_s"] - ev["entry_after_s"]
    assert earliest <= DEADLINE + SLACK and latest >= DEADLINE, ev
    # stallguard's own account: exactly once, in a state of the frozen transfer, having
    # spent its deadline there (and not much more)
    (line,) = fault["stallguard_log"]
    assert "spec=sglang.inflight.nixl" in line
    assert "state=Transferring" in line or "state=WaitingForInput" in line
    assert f"deadline_s={DEADLINE:g}" in line
    elapsed = float(line.split("elapsed_s=")[1].split()[0])
    assert DEADLINE <= elapsed <= DEADLINE + SLACK, line
    # released: the inflight queue and stallguard's oldest age back to 0, the counters 1
    obs = fault["observation"]
    assert obs["inflight"] == 0 and obs["sg_oldest"] == 0, obs
    assert obs["forced"] == 1 and obs["transfer_failed"] == 1, obs
    after_failure = [
        r for r in arm["samples"] if r["t"] >= ev["forced_s"] and r["t"] < ev["thaw_s"]
    ]
    assert after_failure and all(
        r["inflight"] == 0 for r in after_failure if r["inflight"] == r["inflight"]
    )


def test_with_stallguard_the_client_gets_an_error_naming_it(run: Results) -> None:
    arm = _arm(run, "with")
    ev, client = arm["events"], arm["fault"]["client"]
    assert client["status"] == 500 and "stallguard" in client["body"], client
    # not before the failure; relayed by the router once the decode resumed (it waits
    # for the decode's half of the request), within the bounded wait after the thaw
    assert ev["forced_s"] <= client["t_end_s"], (client, ev)
    assert client["t_end_s"] <= ev["thaw_s"] + 180, (client, ev)
    # the control's client, same fault, same decode, was still waiting at that point
    control = _arm(run, "without")["fault"]["client"]
    assert control["t_end_s"] >= ev["thaw_s"]
