"""The real-server rig's own logic, without servers (examples/real_servers/_main.py): the
fault's placement (``Sync``), the event times read from the scrapes, and the CLI's
refusals. The servers' side of it is tests/test_real_servers_shared.py."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from examples.real_servers import _main as rig


@dataclass
class FakeDecode:
    """Stands in for a decode's process group (``_servers.Proc``): records the signals
    the placement sends it instead of stopping a process."""

    pgid: int = 4242
    signals: list[str] = field(default_factory=list)

    def freeze(self) -> None:
        self.signals.append("STOP")

    def thaw(self) -> None:
        self.signals.append("CONT")


def _arrive_all(
    sync: rig.Sync, arms: dict[str, tuple[float, list[int]]], decode: FakeDecode
) -> dict[str, bool]:
    """Every arm arrives at once from its own thread; *arms*: name -> (lead, counts),
    counts being what its progress reads on each call (the last value repeats)."""
    placed: dict[str, bool] = {}

    def one(name: str, lead: float, counts: list[int]) -> None:
        reads = iter(counts)
        last = [counts[0]]

        def progress() -> int:
            last[0] = next(reads, last[0])
            return last[0]

        placed[name] = sync.arrive(name, lead, progress, decode)  # type: ignore[arg-type]

    threads = [threading.Thread(target=one, args=(n, *v)) for n, v in arms.items()]
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
    ],
)
def test_the_cli_refuses_bad_options_naming_them(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        rig.main(argv)
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err
