"""``python -m stallguard_sglang advise`` on saved scrapes: the table, the TOML block,
the baseline comparison and the errors (exit status 2, a message naming the problem).
The end-to-end run on the real queue is test_adapter_advice.py."""

from __future__ import annotations

import math

import pytest
import tomllib
from stallguard_sglang.__main__ import main

from stallguard._stats import LADDER

NAME = "sglang:stallguard_state_seconds"


def scrape(stays: dict[tuple[str, ...], list[float]], *, deadlines=None) -> str:
    """An exposition like the adapter's, two ranks, for {(backend, state): stays} (or
    {(backend, state, queue): stays}; the queue is ``inflight`` otherwise)."""
    lines = [f"# TYPE {NAME} histogram"]
    for key, values in stays.items():
        backend, state, queue = (*key, "inflight")[:3]
        for rank, part in (("0", values[::2]), ("1", values[1::2])):
            labels = f'backend="{backend}",queue="{queue}",state="{state}",tp_rank="{rank}"'
            for bound in (*LADDER, math.inf):
                le = "+Inf" if bound == math.inf else repr(bound)
                count = sum(1 for v in part if v <= bound)
                lines.append(f'{NAME}_bucket{{{labels},le="{le}"}} {count}.0')
            lines.append(f"{NAME}_sum{{{labels}}} {sum(part)}")
        deadline = (deadlines or {}).get(state, 0)
        lines.append(
            f'sglang:stallguard_deadline_seconds{{backend="{backend}",queue="{queue}",'
            f'state="{state}"}} {deadline}'
        )
    return "\n".join(lines) + "\n"


def test_file_prints_a_table_and_a_toml_block_per_backend(tmp_path, capsys):
    stays = {
        ("nixl", "Transferring"): [0.5 + i / 1000 for i in range(200)],
        ("nixl", "WaitingForInput"): [0.1] * 200,
        ("mooncake", "WaitingForInput"): [30.0] * 50,  # fewer stays: a per-backend table
    }
    path = tmp_path / "metrics.txt"
    path.write_text(scrape(stays, deadlines={"Transferring": 300}))
    assert main(["advise", "--file", str(path), "--min-samples", "50"]) == 0
    out = capsys.readouterr().out
    assert "== inflight queue, nixl" in out and "== inflight queue, mooncake" in out
    block = out.split("names:\n")[1]
    data = tomllib.loads(block)
    assert data["prefill"]["deadlines"] == {"Transferring": 10, "WaitingForInput": 10}
    assert data["prefill"]["backends"]["mooncake"]["deadlines"] == {"WaitingForInput": 60}
    assert "300s" in out  # the current deadline, from the gauge

    assert main(["advise", "--file", str(path), "--min-samples", "50", "--toml"]) == 0
    assert capsys.readouterr().out.startswith("[prefill.deadlines]")


def test_decode_queues_get_their_tables_in_the_toml_block(tmp_path, capsys):
    """Decode deadlines are not per backend: each phase gets the longest suggestion
    across backends (a comment names which); a phase without enough stays is a comment
    saying why; the block loads through the adapter's own reader with those values."""
    from stallguard_sglang._advise import advise_text
    from stallguard_sglang._config import parse_config

    stays = {
        ("nixl", "WaitingForInput"): [0.1] * 200,  # the inflight queue: [prefill.deadlines]
        ("nixl", "WaitingForPrefill", "prealloc"): [2.0] * 200,
        ("mooncake", "WaitingForPrefill", "prealloc"): [20.0] * 200,  # the longer one
        ("nixl", "WaitingForInput", "prealloc"): [1.0] * 200,
        ("nixl", "Bootstrapping", "prealloc"): [1.0] * 10,  # too few: a comment
        ("nixl", "WaitingForInput", "transfer"): [8.0] * 200,
        ("mooncake", "Transferring", "transfer"): [0.2] * 100,
    }
    text = scrape(stays)
    path = tmp_path / "metrics.txt"
    path.write_text(text)
    assert main(["advise", "--file", str(path), "--min-samples", "50", "--toml"]) == 0
    block = capsys.readouterr().out
    assert "== " not in block
    data = tomllib.loads(block)
    # what each backend's own table suggests
    advice = advise_text(text, min_samples=50)

    def suggested(queue, backend, state):
        return advice[(queue, backend)].states[state].suggested

    longest = suggested("prealloc", "mooncake", "WaitingForPrefill")
    assert longest > suggested("prealloc", "nixl", "WaitingForPrefill")
    assert data["decode"]["prealloc"] == {
        "WaitingForPrefill": longest,
        "WaitingForInput": suggested("prealloc", "nixl", "WaitingForInput"),
    }
    assert data["decode"]["transfer"] == {
        "WaitingForInput": suggested("transfer", "nixl", "WaitingForInput"),
        "Transferring": suggested("transfer", "mooncake", "Transferring"),
    }
    assert f"WaitingForPrefill = {longest:g}  # mooncake" in block
    assert "# Bootstrapping: no suggestion (not enough data" in block
    config = parse_config(data, source="advise --toml")
    assert config.decode.prealloc["WaitingForPrefill"].seconds == longest
    assert (
        config.decode.transfer["Transferring"].seconds == data["decode"]["transfer"]["Transferring"]
    )


def test_baseline_flags_a_growing_tail(tmp_path, capsys):
    before = [1.0] * 500
    after = before + [20.0] * 500
    (tmp_path / "a.txt").write_text(scrape({("nixl", "Transferring"): before}))
    (tmp_path / "b.txt").write_text(scrape({("nixl", "Transferring"): after}))
    argv = ["advise", "--file", str(tmp_path / "b.txt"), "--min-samples", "10"]
    assert main([*argv, "--baseline", str(tmp_path / "a.txt")]) == 0
    assert "the tail is growing" in capsys.readouterr().out
    assert main(argv) == 0
    assert "the tail is growing" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "argv", "message"),
    [
        (None, ["--file", "/nonexistent/metrics.txt"], "No such file"),
        ("oops oops\n", ["--file", "{path}"], "line 1 is not a Prometheus sample: 'oops oops'"),
        ("some_metric 1\n", ["--file", "{path}"], "no sglang:stallguard_state_seconds"),
        (None, ["--multiproc-dir", "/nonexistent"], "is not a directory"),
        (None, ["--file", "{path}", "--false-timeout-rate", "2"], "false_timeout_rate"),
    ],
)
def test_bad_input_exits_2_with_a_message(tmp_path, capsys, content, argv, message):
    path = tmp_path / "m.txt"
    path.write_text(content if content is not None else scrape({("nixl", "Transferring"): [1]}))
    argv = [a.replace("{path}", str(path)) for a in argv]
    assert main(["advise", *argv]) == 2
    assert message in capsys.readouterr().err
