"""The pd_wedge demo's thaw verdict (examples/pd_wedge/_thaw.py), without SGLang: what
makes the demo exit 1 (any byte of the new owner changed with stallguard, pages not freed
after the thaw, a leak; a control that shows no corruption), the SGLang waiting timeout
it derives, and the report. The thaw itself runs in tests/test_pd_wedge.py."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from examples.pd_wedge import _report
from examples.pd_wedge._config import QUICK
from examples.pd_wedge._faults import ready_to_freeze
from examples.pd_wedge._thaw import PAGES, WRITE_BYTES, ThawResult, waiting_timeout

GOOD_WITH = ThawResult(
    "nixl",
    "with",
    attempts=1,
    warm_verified=WRITE_BYTES,
    landed_before_freeze=6_000_000,
    failed_after_s=1.2,
    reason="stallguard: ...",
    quarantined_pages=PAGES,
    late_in_quarantine=WRITE_BYTES,
    held_ms=1800.0,
    freed_after_thaw_ms=250.0,
    released={"transfer_done": 1},
)
GOOD_WITHOUT = ThawResult(
    "nixl",
    "without",
    attempts=1,
    warm_verified=WRITE_BYTES,
    landed_before_freeze=6_000_000,
    failed_after_s=2.0,
    reason="Request 1 timed out after 2.0s in KVPoll.WaitingForInput",
    freed_before_thaw=True,
    freed_after_failure_s=1.02,
    owner_same_pages=True,
    overwritten=WRITE_BYTES - 6_000_000,
    late_in_owner=WRITE_BYTES - 6_000_000,
)


def test_a_clean_round_passes():
    assert GOOD_WITH.ok() and GOOD_WITHOUT.ok()


@given(
    overwritten=st.integers(0, WRITE_BYTES),
    changed_before=st.integers(0, WRITE_BYTES),
    leaked=st.integers(0, 16),
    freed=st.one_of(st.none(), st.floats(0, 1e5)),
    released=st.dictionaries(st.sampled_from(["transfer_done", "other"]), st.integers(0, 3)),
    problems=st.lists(st.text(max_size=5), max_size=2),
)
def test_with_stallguard_any_damage_or_hold_left_fails_the_demo(
    overwritten, changed_before, leaked, freed, released, problems
):
    r = replace(
        GOOD_WITH,
        overwritten=overwritten,
        changed_before_thaw=changed_before,
        leaked_pages=leaked,
        freed_after_thaw_ms=freed,
        released=released,
        problems=problems,
    )
    clean = (
        overwritten == 0
        and changed_before == 0
        and leaked == 0
        and freed is not None
        and released.get("transfer_done", 0) == 1
        and not problems
    )
    assert r.ok() == clean


@given(overwritten=st.integers(0, WRITE_BYTES), problems=st.lists(st.text(max_size=5), max_size=2))
def test_the_control_must_show_the_corruption(overwritten, problems):
    r = replace(GOOD_WITHOUT, overwritten=overwritten, problems=problems)
    assert r.ok() == (overwritten > 0 and not problems)


@given(st.floats(0.01, 600))
def test_sglangs_waiting_timeout_comes_after_stallguards_deadline(deadline):
    w = waiting_timeout(deadline)
    assert isinstance(w, int) and w >= 2 and w >= 2 * deadline


def test_the_report_names_the_figures_and_the_json_the_verdict(tmp_path):
    bad = replace(GOOD_WITH, engine="mooncake", overwritten=123)
    text = _report.thaw_section([GOOD_WITHOUT, GOOD_WITH, bad])
    assert f"**{GOOD_WITHOUT.overwritten:,}** of {WRITE_BYTES:,}" in text
    assert "**0** of" in text and "held 1800 ms, freed 250 ms after SIGCONT" in text
    assert "**123** of" in text
    _report.save_json([], QUICK, tmp_path / "r.json", thaw=[GOOD_WITH, bad])
    rounds = json.loads((tmp_path / "r.json").read_text())["thaw"]
    assert [t["ok"] for t in rounds] == [True, False]
    assert rounds[1]["overwritten"] == 123
    assert _report.thaw_section([]) == ""


@pytest.mark.parametrize("arm", ["with", "without"])
def test_a_round_with_a_problem_is_reported_as_such(arm):
    base = GOOD_WITH if arm == "with" else GOOD_WITHOUT
    r = replace(base, problems=["the WRITE finished before the freeze took hold"])
    assert not r.ok()
    assert "PROBLEM: the WRITE finished" in _report.thaw_section([r])


# -- when the decode-side prefill freezes (prefill-freeze-sent) ------------------------
W, DONE = "WaitingForInput", "Success"


def test_the_freeze_waits_for_a_room_of_each_named_server():
    # the failure seen at load 6: every "with" room was done at the moment of the check,
    # so a rule reading the live rooms' tags froze with a "without" request pinned only
    statuses = {1: W}
    tags = {1: "without"}
    assert not ready_to_freeze(statuses, tags, set(), {"without", "with"}, waiting=W)
    statuses[2], tags[2] = W, "with"
    assert ready_to_freeze(statuses, tags, set(), {"without", "with"}, waiting=W)
    # a room whose KV was sent no longer counts; nothing is wanted: never
    assert not ready_to_freeze(statuses, tags, {2}, {"without", "with"}, waiting=W)
    assert not ready_to_freeze(statuses, tags, set(), set(), waiting=W)


@given(
    rooms=st.dictionaries(
        st.integers(0, 30),
        st.tuples(
            st.sampled_from(["without", "with"]), st.sampled_from([W, DONE, "Bootstrapping"])
        ),
    ),
    sent=st.sets(st.integers(0, 30)),
)
def test_a_freeze_always_pins_a_request_on_every_named_server(rooms, sent):
    statuses = {room: status for room, (_, status) in rooms.items()}
    tags = {room: tag for room, (tag, _) in rooms.items()}
    wanted = {"without", "with"}
    pinned = {tags[r] for r, s in statuses.items() if s == W and r not in sent}
    assert ready_to_freeze(statuses, tags, sent, wanted, waiting=W) == (pinned == wanted)
