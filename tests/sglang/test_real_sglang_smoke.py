"""Smoke tests of sglang_support (adapters/sglang/tests): they drive the REAL SGLang
prefill queues (no stallguard involved), so later adapter tests can trust the fixtures.

* in-process, sglang 0.5.23 (.venv): the inflight queue concludes Success / failed
  (`kv_mgr.conclude_failure` -> `handle_inflight_transfer_failure`) / aborted rooms and
  keeps Transferring ones, for NIXL and Mooncake; the bootstrap deadline releases
  optimistic (`pending_bootstrap`) requests of both backends;
* gloo world size 2 (spawned ranks): a room failed on rank 0 only concludes on both ranks
  in the same iteration;
* sglang 0.5.17 (.venv-sglang0517, in a subprocess): a NIXL request in Bootstrapping stays
  pinned in the inflight queue, while a Mooncake one is released by its bootstrap deadline.

Skipped, with the reason, only when the environment built by `python3 tools/dev.py env`
is absent.

NB: tests/sglang/ must never get an __init__.py: with tests/ on sys.path (pytest puts it
there for tests/*.py) it would become a regular package named `sglang` and shadow the
real one.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

try:
    import sglang_support as sgs
except ImportError:  # not run from the venv that tools/dev.py built: find it anyway
    sys.path.append(str(Path(__file__).resolve().parents[2] / "adapters" / "sglang" / "tests"))
    import sglang_support as sgs

SKIP_0523 = sgs.skip_reason("0.5.23")
SKIP_0517 = sgs.sglang0517_skip_reason()
needs_0523 = pytest.mark.skipif(SKIP_0523 is not None, reason=SKIP_0523 or "")
needs_0517 = pytest.mark.skipif(SKIP_0517 is not None, reason=SKIP_0517 or "")

pytestmark = [pytest.mark.sglang]

BACKENDS = ["nixl", "mooncake"]
KV_FAILED, KV_BOOTSTRAPPING, KV_TRANSFERRING = 0, 1, 3


# --------------------------------------------------------------------- in-process, 0.5.23


@needs_0523
def test_fixtures_are_the_real_sglang_classes():
    import sglang.srt.disaggregation.prefill as prefill

    mgr = sgs.make_manager("nixl")
    sgs.setup_context(0, 1)
    sender = sgs.make_sender(mgr, sgs.next_room())
    assert type(sender).__module__ == "sglang.srt.disaggregation.nixl.conn"
    assert type(mgr).__module__ == "sglang.srt.disaggregation.nixl.conn"
    assert issubclass(sgs.FakeScheduler, prefill.SchedulerDisaggregationPrefillMixin)
    assert "process_disagg_prefill_inflight_queue" not in vars(sgs.FakeScheduler)
    assert sender.poll() == KV_BOOTSTRAPPING and sender.init_time is not None


@needs_0523
@pytest.mark.parametrize("backend", BACKENDS)
def test_inflight_queue_concludes_each_state(backend):
    from sglang_support.scenarios import inflight_states

    r = inflight_states(backend, reason="stalled in Transferring")
    assert r["version"] == "0.5.23"
    assert r["sender_class"] == {"nixl": "NixlKVSender", "mooncake": "MooncakeKVSender"}[backend]
    assert r["fail_primitive"] == "conclude_failure"
    assert set(r["initial_polls"].values()) == {KV_BOOTSTRAPPING}

    it1 = r["after_iteration_1"]
    assert it1["inflight"] == ["transferring", "waiting"]
    c = it1["conclusions"]
    assert c["success"] == (1, "success", None)
    it, outcome, msg = c["failed"]
    assert (it, outcome) == (1, "transfer_failed")
    assert msg.startswith("Prefill transfer failed for request rank=0 req.rid='failed'")
    assert msg.endswith("KVTransferError(bootstrap_room=34): stalled in Transferring")
    it, outcome, msg = c["aborted"]
    assert (it, outcome) == (1, "transfer_failed") and msg.endswith("Aborted by AbortReq.")
    events = set(it1["events"])
    for rid in ("failed", "aborted"):  # the stock failure path did the cleanup
        assert (1, "handle_inflight_transfer_failure", rid) in events
        assert (1, "release_kv", rid) in events and (1, "release_aborted", rid) in events
    assert (1, "tree_finish", "success") in events and (1, "release_kv", "success") in events

    it2 = r["after_iteration_2"]
    assert it2["conclusions"]["transferring"] == (2, "success", None)
    assert it2["inflight"] == ["waiting"]
    assert len(it2["conclusions"]) == 4  # each concluded exactly once (FakeScheduler asserts it)
    assert r["rooms_left"] == [33]  # concluded rooms were cleared from the manager


@needs_0523
def test_bootstrap_deadline_releases_optimistic_requests_on_0523():
    from sglang_support.scenarios import bootstrap_wedge

    r = bootstrap_wedge(bootstrap_timeout=0.3, observe=0.9)
    assert r["popped"] == ["nixl", "mooncake"]
    assert all(v["pending_bootstrap"] for v in r["after_pop"].values())
    assert r["inflight_at_end"] == []
    for rid in ("nixl", "mooncake"):
        it, outcome, msg = r["conclusions"][rid]
        assert it >= 2  # iteration 1 was pop_bootstrapped
        assert outcome == "bootstrap_failed"
        assert "timed out after 0.3s in KVPoll.Bootstrapping" in msg
        assert 0.3 <= r["released_at"][rid] < 0.8
    assert r["free_metadata_buffers"] == r["metadata_buffers"]


# --------------------------------------------------------------------- gloo, world size 2


@needs_0523
def test_failure_on_rank0_concludes_on_both_ranks_in_same_iteration():
    from sglang_support.scenarios import fail_on_rank0_only

    ranks = sgs.run_ranks(
        fail_on_rank0_only, world=2, kwargs={"reason": "stuck on rank 0"}, timeout=150
    )
    assert [r["rank"] for r in ranks] == [0, 1]
    for backend in BACKENDS:
        r0, r1 = ranks[0][backend], ranks[1][backend]
        assert r0["local_polls_before"]["fail"] == KV_FAILED
        assert r1["local_polls_before"]["fail"] == KV_TRANSFERRING
        for r in (r0, r1):
            assert r["conclusions"]["fail"][:2] == (1, "transfer_failed")
            assert r["conclusions"]["ok"] == (1, "success", None)
            # Success on rank 0 only: the MIN-reduce keeps it on every rank
            assert r["inflight"] == ["skew"]
            assert r["released_kv"] == ["fail", "ok"]
        assert r0["conclusions"]["fail"][2].endswith("stuck on rank 0")
        assert r1["conclusions"]["fail"][2].endswith(
            "Failed due to an unknown reason from another rank"
        )
        assert "rank=1 req.rid='fail'" in r1["conclusions"]["fail"][2]


# --------------------------------------------------------------------- 0.5.17, subprocess


@pytest.fixture(scope="module")
def legacy_results():
    """One subprocess under .venv-sglang0517 (one sglang import) for all 0.5.17 checks."""
    return sgs.run_in_python(
        sgs.VENV_SGLANG0517_PYTHON,
        "sglang_support.scenarios:call_many",
        args=(
            {
                "wedge": ("bootstrap_wedge", {"bootstrap_timeout": 0.3, "observe": 1.5}),
                "nixl": ("inflight_states", {"backend": "nixl"}),
                "mooncake": ("inflight_states", {"backend": "mooncake"}),
            },
        ),
        timeout=180,
    )


@needs_0517
def test_0517_nixl_bootstrapping_stays_pinned_in_inflight_queue(legacy_results):
    r = legacy_results["wedge"]
    assert r["version"] == "0.5.17" and r["legacy"] is True
    # optimistic prefill: the real pop_bootstrapped let both Bootstrapping requests through
    assert r["popped"] == ["nixl", "mooncake"]
    assert all(
        v["pending_bootstrap"] and v["prefill_attempt_count"] == 1 for v in r["after_pop"].values()
    )
    # Mooncake: released by its bootstrap deadline through handle_bootstrap_failure
    it, outcome, msg = r["conclusions"]["mooncake"]
    assert it >= 2  # iteration 1 was pop_bootstrapped
    assert outcome == "bootstrap_failed"
    assert "Request 22 timed out after 0.3s in KVPoll.Bootstrapping" in msg
    assert 0.3 <= r["released_at"]["mooncake"] < 1.0
    # NIXL: no deadline on 0.5.17 -- pinned for every one of the iterations, 5x the timeout
    assert "nixl" not in r["conclusions"] and "nixl" not in r["released_at"]
    assert r["iterations"] >= 10
    assert all("nixl" in inflight for _, _, inflight in r["trace"])
    assert r["inflight_at_end"] == ["nixl"]
    assert r["nixl_pending_bootstrap"] is True
    assert r["nixl_local_poll"] == KV_BOOTSTRAPPING
    assert r["nixl_init_time"] is None
    assert r["free_metadata_buffers"] == r["metadata_buffers"] - 1  # still held by NIXL's


@needs_0517
@pytest.mark.parametrize("backend", BACKENDS)
def test_0517_inflight_queue_concludes_each_state(legacy_results, backend):
    r = legacy_results[backend]
    assert r["version"] == "0.5.17"
    assert r["fail_primitive"] == "record_failure+update_status"
    c = r["after_iteration_1"]["conclusions"]
    assert r["after_iteration_1"]["inflight"] == ["transferring", "waiting"]
    assert c["success"] == (1, "success", None)
    assert c["failed"][:2] == (1, "transfer_failed") and c["failed"][2].endswith(
        "stalled in Transferring"
    )
    assert c["aborted"][:2] == (1, "transfer_failed") and c["aborted"][2].endswith(
        "Aborted by AbortReq."
    )
    assert r["after_iteration_2"]["conclusions"]["transferring"] == (2, "success", None)
    assert r["after_iteration_2"]["inflight"] == ["waiting"]


# --------------------------------------------------------------------- transfer engines


@pytest.mark.engines
@pytest.mark.skipif(
    importlib.util.find_spec("nixl") is None or importlib.util.find_spec("mooncake") is None,
    reason="nixl / mooncake-transfer-engine are not installed here; "
    "build .venv with `python3 tools/dev.py env`",
)
def test_real_transfer_engines_import():
    """The engines `tools/dev.py env` installs load on this CPU-only machine (mooncake
    needs the system library libibverbs1)."""
    from mooncake.engine import TransferEngine
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("stallguard-smoke", nixl_agent_config(backends=[]))
    assert "UCX" in agent.get_plugin_list()
    assert callable(TransferEngine)
