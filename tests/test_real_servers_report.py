"""The real-server fault matrix's judgement and command line (examples/real_servers
_faults.py, _advice.py), on recorded-shape results: no server is started here.

The verdict is what the demo's exit status says about a run, so it must catch each way
a fault can go wrong: no wedge without stallguard, no release with it, a failure counted
for an aborted request, a new request failing after the fault.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from examples.real_servers import _advice, _faults


def _rec(queue: str, held: list[float], forced: list[float], *, ok_after: bool = True) -> Any:
    """One arm's record of one fault: *held* is the queue gauge per scrape (1 s apart),
    *forced* the holding server's stallguard counter."""
    server = queue.split(".")[0]
    samples = []
    for i, (h, f) in enumerate(zip(held, forced, strict=True)):
        row = {k: 0.0 for k in _faults.METRICS_KEYS}
        row.update({"t": float(i), queue: h, f"{server}.forced": f, "clients_waiting": 1.0})
        samples.append(row)
    entry = next((r["t"] for r in samples if r[queue] >= 1), None)
    rec: dict[str, Any] = {"samples": samples, "observation": samples[-1], "final": samples[-1]}
    if entry is not None:
        rec["entry_s"] = entry
    rec["healthy_after"] = [{"status": 200 if ok_after else 500}, {"status": 200}]
    rec["clients"] = [{"status": 200, "t_end_s": 9.0}]
    return rec


def _results(fault: str, without: Any, with_: Any) -> dict[str, Any]:
    return {
        "deadline_s": 3.0,
        "total_s": 1.0,
        "faults": [fault],
        "arms": {
            "without": {"faults": {fault: without}, "errors": [], "healthy_after": {}},
            "with": {"faults": {fault: with_}, "errors": [], "healthy_after": {}},
        },
    }


PINNED: list[float] = [0, 1, 1, 1, 1, 1, 1, 1]
RELEASED: list[float] = [0, 1, 1, 1, 0, 0, 0, 0]
FORCED: list[float] = [0, 0, 0, 0, 1, 1, 1, 1]
NONE: list[float] = [0.0] * 8


def test_a_wedge_without_and_a_release_with_is_ok() -> None:
    fault, q = "decode_frozen", "prefill.inflight"
    res = _results(fault, _rec(q, PINNED, NONE), _rec(q, RELEASED, FORCED))
    assert _faults.verdict(res) == []
    assert _faults.released_at(res["arms"]["with"]["faults"][fault], q) == 4.0
    assert _faults.released_at(res["arms"]["without"]["faults"][fault], q) is None
    assert _faults.delta(res["arms"]["with"]["faults"][fault], "prefill.forced") == 1.0
    text = _faults.table(res)
    assert f"| {fault} | with | `{q}` | +1 s | +4 s | 0 |" in text


def _with_counter(rec: Any, key: str, values: list[float]) -> Any:
    for row, v in zip(rec["samples"], values, strict=True):
        row[key] = v
    return rec


def test_a_decode_side_wedge_is_judged_by_the_client_and_the_counters() -> None:
    """No decode queue gauge (SGLang refreshes it only when the decode logs a batch):
    pinned is the client waiting with nothing counted; released is stallguard's count."""
    fault, q = "prefill_scheduler_frozen", "decode.transfer"
    res = _results(fault, _rec(q, NONE, NONE), _rec(q, NONE, FORCED))
    assert _faults.verdict(res) == []
    # the without arm's request failed by something: not a wedge
    failed = _with_counter(_rec(q, NONE, NONE), "decode.transfer_failed", FORCED)
    bad = _faults.verdict(_results(fault, failed, _rec(q, NONE, FORCED)))
    assert bad == [f"{fault}/without: a failure was counted on ['decode'] (no wedge)"]
    bad = _faults.verdict(_results(fault, _rec(q, NONE, NONE), _rec(q, NONE, NONE)))
    assert bad == [f"{fault}/with: no stallguard failure counted on the decode"]


def test_a_whole_prefill_group_frozen_is_sglangs_to_fail() -> None:
    fault, q = "prefill_frozen_after_metadata", "decode.transfer"
    lost = _with_counter(_rec(q, NONE, NONE), "decode.transfer_failed", FORCED)
    also = _with_counter(_rec(q, NONE, NONE), "decode.transfer_failed", FORCED)
    assert _faults.verdict(_results(fault, lost, also)) == []
    bad = _faults.verdict(_results(fault, _rec(q, NONE, NONE), also))
    assert bad == [f"{fault}/without: SGLang's decode did not fail it"]


def test_each_way_a_fault_can_go_wrong_is_named() -> None:
    q = "prefill.inflight"
    cases = {
        "no wedge": (_rec(q, RELEASED, NONE), _rec(q, RELEASED, FORCED)),
        "not 0 at the observation": (_rec(q, PINNED, NONE), _rec(q, PINNED, NONE)),
        "no stallguard failure": (_rec(q, PINNED, NONE), _rec(q, RELEASED, NONE)),
        "new requests after": (_rec(q, PINNED, NONE), _rec(q, RELEASED, FORCED, ok_after=False)),
    }
    for what, (without, with_) in cases.items():
        bad = _faults.verdict(_results("decode_frozen", without, with_))
        assert any(what in b for b in bad), (what, bad)


def test_the_abort_storm_must_drain_and_count_nothing() -> None:
    q = "prefill.inflight"
    drained: list[float] = [2, 4, 3, 0, 0, 0, 0, 0]
    assert (
        _faults.verdict(_results("abort_storm", _rec(q, drained, NONE), _rec(q, drained, NONE)))
        == []
    )
    bad = _faults.verdict(_results("abort_storm", _rec(q, drained, NONE), _rec(q, drained, FORCED)))
    assert bad == ["abort_storm/with: stallguard counted a failure for aborted requests"]
    stuck: list[float] = [2, 4, 3, 1, 1, 1, 1, 1]
    bad = _faults.verdict(_results("abort_storm", _rec(q, stuck, NONE), _rec(q, drained, NONE)))
    assert len(bad) == 1 and bad[0].startswith("abort_storm/without: a queue did not drain")


def test_a_counter_missing_from_every_scrape_is_not_a_zero() -> None:
    rec = {"samples": [{"t": 0.0, "prefill.forced": math.nan}], "final": {}}
    assert math.isnan(_faults.delta(rec, "prefill.forced"))


def test_the_advised_deadline_is_read_from_the_block() -> None:
    block = "[prefill.deadlines]  # nixl\n# Bootstrapping: no suggestion\nTransferring = 10\n"
    assert _advice.advised_deadline(block, "Transferring") == 10.0
    assert _advice.advised_deadline(block, "Bootstrapping") is None


def test_the_command_lines_name_a_bad_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _faults.main(["--faults", "decode_frozen,decode_melted"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--faults: unknown fault(s) decode_melted" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as e:
        _advice.main(["--requests", "0"])
    assert e.value.code == 2
    assert "--requests: must be at least 1, got 0" in capsys.readouterr().err
