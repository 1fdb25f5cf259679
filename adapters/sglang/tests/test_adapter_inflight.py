"""stallguard-sglang against the REAL SGLang 0.5.23 prefill queue, in this process.

Real: `SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue` and its
failure paths, `NixlKVSender` / `MooncakeKVSender` / `FakeKVSender`, the managers'
`update_status` / `conclude_failure` plumbing, the poll all-reduce over a gloo group of
one. Faked (sglang_support, next to this file; each fake says why): the managers' transfer engines
(built with `object.__new__`), the scheduler's KV pools and output streamer.

The adapter is installed with `stallguard_sglang.testing.installed` (which wraps the same
targets as the plugin, directly, and removes them afterwards) so that every test can have
its own configuration in one process; the plugin path through SGLang's `load_plugins()`
is tested in test_adapter_plugin.py. Time is a FakeClock: nothing sleeps.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import sglang_support as sgs
from stallguard_sglang.testing import installed

from stallguard.testing import FakeClock, record_expiries

SKIP = sgs.skip_reason("0.5.23")
pytestmark = [pytest.mark.sglang, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]

WFI, TRANSFERRING, SUCCESS = 2, 3, 4
DEADLINES = {"Bootstrapping": 30, "WaitingForInput": 10, "Transferring": 20}
CONFIG = {"prefill": {"deadlines": DEADLINES}}
T0 = 1000.0


@pytest.fixture(scope="module", autouse=True)
def _context():
    sgs.setup_context(0, 1)
    yield
    sgs.teardown_context()


@contextlib.contextmanager
def guarded(config=CONFIG):
    """The adapter installed with *config* and a FakeClock; yields (clock, expiries)."""
    clock = FakeClock(T0)
    with installed(config, clock=clock), record_expiries() as expiries:
        yield clock, expiries


def request(sched, backend, rid, state, *, pending=False, mgr=None):
    """A real sender moved to *state* (an int KVPoll value) before it enters the queue."""
    mgr = mgr or sgs.make_manager(backend)
    sender = sgs.make_sender(mgr, sgs.next_room())
    for status in (WFI, TRANSFERRING, SUCCESS):
        if status <= state:
            sgs.set_status(sender, status)
    return sgs.make_request(rid, sender, pending_bootstrap=pending, prefilled=False)


def forced_count(backend, state, queue="inflight"):
    """The forced-failures counter's sample for these labels and tp_rank 0, whatever
    else SGLang's scheduler labels hold (model_name, engine_type, ...)."""
    from prometheus_client import REGISTRY

    total = 0.0
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            labels = sample.labels
            if (
                sample.name == "sglang:stallguard_forced_failures_total"
                and (labels["queue"], labels["backend"], labels["state"]) == (queue, backend, state)
                and labels["tp_rank"] == "0"
            ):
                total += sample.value
    return total


def guard_of(sched):
    return sched._stallguard_inflight_guard


def step_each_second_until(sched, clock, until, rid):
    """Run an iteration every second up to just before *until*; *rid* stays queued."""
    while clock() + 1 < until:
        clock.advance(1)
        sched.step()
        assert rid in sched.inflight_rids(), f"failed early, at {clock() - T0}"


# --------------------------------------------------------------------------- deadlines

CASES = [
    ("nixl", "Bootstrapping"),
    ("nixl", "WaitingForInput"),
    ("nixl", "Transferring"),
    ("mooncake", "Bootstrapping"),
    ("mooncake", "WaitingForInput"),  # mooncake never reports Transferring
]


@pytest.mark.parametrize(("backend", "state"), CASES)
def test_stuck_sender_failed_at_first_iteration_past_its_deadline(backend, state):
    kvpoll = {"Bootstrapping": 1, "WaitingForInput": WFI, "Transferring": TRANSFERRING}[state]
    deadline = DEADLINES[state]
    if backend == "mooncake" and state == "WaitingForInput":
        deadline = DEADLINES["WaitingForInput"] + DEADLINES["Transferring"]  # transfer pending
    before = forced_count(backend, state)
    with guarded() as (clock, expiries):
        sched = sgs.FakeScheduler()
        stuck = request(sched, backend, "stuck", kvpoll, pending=state == "Bootstrapping")
        # the state was entered long before the request reached the inflight queue (it
        # waited for its prefill forward): that must not eat into the inflight deadline
        clock.advance(5 * deadline)
        sched.prefill(stuck)
        sched.step()  # enrolled now: the deadline counts from here
        step_each_second_until(sched, clock, T0 + 5 * deadline + deadline, "stuck")
        clock.set(T0 + 5 * deadline + deadline + 0.001)
        sched.step()
        failed_in = sched.iteration
        assert "stuck" not in sched.inflight_rids()
    conclusion = sched.conclusions["stuck"]
    assert conclusion.iteration == failed_in
    expected = "bootstrap_failed" if state == "Bootstrapping" else "transfer_failed"
    assert conclusion.outcome == expected
    assert f"spent {deadline:.1f}s in KVPoll.{state}" in conclusion.message
    assert f"past its {deadline:g}s deadline" in conclusion.message
    assert [(str(e.key), e.state_label, e.deadline) for e in expiries] == [
        ("stuck", state, deadline)
    ]
    assert expiries[0].attributes == {
        "gen_ai.request.id": "stuck",  # the name SGLang's and vLLM's own spans use
        "stallguard.sglang.rid": "stuck",
        "stallguard.sglang.bootstrap_room": stuck.bootstrap_room,
        "stallguard.sglang.backend": backend,
        "stallguard.sglang.tp_rank": 0,
        "stallguard.sglang.queue": "inflight",
    }
    assert forced_count(backend, state) == before + 1
    # SGLang's own failure path ran: KV released, abort streamed, watchdog empty
    assert "stuck" in sched.released
    assert all(len(wd) == 0 for wd in guard_of(sched).watchdogs.values())


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_healthy_and_completing_senders_are_never_failed(backend):
    with guarded() as (clock, expiries):
        sched = sgs.FakeScheduler()
        mgr = sgs.make_manager(backend)
        a = request(sched, backend, "progressing", WFI, mgr=mgr)
        b = request(sched, backend, "done-at-once", SUCCESS, mgr=mgr)
        c = request(sched, backend, "quick", TRANSFERRING, mgr=mgr)
        sched.prefill(a, b, c)
        sched.step()
        assert sched.conclusions["done-at-once"].outcome == "success"
        # "progressing": 9 s waiting, then 19 s transferring (deadlines 10 / 20): 28 s in
        # all, longer than either deadline, but within each state's
        for second in range(1, 29):
            clock.advance(1)
            if second == 9:
                sgs.set_status(a.disagg_kv_sender, TRANSFERRING)
            if second == 3:
                sgs.set_status(c.disagg_kv_sender, SUCCESS)
            sched.step()
        assert sched.conclusions["quick"].outcome == "success"
        sgs.set_status(a.disagg_kv_sender, SUCCESS)
        sched.step()
        assert sched.conclusions["progressing"].outcome == "success"
    assert expiries == []
    assert sched.inflight_rids() == []


def test_a_sender_that_completes_as_its_deadline_passes_is_not_failed():
    with guarded() as (clock, expiries):
        sched = sgs.FakeScheduler()
        req = request(sched, "nixl", "late-success", TRANSFERRING)
        sched.prefill(req)
        sched.step()
        clock.advance(DEADLINES["Transferring"] - 0.5)
        sched.step()
        sgs.set_status(req.disagg_kv_sender, SUCCESS)  # a transfer thread, between iterations
        clock.advance(1)  # now past the deadline
        sched.step()
    assert sched.conclusions["late-success"].outcome == "success"
    assert expiries == []


class RacingClock(FakeClock):
    """A FakeClock that, once armed, runs *race* at the next reading: a transfer thread
    whose update lands between the guard's applying the captured changes and its check."""

    race = None

    def __call__(self) -> float:
        race, self.race = self.race, None
        if race is not None:
            race()
        return super().__call__()


def test_a_success_racing_the_check_is_withdrawn_not_reported():
    """The Success lands after the guard applied what the hooks captured and before its
    check(): the check finds the request overdue in Transferring, the enforcement finds
    it concluded and withdraws the expiry: no span, log or metric says it was failed."""
    clock = RacingClock(T0)
    with installed(CONFIG, clock=clock), record_expiries() as expiries:
        sched = sgs.FakeScheduler()
        req = request(sched, "nixl", "racing", TRANSFERRING)
        sched.prefill(req)
        sched.step()
        before = forced_count("nixl", "Transferring")
        clock.advance(DEADLINES["Transferring"] + 1)
        clock.race = lambda: sgs.set_status(req.disagg_kv_sender, SUCCESS)
        sched.step()
        assert clock.race is None  # it ran, inside that step
        wd = guard_of(sched).lanes["nixl"].wd
        assert wd.snapshot().expired == 0 and len(wd) == 0
    assert sched.conclusions["racing"].outcome == "success"
    assert expiries == []
    assert forced_count("nixl", "Transferring") == before


def test_a_phase_change_racing_the_check_is_withdrawn_and_the_new_phase_guarded():
    """The sender moves from WaitingForInput to Transferring after the guard applied what
    the hooks captured and before its check(): the check finds it overdue in
    WaitingForInput, the enforcement finds that phase over and withdraws the expiry (the
    request is not failed, nothing is reported). Its new phase is guarded from that
    iteration: failed once Transferring overstays, and not before."""
    clock = RacingClock(T0)
    with installed(CONFIG, clock=clock), record_expiries() as expiries:
        sched = sgs.FakeScheduler()
        req = request(sched, "nixl", "moving", WFI)
        sched.prefill(req)
        sched.step()
        before = forced_count("nixl", "WaitingForInput")
        clock.advance(DEADLINES["WaitingForInput"] + 1)
        clock.race = lambda: sgs.set_status(req.disagg_kv_sender, TRANSFERRING)
        sched.step()
        assert clock.race is None  # it ran, inside that step
        moved_at = clock()
        assert "moving" in sched.inflight_rids()
        assert expiries == []
        assert forced_count("nixl", "WaitingForInput") == before
        assert [state for _, state, _ in guard_of(sched).requests()] == ["Transferring"]
        step_each_second_until(sched, clock, moved_at + DEADLINES["Transferring"], "moving")
        clock.advance(moved_at + DEADLINES["Transferring"] - clock())
        sched.step()
    assert sched.conclusions["moving"].outcome == "transfer_failed"
    assert [(e.state, e.elapsed) for e in expiries] == [("Transferring", DEADLINES["Transferring"])]


def test_request_aborted_while_inflight_is_concluded_once():
    with guarded() as (clock, expiries):
        sched = sgs.FakeScheduler()
        req = request(sched, "nixl", "aborted", TRANSFERRING)
        sched.prefill(req)
        sched.step()
        clock.advance(DEADLINES["Transferring"] - 1)
        sched.step()
        req.disagg_kv_sender.abort()  # what Scheduler.abort_request does for inflight requests
        clock.advance(5)  # the deadline passes before the next iteration
        sched.step()
        for _ in range(3):
            clock.advance(DEADLINES["Transferring"])
            sched.step()  # FakeScheduler raises if a request is concluded twice
    conclusion = sched.conclusions["aborted"]
    assert conclusion.outcome == "transfer_failed"
    assert "Aborted by AbortReq." in conclusion.message and "stallguard" not in conclusion.message
    assert expiries == []  # stallguard saw the abort (update_status) and never fired
    assert sched.events_for("aborted", "stream") and len(sched.events_for("aborted", "stream")) == 1


def test_fake_sender_of_a_warmup_request():
    from sglang.srt.disaggregation.fake.conn import FakeKVSender

    with guarded() as (clock, expiries):
        sched = sgs.FakeScheduler()
        mgr = sgs.make_manager("nixl")  # warmup requests pair FakeKVSender with the real manager
        senders = {rid: FakeKVSender(mgr, "2.2.2.2:8998", sgs.next_room()) for rid in "ab"}
        for sender in senders.values():
            sender.init(1, 0)
        reqs = [sgs.make_request(rid, s, bootstrap_host="2.2.2.2") for rid, s in senders.items()]
        sched.prefill(*reqs)
        sched.step()
        clock.advance(5)
        sched.step()
        senders["b"].send([0])  # "b" gets its chunk; "a" never does
        clock.advance(6)  # past the 10 s WaitingForInput deadline for both
        sched.step()
    assert sched.conclusions["b"].outcome == "success"
    assert sched.conclusions["a"].outcome == "transfer_failed"  # via its conclude_state
    assert [(str(e.key), e.state_label) for e in expiries] == [("a", "WaitingForInput")]
    assert expiries[0].attributes["stallguard.sglang.backend"] == "fake"


def test_report_mode_fails_nothing():
    config = {"prefill": {"mode": "report", "deadlines": DEADLINES}}
    with guarded(config) as (clock, expiries):
        sched = sgs.FakeScheduler()
        sched.prefill(request(sched, "nixl", "stuck", TRANSFERRING))
        sched.step()
        for _ in range(5):
            clock.advance(DEADLINES["Transferring"])
            sched.step()
    assert sched.inflight_rids() == ["stuck"]
    assert sched.conclusions == {}
    assert [(str(e.key), e.mode) for e in expiries] == [("stuck", "report")]


def test_progress_window_renewed_by_each_chunk():
    config = {"prefill": {"deadlines": {"Transferring": {"seconds": 100, "stall": 5}}}}
    with guarded(config) as (clock, expiries):
        sched = sgs.FakeScheduler()
        req = request(sched, "nixl", "chunked", TRANSFERRING)
        sched.prefill(req)
        sched.step()
        for _ in range(10):  # a chunk every 4 s: 40 s, never 5 s without progress
            clock.advance(4)
            sgs.set_status(req.disagg_kv_sender, TRANSFERRING)  # a NIXL worker's next chunk
            sched.step()
        assert sched.inflight_rids() == ["chunked"]
        clock.advance(5.5)  # the last chunk hangs
        sched.step()
    assert sched.conclusions["chunked"].outcome == "transfer_failed"
    assert "without progress in KVPoll.Transferring" in sched.conclusions["chunked"].message
    assert [e.reason for e in expiries] == ["stall"]


def test_explicitly_unbounded_state_is_never_failed():
    config = {"prefill": {"deadlines": {"Transferring": "none"}}}
    with guarded(config) as (clock, expiries):
        sched = sgs.FakeScheduler()
        sched.prefill(request(sched, "nixl", "slow", TRANSFERRING))
        for _ in range(5):
            clock.advance(10_000)
            sched.step()
    assert sched.inflight_rids() == ["slow"] and expiries == []


# --------------------------------------------------------------------------- membership


def tracked(sched):
    """The requests the guard holds."""
    return {str(entry) for entry in guard_of(sched).entries.values()}


def watched(sched):
    """The requests the watchdogs track, with their state and its start."""
    return {(str(key), state, start) for key, state, start in guard_of(sched).requests()}


def test_steady_state_enrolls_the_tail_without_rescanning():
    with guarded() as (_clock, expiries):
        sched = sgs.FakeScheduler()
        mgr = sgs.make_manager("nixl")
        sched.prefill(request(sched, "nixl", "r0", WFI, mgr=mgr))
        sched.step()
        guard = guard_of(sched)
        rescans = guard.rescans
        for i in range(1, 30):
            sched.prefill(request(sched, "nixl", f"r{i}", WFI, mgr=mgr))  # appended between
            if i % 3 == 0:
                sgs.set_status(sched.disagg_prefill_inflight_queue[0].disagg_kv_sender, SUCCESS)
            sched.step()
            assert tracked(sched) == set(sched.inflight_rids())
        assert guard.rescans == rescans  # appends and returned (done) requests: no rescan
    assert expiries == []


def test_every_request_in_the_queue_is_guarded_however_it_got_there():
    with guarded() as (clock, expiries):
        sched = sgs.FakeScheduler()
        mgr = sgs.make_manager("nixl")
        sched.prefill(*(request(sched, "nixl", f"r{i}", WFI, mgr=mgr) for i in range(3)))
        sched.step()
        # another code path inserts at the front (not an append)
        sched.disagg_prefill_inflight_queue.insert(0, request(sched, "nixl", "front", WFI, mgr=mgr))
        # another replaces the list object
        sched.disagg_prefill_inflight_queue = [
            *sched.disagg_prefill_inflight_queue,
            request(sched, "nixl", "new-list", WFI, mgr=mgr),
        ]
        sched.step()
        assert tracked(sched) == {"r0", "r1", "r2", "front", "new-list"}
        # and one removes a request without concluding it: it is forgotten
        queue = sched.disagg_prefill_inflight_queue
        queue.remove(next(r for r in queue if r.rid == "r1"))
        sched.step()
        assert tracked(sched) == {"r0", "r2", "front", "new-list"}
        clock.advance(DEADLINES["WaitingForInput"])
        sched.step()
    assert sorted(sched.conclusions) == ["front", "new-list", "r0", "r2"]
    assert all(c.outcome == "transfer_failed" for c in sched.conclusions.values())
    assert sorted(str(e.key) for e in expiries) == ["front", "new-list", "r0", "r2"]


def test_a_state_change_restarts_the_clock_at_the_change_and_never_fails_early():
    # (replaces a test of the old adapter's internal handover schedule: what users see is
    # that every queued request is watched in its current state from its real start, a
    # new state's deadline counts from the update_status that entered it, and a request
    # that completes first is never failed)
    with guarded() as (clock, expiries):
        sched = sgs.FakeScheduler()
        mgr = sgs.make_manager("nixl")
        req = request(sched, "nixl", "r", WFI, mgr=mgr)
        quick = request(sched, "nixl", "quick", WFI, mgr=mgr)
        sched.prefill(req, quick)
        sched.step()
        assert watched(sched) == {("r", "WaitingForInput", T0), ("quick", "WaitingForInput", T0)}
        clock.set(T0 + 4.999)
        sgs.set_status(quick.disagg_kv_sender, SUCCESS)
        sched.step()
        assert sched.inflight_rids() == ["r"]
        assert watched(sched) == {("r", "WaitingForInput", T0)}
        clock.set(T0 + 6)
        sgs.set_status(req.disagg_kv_sender, TRANSFERRING)  # WaitingForInput ends 4 s early
        clock.set(T0 + 7)
        sched.step()
        assert watched(sched) == {("r", "Transferring", T0 + 6)}
        step_each_second_until(sched, clock, T0 + 6 + DEADLINES["Transferring"], "r")
        clock.set(T0 + 6 + DEADLINES["Transferring"] - 0.001)
        sched.step()
        assert sched.inflight_rids() == ["r"]
        clock.set(T0 + 6 + DEADLINES["Transferring"])
        sched.step()
        assert sched.inflight_rids() == []
    assert [(str(e.key), e.state_label, e.entered_at) for e in expiries] == [
        ("r", "Transferring", T0 + 6)
    ]
    assert expiries[0].attributes["stallguard.sglang.rid"] == "r"
    assert sched.conclusions["quick"].outcome == "success"


def test_a_state_clock_starts_when_update_status_ran_not_at_the_next_iteration():
    with guarded() as (clock, expiries):
        sched = sgs.FakeScheduler()
        req = request(sched, "nixl", "r", WFI)
        sched.prefill(req)
        sched.step()
        clock.advance(1)
        sgs.set_status(req.disagg_kv_sender, TRANSFERRING)  # T0 + 1, on a transfer thread
        clock.advance(2)  # the next queue call, T0 + 3, applies it
        sched.step()
        step_each_second_until(sched, clock, T0 + 1 + DEADLINES["Transferring"], "r")
        clock.set(T0 + 1 + DEADLINES["Transferring"])  # not T0 + 3 + 20
        sched.step()
        assert sched.inflight_rids() == []
    assert [(e.state_label, e.entered_at) for e in expiries] == [("Transferring", T0 + 1)]


def test_short_lived_requests_leave_nothing_behind():
    # (replaces a bound on the old adapter's internal handover FIFO: what users see is
    # that many requests passing through leave no state in the adapter or its watchdog)
    with guarded() as (_clock, expiries):
        sched = sgs.FakeScheduler()
        mgr = sgs.make_manager("nixl")
        for i in range(300):
            req = request(sched, "nixl", f"r{i}", WFI, mgr=mgr)
            sched.prefill(req)
            sched.step()
            if i % 3:
                sgs.set_status(req.disagg_kv_sender, TRANSFERRING)
            sgs.set_status(req.disagg_kv_sender, SUCCESS)
            sched.step()
        guard = guard_of(sched)
        [wd] = guard.watchdogs.values()
        assert sched.inflight_rids() == [] and guard.entries == {}
        assert len(wd) == 0 and watched(sched) == set()
        assert mgr._stallguard_rooms == {}
        assert all(not lane.events for lane in guard.checks)
    assert expiries == []
    assert len(sched.conclusions) == 300


def test_requests_that_left_are_forgotten_everywhere():
    with guarded() as (_clock, expiries):
        sched = sgs.FakeScheduler()
        mgr = sgs.make_manager("nixl")
        reqs = [request(sched, "nixl", f"r{i}", TRANSFERRING, mgr=mgr) for i in range(4)]
        boot = request(sched, "nixl", "boot", 1, pending=True, mgr=mgr)
        sched.prefill(*reqs, boot)
        sched.step()
        sgs.set_status(reqs[0].disagg_kv_sender, SUCCESS)
        sgs.fail_sender(reqs[1].disagg_kv_sender, "transport error")
        sgs.fail_sender(boot.disagg_kv_sender, "bootstrap refused")  # leaves silently
        sched.step()
        assert sched.inflight_rids() == ["r2", "r3"]
        assert tracked(sched) == {"r2", "r3"}
        assert set(guard_of(sched).entries) == {id(reqs[2]), id(reqs[3])}
        assert set(mgr._stallguard_rooms) == {reqs[2].bootstrap_room, reqs[3].bootstrap_room}
    assert expiries == []


def test_concurrent_updates_from_transfer_threads_lose_nothing():
    with guarded() as (clock, expiries):
        sched = sgs.FakeScheduler()
        mgr = sgs.make_manager("nixl")
        reqs = [request(sched, "nixl", f"r{i}", WFI, mgr=mgr) for i in range(400)]
        sched.prefill(*reqs)
        sched.step()
        start = threading.Barrier(9)

        def worker(offset):
            start.wait()
            for req in reqs[offset::4]:
                # two threads race on each room, one moving it to Transferring and one
                # repeating WaitingForInput: update_status keeps the max
                sgs.set_status(req.disagg_kv_sender, WFI)
                sgs.set_status(req.disagg_kv_sender, TRANSFERRING)
                sgs.set_status(req.disagg_kv_sender, WFI)

        threads = [threading.Thread(target=worker, args=(i % 4,)) for i in range(8)]
        for t in threads:
            t.start()
        start.wait()
        while any(t.is_alive() for t in threads):
            sched.step()  # the scheduler keeps iterating meanwhile
        for t in threads:
            t.join()
        sched.step()
        guard = guard_of(sched)
        entries = [guard.entries[id(r)] for r in reqs]
        assert {e.state for e in entries} == {TRANSFERRING}
        # Transferring entered at T0 (the FakeClock never moved), and no state went back
        assert {row[1:] for row in watched(sched)} == {("Transferring", T0)}
        assert len(watched(sched)) == 400
        clock.advance(DEADLINES["Transferring"] - 0.5)
        sched.step()
        assert len(sched.inflight_rids()) == 400
        clock.advance(1)
        sched.step()
    assert len(expiries) == 400 and {e.state_label for e in expiries} == {"Transferring"}
    assert sched.inflight_rids() == []
