"""The real-server rig's own logic, without servers (examples/real_servers/_main.py): the
fault's placement (``Sync``), the event times read from the scrapes, and the CLI's
refusals. The servers' side of it is tests/test_real_servers_shared.py."""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from examples.real_servers import _main as rig


@dataclass
class FakeDecode:
    """Stands in for a server's process group (``_servers.Proc``): records the signals
    the placement sends it instead of stopping a process (in *log*, shared by every
    fake of one run, when given)."""

    pgid: int = 4242
    signals: list[str] = field(default_factory=list)
    name: str = "decode"
    log: list[str] | None = None

    def freeze(self) -> None:
        self.signals.append("STOP")
        if self.log is not None:
            self.log.append(f"STOP {self.name}")

    def thaw(self) -> None:
        self.signals.append("CONT")
        if self.log is not None:
            self.log.append(f"CONT {self.name}")


def _arrive_all(
    sync: rig.Sync,
    arms: dict[str, tuple[float, list[int]]],
    decode: FakeDecode,
    prefills: dict[str, FakeDecode] | None = None,
    stagger: float = 0.0,
) -> dict[str, bool]:
    """Every arm arrives from its own thread (the n-th one *stagger* s after the first);
    *arms*: name -> (lead, counts), counts being what its progress reads on each call
    (the last value repeats); *prefills*: the arms' prefills, which the placement may
    hold."""
    placed: dict[str, bool] = {}

    def one(i: int, name: str, lead: float, counts: list[int]) -> None:
        reads = iter(counts)
        last = [counts[0]]

        def progress() -> int:
            last[0] = next(reads, last[0])
            return last[0]

        time.sleep(i * stagger)
        prefill = (prefills or {}).get(name)
        placed[name] = sync.arrive(name, lead, progress, decode, prefill)  # type: ignore[arg-type]

    threads = [
        threading.Thread(target=one, args=(i, n, *v)) for i, (n, v) in enumerate(arms.items())
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return placed


@pytest.fixture(autouse=True)
def _no_recheck_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rig, "RECHECK_S", 0.0)


def test_both_between_first_and_last_chunk_one_freeze_for_both() -> None:
    sync, decode = rig.Sync(2, chunks=3, freeze_at=1), FakeDecode()
    placed = _arrive_all(sync, {"without": (6.1, [1, 1]), "with": (8.8, [2, 2])}, decode)
    assert placed == {"without": True, "with": True}
    assert decode.signals == ["STOP"]  # one decode shared: frozen once
    assert sync.placement["chunks"] == {"without": 1, "with": 2}
    assert sync.placement["chunks_after_freeze"] == {"without": 1, "with": 2}


def test_an_arm_past_its_last_chunk_is_not_frozen_and_the_faster_arm_waits_next_time() -> None:
    sync, decode = rig.Sync(2, chunks=3, freeze_at=1), FakeDecode()
    placed = _arrive_all(sync, {"without": (4.0, [3]), "with": (9.5, [1])}, decode)
    assert placed == {"without": False, "with": False}
    assert decode.signals == []  # never frozen
    # the next attempt sends the faster arm's request later by its lead
    assert sync.delay == {"without": pytest.approx(5.5), "with": 0.0}


def test_a_last_chunk_logged_right_after_the_freeze_thaws_and_does_not_count() -> None:
    sync, decode = rig.Sync(2, chunks=3, freeze_at=1), FakeDecode()
    placed = _arrive_all(sync, {"without": (5.0, [2, 3]), "with": (5.0, [1, 1])}, decode)
    assert placed == {"without": False, "with": False}
    assert decode.signals == ["STOP", "CONT"]
    assert sync.placement["chunks_after_freeze"]["without"] == 3


@given(
    counts=st.dictionaries(
        st.sampled_from(["a", "b", "c"]), st.integers(0, 6), min_size=1, max_size=3
    ),
    chunks=st.integers(2, 5),
)
def test_placed_exactly_when_every_arm_is_between_its_first_and_last_chunk(
    counts: dict[str, int], chunks: int
) -> None:
    sync, decode = rig.Sync(len(counts), chunks=chunks, freeze_at=1), FakeDecode()
    placed = _arrive_all(sync, {n: (1.0, [c]) for n, c in counts.items()}, decode)
    expected = all(1 <= c < chunks for c in counts.values())
    assert set(placed.values()) == {expected}
    assert decode.signals == (["STOP"] if expected else [])


def test_the_arm_that_arrives_first_is_held_until_the_decode_is_frozen() -> None:
    """The faster arm's prefill is SIGSTOPped as it arrives and SIGCONTed only after the
    decode's freeze: its last chunk cannot overtake the slower arm's first."""
    log: list[str] = []
    decode = FakeDecode(log=log)
    prefills = {n: FakeDecode(name=n, log=log) for n in ("without", "with")}
    sync = rig.Sync(2, chunks=4, freeze_at=1)
    placed = _arrive_all(
        sync, {"without": (0.3, [1]), "with": (1.1, [1])}, decode, prefills, stagger=0.2
    )
    assert placed == {"without": True, "with": True}
    assert log == ["STOP without", "STOP decode", "CONT without"]
    assert sync.placement["held_s"]["without"] >= 0.15
    assert "with" not in sync.placement["held_s"]  # the last to arrive is never held


def test_a_held_prefill_is_resumed_when_the_attempt_is_not_placed() -> None:
    log: list[str] = []
    prefills = {n: FakeDecode(name=n, log=log) for n in ("a", "b")}
    sync = rig.Sync(2, chunks=3, freeze_at=1)
    # "b" arrives already past its last chunk: no freeze, "a" resumed all the same
    placed = _arrive_all(
        sync, {"a": (0.1, [1]), "b": (0.2, [3])}, FakeDecode(log=log), prefills, stagger=0.1
    )
    assert placed == {"a": False, "b": False}
    assert log == ["STOP a", "CONT a"]


def test_a_held_prefill_is_resumed_when_another_arm_gives_up() -> None:
    log: list[str] = []
    prefill = FakeDecode(name="a", log=log)
    sync = rig.Sync(2, chunks=3, freeze_at=1)
    got: list[BaseException] = []

    def arrive() -> None:
        try:
            sync.arrive("a", 0.1, lambda: 1, FakeDecode(log=log), prefill)  # type: ignore[arg-type]
        except threading.BrokenBarrierError as e:
            got.append(e)

    t = threading.Thread(target=arrive)
    t.start()
    deadline = time.monotonic() + 10
    while not sync.held and time.monotonic() < deadline:
        time.sleep(0.01)
    sync.give_up()  # the other arm failed before it reached its first chunk
    t.join(timeout=10)
    assert got and log == ["STOP a", "CONT a"]
    assert not sync.held


@given(
    counts=st.dictionaries(
        st.sampled_from(["a", "b", "c"]), st.integers(0, 6), min_size=1, max_size=3
    ),
    chunks=st.integers(2, 5),
)
def test_every_hold_is_released_exactly_once_and_after_any_freeze(
    counts: dict[str, int], chunks: int
) -> None:
    log: list[str] = []
    prefills = {n: FakeDecode(name=n, log=log) for n in counts}
    sync = rig.Sync(len(counts), chunks=chunks, freeze_at=1)
    _arrive_all(sync, {n: (1.0, [c]) for n, c in counts.items()}, FakeDecode(log=log), prefills)
    for name in counts:
        stops, conts = log.count(f"STOP {name}"), log.count(f"CONT {name}")
        assert stops == conts <= 1
        if stops and "STOP decode" in log:
            assert log.index("STOP decode") < log.index(f"CONT {name}")
    # only an arm with chunks still to go that was not the last to arrive is held
    assert all(counts[n] < chunks for n in counts if f"STOP {n}" in log)
    assert not sync.held


def _row(t: float, inflight: float, forced: float = 0.0, sg: float = 0.0) -> dict[str, float]:
    return {"t": t, "inflight": inflight, "forced": forced, "sg_oldest": sg}


def test_event_times_are_bounded_by_the_last_scrape_that_read_the_page() -> None:
    nan = math.nan
    rows = [
        _row(1.0, 0),
        _row(2.5, 1, sg=0.4),
        _row(4.0, 1, sg=1.9),
        {"t": 6.0, "inflight": nan, "forced": nan, "sg_oldest": nan},  # a failed scrape
        _row(9.0, 0, forced=1),
    ]
    ev = rig.events_from_samples(rows)
    assert ev["entry_s"] == ev["inflight_from_s"] == ev["sg_from_s"] == 2.5
    assert ev["entry_after_s"] == 1.0
    assert ev["forced_s"] == ev["released_s"] == 9.0
    assert ev["forced_after_s"] == 4.0  # not the failed scrape at 6.0


def test_stallguard_s_gauge_alone_marks_the_entry() -> None:
    ev = rig.events_from_samples([_row(1.0, 0), _row(2.0, 0, sg=0.2)])
    assert ev["entry_s"] == ev["sg_from_s"] == 2.0 and "inflight_from_s" not in ev


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (
            ["--prompt-tokens", "1024", "--freeze-at-chunk", "2"],
            "--freeze-at-chunk 2: must be 1 to 1",
        ),
        (["--freeze-at-chunk", "0"], "--freeze-at-chunk 0: must be 1 to 3"),
        (["--prompt-tokens", "300"], "--prompt-tokens 300: needs at least 2 chunks"),
        (["--prompt-tokens", "-5"], "--prompt-tokens -5: needs at least 2 chunks"),
        (["--backend", "rdma"], "--backend 'rdma': must be one of nixl, mooncake"),
        (["--tp", "0"], "--tp 0: must be 1 to 8"),
        (["--tp", "9"], "--tp 9: must be 1 to 8"),
        (["--dp", "0"], "--dp 0: must be 1 to 8"),
        (["--dp", "9"], "--dp 9: must be 1 to 8"),
        (["--dp", "-1"], "--dp -1: must be 1 to 8"),
    ],
)
def test_the_cli_refuses_bad_options_naming_them(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        rig.main(argv)
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err


def test_a_final_scrape_is_retried_until_it_reads_the_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy prefill's /metrics can time out (NaN row): the scrapes the assertions read
    are retried until one reads the page, within a limit."""
    nan = math.nan
    rows = iter([_row(1.0, nan), _row(2.0, nan), _row(3.0, 0, forced=1)])
    monkeypatch.setattr(rig, "scrape", lambda arm, t0: next(rows))
    monkeypatch.setattr(rig.time, "sleep", lambda s: None)
    assert rig.scrape_read(None, 0.0) == _row(3.0, 0, forced=1)  # type: ignore[arg-type]
    monkeypatch.setattr(rig, "scrape", lambda arm, t0: _row(4.0, nan))
    assert math.isnan(rig.scrape_read(None, 0.0, limit=0.0)["inflight"])  # type: ignore[arg-type]


def test_the_fault_matrix_s_decode_frozen_uses_the_checked_placement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``decode_frozen`` of the fault matrix (examples/real_servers/_faults.py) freezes
    both arms' decodes at one placement: the faster arm's prefill held until the slower
    one logged its first chunk, both decodes stopped, then the held prefill resumed."""
    from types import SimpleNamespace

    from examples.real_servers import _faults

    log: list[str] = []
    # chunks each arm's prefill has logged: "with" logs its first chunk 0.3 s later
    started: dict[str, float] = {}

    def batch_lines(arm: _faults.Arm) -> int:
        if arm.name not in started:
            return 0
        lag = 0.3 if arm.name == "with" else 0.0
        held = any(s == f"STOP {arm.name}-prefill" for s in log)
        return 1 if time.monotonic() - started[arm.name] > lag or held else 0

    class FakeClient:
        def __init__(self, servers: object, n: int, seed: int, timeout: float, t0: float):
            self.name, self.t0 = servers.name, t0  # type: ignore[attr-defined]
            self.thread = threading.Thread(target=lambda: None)

        def start(self) -> FakeClient:
            started[self.name] = time.monotonic()
            return self

        def waiting(self) -> bool:
            return True

        def outcome(self) -> dict[str, object]:
            return {"status": None}

    monkeypatch.setattr(_faults, "batch_lines", batch_lines)
    monkeypatch.setattr(_faults, "Client", FakeClient)
    window = _faults.Window(2)
    arms = [
        _faults.Arm(
            name,
            SimpleNamespace(  # type: ignore[arg-type]
                name=name,
                procs={
                    "decode": FakeDecode(pgid=i, name=f"{name}-decode", log=log),
                    "prefill": FakeDecode(pgid=10 + i, name=f"{name}-prefill", log=log),
                },
            ),
        )
        for i, name in enumerate(("without", "with"))
    ]
    recs: dict[str, dict[str, object]] = {a.name: {} for a in arms}
    threads = [
        threading.Thread(target=_faults._placed_decode_freeze, args=(a, window, recs[a.name]))
        for a in arms
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert log[0] == "STOP without-prefill"
    assert sorted(log[1:3]) == ["STOP with-decode", "STOP without-decode"]
    assert log[3:] == ["CONT without-prefill"]
    for rec in recs.values():
        (attempt,) = rec["attempts"]  # type: ignore[misc]
        assert attempt["placed"] and attempt["held_s"]["without"] >= 0.2


def test_tp_servers_bind_one_core_per_rank() -> None:
    """A CPU server with --tp > 1 gets SGLANG_CPU_OMP_THREADS_BIND (SGLang refuses more
    ranks than NUMA nodes without it); --tp is on every server's command line, once."""
    from examples.real_servers import _servers as srv

    cores = srv.os.cpu_count() or 1
    assert srv.tp_env(1) == {}
    assert srv.tp_env(2) == {"SGLANG_CPU_OMP_THREADS_BIND": f"0|{1 % cores}"}
    one = srv.ServerSet(
        "a", rig.ROOT, None, ports={k: 1 for k in ("prefill", "bootstrap", "decode")}
    )
    two = srv.ServerSet("a", rig.ROOT, None, tp=2, ports=dict(one.ports))
    argv = one.server_argv("prefill")
    assert argv.count("--tp") == 1 and argv[argv.index("--tp") + 1] == "1"
    argv = two.server_argv("decode")
    assert argv.count("--tp") == 1
    assert argv[argv.index("--tp") + 1] == "2"


def test_dp_servers_run_dp_replicas_with_one_core_per_rank() -> None:
    """--dp N puts --dp-size N on both servers' command lines (not at --dp 1: SGLang then
    starts no DP controller), and SGLANG_CPU_OMP_THREADS_BIND gets tp x dp entries:
    SGLang picks entry gpu_id, which is dp_rank * tp + tp_rank for a DP replica's rank."""
    from examples.real_servers import _servers as srv

    cores = srv.os.cpu_count() or 1
    assert srv.tp_env(1, 1) == {}
    assert srv.tp_env(1, 2) == srv.tp_env(2) == {"SGLANG_CPU_OMP_THREADS_BIND": f"0|{1 % cores}"}
    bind = srv.tp_env(2, 2)["SGLANG_CPU_OMP_THREADS_BIND"].split("|")
    assert bind == [str(i % cores) for i in range(4)]
    ports = {k: 1 for k in ("prefill", "bootstrap", "decode", "router", "router_metrics")}
    one = srv.ServerSet("a", rig.ROOT, None, ports=dict(ports))
    assert all("--dp-size" not in one.server_argv(m) for m in ("prefill", "decode"))
    two = srv.ServerSet("a", rig.ROOT, None, dp=2, ports=dict(ports))
    for mode in ("prefill", "decode"):
        argv = two.server_argv(mode)
        assert argv.count("--dp-size") == 1 and argv[argv.index("--dp-size") + 1] == "2"
        assert argv[argv.index("--tp") + 1] == "1"
    assert "--dp-size" not in two.router_argv()


def test_dp_servers_get_the_binding_in_their_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Both servers of a --dp 2 set are spawned with the binding of 2 ranks."""
    from examples.real_servers import _servers as srv

    spawned: dict[str, tuple[list[str], dict[str, str]]] = {}
    monkeypatch.setattr(
        srv, "spawn", lambda name, argv, env, log: spawned.setdefault(name, (argv, dict(env)))
    )
    ports = {k: 1 for k in ("prefill", "bootstrap", "decode")}
    srv.ServerSet("with", tmp_path, tmp_path / "sg.toml", dp=2, ports=ports).start_servers()
    assert sorted(spawned) == ["with-decode", "with-prefill"]
    for argv, env in spawned.values():
        assert env["SGLANG_CPU_OMP_THREADS_BIND"] == srv.tp_env(1, 2)["SGLANG_CPU_OMP_THREADS_BIND"]
        assert env["STALLGUARD_SGLANG_CONFIG"] == str(tmp_path / "sg.toml")
        assert "--dp-size" in argv


def test_per_series_keeps_each_rank_s_counts() -> None:
    """The final scrape keeps who counted what: one sample per rank's label set, the
    ones that are not 0."""
    text = "\n".join(
        [
            "# HELP sglang:stallguard_forced_failures_total x",
            'sglang:stallguard_forced_failures_total{queue="inflight",dp_rank="1",tp_rank="0"} 1.0',
            'sglang:num_transfer_failed_reqs_total{dp_rank="0",tp_rank="0"} 0.0',
            'sglang:num_transfer_failed_reqs_total{dp_rank="1",tp_rank="0"} 1.0',
            'sglang:num_running_reqs{dp_rank="1"} 3.0',
        ]
    )
    got = rig.per_series(text)
    assert [(r["name"], r["labels"].get("dp_rank"), r["value"]) for r in got] == [
        ("sglang:stallguard_forced_failures_total", "1", 1.0),
        ("sglang:num_transfer_failed_reqs_total", "1", 1.0),
    ]


def test_the_verdict_expects_one_forced_failure_per_tp_rank() -> None:
    """With --tp 2 the ranks conclude the request at once; each rank whose own clock
    found it overdue counts it under its own tp_rank (the rig sums the series): 1 or 2
    is right there, exactly 1 at --tp 1."""

    def results(tp: int, forced: float) -> dict[str, object]:
        ok = [{"status": 200}]
        arm = {
            "errors": [],
            "requests": {"warmup": ok, "healthy_before": ok, "healthy_after": ok},
            "fault": {"observation": {"inflight": 0, "forced": forced}, "client": {"status": 500}},
            "events": {"forced_s": 12.0, "inflight_from_s": 3.0},
        }
        return {"deadline_s": 10.0, "tp": tp, "arms": {"with": arm}}

    assert rig.verdict(results(1, 1)) == []
    assert rig.verdict(results(2, 2)) == [] and rig.verdict(results(2, 1)) == []
    assert rig.verdict(results(1, 2)) and rig.verdict(results(2, 3)) and rig.verdict(results(2, 0))
    # --dp 2: one count, by one replica; a count under each replica is wrong
    one = results(1, 1)
    forced = {"name": "sglang:stallguard_forced_failures_total", "value": 1.0}
    one["arms"]["with"]["fault"]["series"] = {"prefill": [{**forced, "labels": {"dp_rank": "1"}}]}  # type: ignore[index]
    assert rig.verdict(one) == []
    two = results(2, 2)
    two["arms"]["with"]["fault"]["series"] = {  # type: ignore[index]
        "prefill": [{**forced, "labels": {"dp_rank": r}} for r in ("0", "1")]
    }
    assert rig.verdict(two) == ["with: forced failures counted by DP ranks ['0', '1']"]


def test_the_fault_matrix_s_observation_is_retried_unless_the_server_is_frozen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from examples.real_servers import _faults

    nan = math.nan
    rows = iter([{"t": 1.0, "prefill.inflight": nan}, {"t": 2.0, "prefill.inflight": 0.0}])
    monkeypatch.setattr(_faults, "scrape", lambda arm, t0: next(rows))
    monkeypatch.setattr(_faults.time, "sleep", lambda s: None)
    prefill = FakeDecode()
    prefill.frozen = False  # type: ignore[attr-defined]
    arm = SimpleNamespace(servers=SimpleNamespace(procs={"prefill": prefill}))
    assert _faults.scrape_read(arm, 0.0, "prefill.inflight")["t"] == 2.0  # type: ignore[arg-type]
    prefill.frozen = True  # type: ignore[attr-defined]
    monkeypatch.setattr(_faults, "scrape", lambda arm, t0: {"t": 3.0, "prefill.inflight": nan})
    assert _faults.scrape_read(arm, 0.0, "prefill.inflight")["t"] == 3.0  # type: ignore[arg-type]


def _arm(obs: dict[str, float], events: dict[str, float], client: int = 500) -> dict[str, object]:
    ok = [{"status": 200}]
    return {
        "errors": [],
        "requests": {"warmup": ok, "healthy_before": ok, "healthy_after": ok},
        "fault": {"observation": obs, "client": {"status": client}, "final": {}},
        "events": events,
    }


def test_on_mooncake_the_deadline_is_two_states_and_the_control_may_be_released_by_sglang() -> None:
    """Mooncake's sender reports no Transferring: stallguard's deadline is WaitingForInput +
    Transferring (2 x --deadline), and SGLang's own write timeout releases the control
    (its transfer-failure counter) - after stallguard's deadline, or the run shows
    nothing. NIXL's rules are unchanged: there the control must stay pinned."""
    with_ = _arm({"inflight": 0, "forced": 1}, {"forced_s": 14.0, "inflight_from_s": 3.0})
    pinned = _arm({"inflight": 1, "client_waiting": 1}, {"inflight_from_s": 3.0})
    released = _arm(
        {"inflight": 0, "transfer_failed": 1}, {"inflight_from_s": 3.0, "released_s": 24.0}
    )
    early = _arm({"inflight": 0, "transfer_failed": 1}, {"inflight_from_s": 3.0, "released_s": 7.0})
    lost = _arm({"inflight": 0}, {"inflight_from_s": 3.0, "released_s": 24.0})

    def results(backend: str, without: dict[str, object]) -> dict[str, object]:
        return {"deadline_s": 5.0, "backend": backend, "arms": {"without": without, "with": with_}}

    assert rig.effective_deadline(results("mooncake", pinned)) == 10.0
    assert rig.effective_deadline(results("nixl", pinned)) == 5.0
    assert rig.verdict(results("mooncake", pinned)) == []
    assert rig.verdict(results("mooncake", released)) == []  # SGLang at +21 s, stallguard +11
    assert rig.verdict(results("mooncake", early))  # SGLang before the deadline: no case
    assert rig.verdict(results("mooncake", lost))  # released, nothing failed it: a bug
    # failed as it entered the queue (the transport dropped the session first): no case
    at_entry = _arm({"inflight": 0, "transfer_failed": 1}, {})
    assert any("as it entered" in b for b in rig.verdict(results("mooncake", at_entry)))
    # stallguard failing it later after entry than SGLang did is no release at all
    late = _arm({"inflight": 0, "forced": 1}, {"forced_s": 30.0, "inflight_from_s": 3.0})
    bad = rig.verdict(
        {"deadline_s": 5.0, "backend": "mooncake", "arms": {"without": released, "with": late}}
    )
    assert any("later" in b for b in bad)
    # on NIXL a control released by anything is no wedge; 11 s after entry is past 5 + 5
    assert rig.verdict(results("nixl", released))
    assert rig.verdict(results("nixl", pinned)) != []
    assert (
        rig.verdict(
            {"deadline_s": 10.0, "backend": "nixl", "arms": {"without": pinned, "with": with_}}
        )
        == []
    )


def _standins(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The rig's stand-in module, loaded under another name with everything off (its
    import installs nothing in this process then)."""
    import importlib.util

    monkeypatch.setenv("STALLGUARD_REALSRV_STANDINS", "0")
    monkeypatch.delenv("STALLGUARD_REALSRV_DP_RANK_FIX", raising=False)
    monkeypatch.delenv("STALLGUARD_REALSRV_PLUGIN_TRACE", raising=False)
    path = rig.ROOT / "examples" / "real_servers" / "standins" / "_stallguard_realsrv.py"
    spec = importlib.util.spec_from_file_location("_realsrv_standins_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    before = list(sys.meta_path)
    spec.loader.exec_module(module)
    assert sys.meta_path == before and module.PATCHES == {}
    return module


def test_the_dp_rank_fix_gives_a_dp_replica_its_own_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang 0.5.23's CommonKVManager keeps attn_dp_rank 0 on every DP replica (its
    prefill sender then fails every request sent to replica 1 at bootstrap): the fix
    takes the replica's rank there, and only for DP replicas."""
    from types import ModuleType

    standins = _standins(monkeypatch)

    class CommonKVManager:
        def __init__(self, system_dp_size: int, system_dp_rank: int, attn: tuple[int, int]) -> None:
            self.system_dp_size, self.system_dp_rank = system_dp_size, system_dp_rank
            self.attn_dp_size, self.attn_dp_rank = attn

    class NixlKVManager(CommonKVManager):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)

    conn = ModuleType("conn")
    conn.CommonKVManager = CommonKVManager  # type: ignore[attr-defined]
    standins._replica_dp_rank(conn)
    standins._replica_dp_rank(conn)  # once only
    assert NixlKVManager(2, 1, (1, 0)).attn_dp_rank == 1  # a replica: its own rank
    assert NixlKVManager(2, 0, (1, 0)).attn_dp_rank == 0
    assert NixlKVManager(1, 0, (2, 1)).attn_dp_rank == 1  # DP attention: untouched
    assert NixlKVManager(1, 0, (1, 0)).attn_dp_rank == 0


def test_the_env_turns_the_fix_and_the_trace_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from examples.real_servers import _servers as srv

    assert srv.dp_env(1) == {} and srv.dp_env(1, fix=False) == {}
    assert srv.dp_env(2) == {srv.PLUGIN_TRACE_ENV: "1", srv.DP_RANK_FIX_ENV: "1"}
    assert srv.dp_env(2, fix=False) == {srv.PLUGIN_TRACE_ENV: "1"}
    standins = _standins(monkeypatch)
    assert standins.DP_RANK_FIX_ENV == srv.DP_RANK_FIX_ENV
    assert standins.PLUGIN_TRACE_ENV == srv.PLUGIN_TRACE_ENV


def test_the_plugin_trace_tags_sglang_s_loader_lines_with_the_pid(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The trace shows SGLang's plugin loader's INFO lines (dropped before SGLang
    configures logging) with the pid, which the rig parses back; the adapter's own
    logger gets no handler from it."""
    import logging

    from examples.real_servers import _servers as srv

    standins = _standins(monkeypatch)
    logger = logging.getLogger("sglang.srt.plugins")
    handlers, level = list(logger.handlers), logger.level
    try:
        standins.trace_plugin_loading()
        standins.trace_plugin_loading()  # one handler
        assert len(logger.handlers) == len(handlers) + 1
        logger.handlers[-1].stream = sys.stderr  # capsys's
        logging.getLogger("sglang.srt.plugins").info("Executed general plugin: stallguard")
        logging.getLogger("sglang.srt.plugins.hook_registry").info(
            "Applied 1 hook(s) to a.B.c (from: plugin=stallguard, dist=stallguard-sglang)"
        )
        assert not logging.getLogger("stallguard.sglang").handlers
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)
    err = capsys.readouterr().err
    got = srv.plugin_trace("noise\n" + err)
    assert got == {
        os.getpid(): [
            "Executed general plugin: stallguard",
            "Applied 1 hook(s) to a.B.c (from: plugin=stallguard, dist=stallguard-sglang)",
        ]
    }


def test_plugins_by_process_joins_the_trace_to_the_process_titles(tmp_path: Path) -> None:
    """Which process of each server ran the entry point and hooked targets, by title."""
    from types import SimpleNamespace

    log = tmp_path / "with-prefill.log"
    tag, plugins, registry = "[realsrv plugin trace pid=", "sglang.srt.plugins", ".hook_registry"
    hooked = "Applied 1 hook(s) to x.Y.{} (from: plugin=stallguard, dist=stallguard-sglang)"
    lines = [
        f"{tag}11] {plugins}: Executed general plugin: stallguard",
        f"{tag}12] {plugins}: Executed general plugin: stallguard",
        f"{tag}12] {plugins}{registry}: {hooked.format('z')}",
        f"{tag}12] {plugins}{registry}: {hooked.format('w')}",
        f"{tag}13] {plugins}: Loaded plugin stallguard",
    ]
    log.write_text("\n".join(lines))
    prefill = SimpleNamespace(log_text=log.read_text)
    servers = SimpleNamespace(procs={"prefill": prefill}, owns=lambda mode: True)
    arm = SimpleNamespace(
        servers=servers,
        events={"processes": {"prefill": {11: "sglang::data_parallel_controller"}}},
    )
    assert rig.plugins_by_process(arm) == {  # type: ignore[arg-type]
        "prefill": {
            "sglang::data_parallel_controller": {"pid": 11, "executed": True, "hooks": 0},
            "pid 12": {"pid": 12, "executed": True, "hooks": 2},
            "pid 13": {"pid": 13, "executed": False, "hooks": 0},
        }
    }
