"""``python -m stallguard_vllm advise``: the advice command as a subcommand of the
package's command line (as stallguard-sglang's), its errors, and fuzzing of its
arguments and of the files it reads. Whatever comes in, it exits 0 or 2, and on 2
prints one line on stderr, no traceback; a bad option value is named with its option.

Pure Python (vLLM is not needed). The exposition of the good path is written by
prometheus_client (the client library vLLM's ``/metrics`` uses), with stallguard-vllm's
metric names and labels and stallguard's bucket ladder.
"""

from __future__ import annotations

import io
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from stallguard_vllm import DEFAULTS, ENV_CONFIG, advise, load_config
from stallguard_vllm.__main__ import main
from stallguard_vllm._names import DEADLINE, FORCED_FAILURES, STATE_SECONDS

from stallguard.adapters import LADDER

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = Path(__file__).resolve().parents[3]

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

#: seconds per stay, per phase, of the exposition below (seeded: the same every run)
_rng = random.Random(7)
STAYS = {
    "Queued": [_rng.uniform(0.01, 0.4) for _ in range(40)],
    "Receiving": [_rng.uniform(0.2, 3.0) for _ in range(60)],
    "HeldForRead": [_rng.uniform(0.5, 6.0) for _ in range(30)],
}


def exposition() -> str:
    """stallguard-vllm's series for model ``tiny`` on two engines, as text."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    labels = ["model_name", "engine", "state"]
    hist = Histogram(STATE_SECONDS, "", labels, buckets=LADDER, registry=registry)
    gauge = Gauge(DEADLINE, "", labels, registry=registry)
    forced = Counter(FORCED_FAILURES, "", [*labels, "reason"], registry=registry)
    for state, stays in STAYS.items():
        for i, seconds in enumerate(stays):
            hist.labels("tiny", str(i % 2), state).observe(seconds)
        gauge.labels("tiny", "0", state).set(120.0)
    forced.labels("tiny", "0", "Receiving", "state").inc()
    return generate_latest(registry).decode()


@pytest.fixture(scope="module")
def metrics(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("advise") / "metrics.txt"
    path.write_text(exposition())
    return str(path)


ARGS = ["--min-samples", "10", "--floor", "1", "--margin", "2"]


def cli(*argv: str) -> tuple[int | str | None, str, str]:
    """``python -m stallguard_vllm`` in this process: (exit status, stdout, stderr)."""
    with (
        mock.patch("sys.stdout", new_callable=io.StringIO) as out,
        mock.patch("sys.stderr", new_callable=io.StringIO) as err,
    ):
        try:
            status: int | str | None = main(list(argv))
        except SystemExit as e:  # argparse's own errors (and --help)
            status = e.code
    return status, out.getvalue(), err.getvalue()


def test_advise_is_a_subcommand_with_one_deadline_per_phase(
    metrics: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["advise", "--file", metrics, "--toml", *ARGS]) == 0
    toml = capsys.readouterr().out
    # the block is stallguard-vllm's file: its own reader takes it as it is printed
    path = Path(metrics).with_name("advised.toml")
    path.write_text(toml)
    config = load_config({ENV_CONFIG: str(path)})
    assert config is not None
    assert "[decode]\n" in toml and "[prefill]\n" in toml, toml
    # p99.9 of the stays x 2, rounded up to the ladder, at least the floor: above twice
    # the longest stay (below 10 s the ladder rounds up by at most 2.5x)
    for value, state in (
        (config.queued, "Queued"),
        (config.receiving, "Receiving"),
        (config.held_for_read, "HeldForRead"),
    ):
        assert max(1.0, 2 * max(STAYS[state])) <= value <= 2.5 * 2 * max(STAYS[state]), toml
    assert config.aborted_held == DEFAULTS["AbortedHeld"]  # no stays: not in the block
    assert config.queued < config.receiving <= config.held_for_read
    # the full output: a table per model, the stays of both engines summed
    assert main(["advise", "--file", metrics, *ARGS]) == 0
    out = capsys.readouterr().out
    assert "== model tiny (engines and pods summed)" in out
    table = advise.advise_text(exposition(), min_samples=10, floor=1.0)["tiny"]
    assert {s: a.count for s, a in table.states.items()} == {s: len(v) for s, v in STAYS.items()}
    assert table.states["Receiving"].fired == 1
    # the 0.1 spelling (its own module) prints the same
    assert advise.main(["--file", metrics, "--toml", *ARGS]) == 0
    assert capsys.readouterr().out == toml


def test_the_installed_command_line_runs_advise(metrics: str) -> None:
    """Through the interpreter, as a user types it: ``python -m stallguard_vllm``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(ROOT), env.get("PYTHONPATH", "")])
    run = [sys.executable, "-m", "stallguard_vllm"]
    helped = subprocess.run([*run, "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert helped.returncode == 0 and "advise" in helped.stdout, helped.stderr
    sub = subprocess.run(
        [*run, "advise", "--help"], capture_output=True, text=True, env=env, timeout=120
    )
    for option in ("--prometheus", "--url", "--file", "--window", "--margin", "--toml"):
        assert option in sub.stdout, option
    proc = subprocess.run(
        [*run, "advise", "--file", metrics, "--toml", *ARGS],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0 and "\nReceiving = " in proc.stdout, proc.stderr
    bad = subprocess.run(
        [*run, "advise", "--file", metrics, "--margin", "0.5"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--margin", "nan", "margin must be a number, got nan"),
        ("--margin", "0.5", "margin must be in [1, inf], got 0.5"),
        ("--margin", "1e999", "margin must be finite"),
        ("--false-timeout-rate", "0.9", "false_timeout_rate must be in (0, 0.5]"),
        ("--false-timeout-rate", "x", "'x' is not a number"),
        ("--floor", "-1", "floor must be in [0, "),
        ("--min-samples", "0", "min_samples must be a positive int, got 0"),
        ("--min-samples", "1.5", "'1.5' is not an integer"),
        ("--min-samples", "9" * 5000, "is not an integer"),
        ("--window", "7x", "--window '7x': not a duration"),
        ("--step", "0s", "--step '0s'"),
    ],
)
def test_a_bad_option_is_named_with_its_value(
    metrics: str, option: str, value: str, says: str
) -> None:
    source = ["--prometheus", "http://127.0.0.1:1"] if option in ("--window", "--step") else []
    status, _, err = cli("advise", *(source or ["--file", metrics]), option, value)
    assert status == 2
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert option in err and says in err, err
    assert len(err) < 300, err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "one of the arguments --prometheus --url --file is required"),
        (["--file", "/nonexistent/m.txt"], "--file '/nonexistent/m.txt': cannot read it"),
        (["--url", "nota url"], "--url 'nota url': cannot scrape it"),
        (["--prometheus", "http://127.0.0.1:1"], "--prometheus 'http://127.0.0.1:1'"),
    ],
)
def test_a_bad_source_is_one_line_naming_it(argv: list[str], says: str) -> None:
    status, _, err = cli("advise", *argv)
    assert status == 2 and err.count("\n") == 1 and says in err, err


# --------------------------------------------------------------------------- fuzzing


SERIES = f'{STATE_SECONDS}_bucket{{model_name="tiny",engine="0",state="Receiving",'
METRIC_LINES = st.one_of(
    st.sampled_from(exposition().splitlines()),  # real lines, in any order and number
    st.builds(
        lambda le, value: f'{SERIES}le="{le}"}} {value}',
        st.sampled_from(["1.0", "10.0", "+Inf", "NaN", "-Inf", "soon", "1e999", ""]),
        st.sampled_from(["0", "1", "5.0", "+Inf", "-Inf", "NaN", "-1", "1e308", "x", "9" * 400]),
    ),
    st.sampled_from(
        [
            f'{STATE_SECONDS}_sum{{model_name="tiny",engine="0",state="Receiving"}} NaN',
            f'{DEADLINE}{{model_name="tiny",engine="0",state="Receiving"}} +Inf',
            f'{FORCED_FAILURES}_total{{model_name="tiny",state="Receiving"}} NaN',
            f'{STATE_SECONDS}_bucket{{model_name="\\u00e9",state="Q",le="+Inf"}} 3',
            "# TYPE x counter",
            "# EOF",
            "oops",
            "a{b=1} 2",
        ]
    ),
    st.text(max_size=20),
)
VALUES = st.sampled_from(
    ["nan", "inf", "-inf", "-1", "0", "0.5", "1", "2", "1e999", "", "x", "9" * 5000, "1e-300"]
)
OPTIONS = ["--false-timeout-rate", "--margin", "--floor", "--min-samples"]


@FUZZ
@given(
    lines=st.lists(METRIC_LINES, max_size=12),
    noise=st.just(b"") | st.binary(max_size=4),
    options=st.lists(st.tuples(st.sampled_from(OPTIONS), VALUES), max_size=3),
    toml=st.booleans(),
)
def test_advise_exits_0_or_2_with_one_line(
    lines: list[str], noise: bytes, options: list[tuple[str, str]], toml: bool
) -> None:
    argv = [x for pair in options for x in pair] + (["--toml"] if toml else [])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "metrics.txt")
        with open(path, "wb") as f:
            f.write("\n".join(lines).encode("utf-8", "surrogatepass") + noise)
        status, _, text = cli("advise", "--file", path, *argv)
    assert status in (0, 2)
    if status == 2:
        assert text.count("\n") == 1 and "Traceback" not in text, text
        assert text.startswith(("stallguard-vllm advise: ", "python -m stallguard_vllm advise:"))
        if "error: argument " in text:  # a bad option: named (with its value, if any)
            named = text.split("error: argument ", 1)[1].split(":", 1)[0]
            assert named in OPTIONS, text
            given_values = [v for o, v in options if o == named]
            if "expected one argument" not in text:  # ("-inf" reads as an option)
                assert any(repr(v)[:20] in text for v in given_values), text
    event(f"status {status}")


@FUZZ
@given(
    window=st.sampled_from(["7d", "90m", "1w", "0s", "-1d", "7x", "", "1e999s", "nan"])
    | st.text(max_size=6),
    step=st.none() | st.sampled_from(["15s", "0s", "-1s", "x", "1e999s"]) | st.text(max_size=4),
)
def test_advise_prometheus_window_and_step_exit_2_with_one_line(
    window: str, step: str | None
) -> None:
    """Every window and step against a server that is not there (a refused port):
    the message names the option and the value, or the server."""
    argv = ["advise", "--prometheus", "http://127.0.0.1:1", "--window", window]
    argv += [] if step is None else ["--step", step]
    status, _, text = cli(*argv)
    assert status == 2
    assert text.count("\n") == 1 and "Traceback" not in text, text
    # (too many points for Prometheus: "step 15s over a 604800s window ...")
    named = ("--window", "--step", "--prometheus")
    assert any(n in text for n in named) or ("step " in text and "s window" in text), text
