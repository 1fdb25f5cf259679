"""Fuzzing stallguard-sglang's configuration boundary (issue 20), the way
tests/test_config_fuzz.py fuzzes the core's: random TOML files (invalid bytes, values
nested thousands deep, integers of 5,000 digits, non-finite floats, wrong types), random
parsed documents, random environments and random metrics for ``advise``. Whatever comes
in:

* the reader returns a valid :class:`Config` or raises a ``ConfigError`` naming the file,
  with a message of bounded length;
* the plugin entry point, run the way SGLang's ``load_plugins()`` runs it (every
  ``Exception`` swallowed), either installs exactly the configuration the reader returns
  or raises ``SystemExit``: never returns with a configuration given but not applied;
* ``python -m stallguard_sglang`` and ``advise`` exit 0 or 2, and on 2 print one line on
  stderr and no traceback.

Pure Python (no SGLang import); example counts stay small (the suite runs on a loaded
machine: ``deadline=None``, timing is not the property).
"""

from __future__ import annotations

import math
import os
import tempfile
from unittest import mock

import stallguard_sglang.__main__ as cli
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from stallguard_sglang import load_config, parse_config, plugin
from stallguard_sglang._config import Config

from stallguard import ConfigError, Deadline

ENV = "STALLGUARD_SGLANG_CONFIG"

FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TABLES = [
    "[prefill]",
    "[prefill.deadlines]",
    "[prefill.backends.nixl.deadlines]",
    "[prefill.backends.mooncake]",
    "[prefill.backends.nixI.deadlines]",
    "[bootstrap_queue]",
    "[decode]",
    "[decode.prealloc]",
    "[decode.transfer]",
    "[prefil]",
]
LINES = [
    'mode = "enforce"',
    'mode = "report"',
    'mode = "auto"',
    'mode = "off"',
    "mode = 1",
    "Transferring = 20",
    "Transferring = { seconds = 120, stall = 15 }",
    "Transferring = { seconds = 1, stal = 1 }",
    'WaitingForInput = "none"',
    "Bootstrapping = 300",
    "WaitingForPrefill = 5",
    "Success = 5",
    "deadline = 30",
    "deadline = 0.5",
    "deadline = " + "9" * 400,  # beyond a float (was: OverflowError)
    "deadline = " + "9" * 5000,  # beyond int() (was: ValueError)
    "Transferring = " + "9" * 400,
    "deadline = nan",
    "deadline = inf",
    "Transferring = -inf",
    "Transferring = nan",
    "Transferring = -5",
    "Transferring = 1979-05-27",
    "Transferring = [1, 2]",
    'deadline = "soon"',
    "deadline = true",
    "x = " + "[" * 3000 + "]" * 3000,  # nested too deeply (was: RecursionError)
    "deadlines = { Transferring = { seconds = { a = 1 } } }",
    "= broken",
    "Transferring = 1",  # a duplicate key when drawn twice
]
GOOD = ["[prefill.deadlines]", "Transferring = 20", "[bootstrap_queue]", "deadline = 30"]

files = st.tuples(
    st.one_of(
        st.lists(st.sampled_from(TABLES + LINES) | st.text(max_size=16), max_size=8),
        st.lists(st.sampled_from(LINES), max_size=3).map(lambda tail: GOOD + tail),
    ),
    st.just(b"") | st.binary(max_size=8) | st.sampled_from([b"# \xb5s", b"\xff\xfe", b"\x00"]),
    st.integers(min_value=0, max_value=200),
).map(lambda t: splice("\n".join(t[0]).encode("utf-8", "surrogatepass"), t[1], t[2]))


def splice(data: bytes, noise: bytes, where: int) -> bytes:
    return data[:where] + noise + data[where:]


def write(directory: str, data: bytes) -> str:
    path = os.path.join(directory, "sg.toml")
    with open(path, "wb") as f:
        f.write(data)
    return path


def assert_valid(config: Config) -> None:
    """What loaded is a configuration the adapter can run: every deadline positive and
    finite (or none)."""
    tables = [
        config.prefill.deadlines,
        *config.prefill.backends.values(),
        config.decode.prealloc,
        config.decode.transfer,
    ]
    for table in tables:
        for deadline in table.values():
            assert isinstance(deadline, Deadline)
            for seconds in (deadline.seconds, deadline.stall):
                assert seconds is None or (math.isfinite(seconds) and seconds > 0)
    boot = config.bootstrap_queue.deadline
    assert boot is None or (math.isfinite(boot) and boot > 0)


def load(path: str) -> Config | ConfigError:
    try:
        config = load_config({ENV: path})
    except ConfigError as e:
        message = str(e)
        assert path in message, message  # every file error names the file
        assert len(message) < 600 + len(path), message  # values shortened
        return e
    assert config is not None
    assert_valid(config)
    return config


@FUZZ
@given(data=files)
def test_random_files_load_or_raise_a_config_error_naming_the_file(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        result = load(write(tmp, data))
    event("refused" if isinstance(result, ConfigError) else "loaded")


def run_plugin(env: dict[str, str]) -> tuple[list[Config], SystemExit | None]:
    """plugin.register() under *env*, called as SGLang's load_plugins() calls it (every
    Exception swallowed), with install() recorded."""
    installed: list[Config] = []
    with (
        mock.patch.dict(os.environ, env, clear=True),
        mock.patch.object(plugin, "install", lambda config, *, via: installed.append(config)),
        mock.patch.object(plugin, "_installed", None),
    ):
        try:
            plugin.register()
        except SystemExit as e:
            return installed, e
        except Exception:  # what load_plugins() would swallow: the server unguarded
            raise AssertionError("an Exception escaped register(): SGLang swallows it") from None
    return installed, None


@FUZZ
@given(data=files)
def test_the_plugin_installs_the_file_or_refuses_to_start(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write(tmp, data)
        expected = load(path)
        installed, stopped = run_plugin({ENV: path})
    if isinstance(expected, ConfigError):
        assert stopped is not None and installed == []
        assert str(stopped.code) == (
            f"stallguard-sglang: invalid configuration, refusing to start: {expected}"
        )
        event("refused to start")
    else:
        assert stopped is None and installed == [expected]  # applied, exactly as read
        event("installed")


@FUZZ
@given(data=files)
def test_the_cli_exits_0_or_2_with_one_line(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write(tmp, data)
        expected = load(path)
        with (
            mock.patch.dict(os.environ, {}, clear=True),
            mock.patch("sys.stdout", new_callable=_Text) as out,
            mock.patch("sys.stderr", new_callable=_Text) as err,
        ):
            status = cli.main(["--config", path, "--sglang-version", "0.5.23"])
    if isinstance(expected, ConfigError):
        assert status == cli.EXIT_USAGE
        assert err.getvalue() == f"stallguard-sglang: invalid configuration: {expected}\n"
        assert out.getvalue() == ""
    else:
        assert status == cli.EXIT_OK, err.getvalue()
        assert f"config: {path}" in out.getvalue()


class _Text:
    """A minimal text stream for sys.stdout / sys.stderr."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def getvalue(self) -> str:
        return "".join(self.parts)


# --------------------------------------------------------------------------- documents


def nested(depth: int) -> list[object]:
    value: list[object] = []
    for _ in range(depth):
        value = [value]
    return value


numbers = st.one_of(
    st.integers(min_value=-3, max_value=10**6),
    st.integers(min_value=10**300, max_value=10**420),
    st.sampled_from([1, -1]).map(lambda sign: sign * 10**5000),  # (hypothesis cannot repr it)
    st.floats(allow_nan=True, allow_infinity=True),
)
scalars = st.one_of(
    numbers,
    st.booleans(),
    st.none(),
    st.sampled_from(["none", "enforce", "report", "auto", "off", "", "20"]),
    st.text(max_size=6),
    st.integers(min_value=500, max_value=3000).map(nested),
)
KEYS = [
    "mode",
    "deadlines",
    "backends",
    "deadline",
    "prealloc",
    "transfer",
    "nixl",
    "fake",
    "Transferring",
    "WaitingForInput",
    "Bootstrapping",
    "WaitingForPrefill",
    "seconds",
    "stall",
]
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS), inner),
    max_leaves=8,
)
seconds = st.one_of(st.integers(1, 10**6), st.floats(1e-3, 1e6), st.just("none"), numbers)
near_valid = st.fixed_dictionaries(
    {},
    optional={
        "prefill": st.fixed_dictionaries(
            {},
            optional={
                "mode": st.sampled_from(["enforce", "report", "off", "strict"]),
                "deadlines": st.dictionaries(
                    st.sampled_from(["Bootstrapping", "WaitingForInput", "Transferring"]),
                    seconds | values,
                ),
            },
        ),
        "bootstrap_queue": st.fixed_dictionaries(
            {}, optional={"mode": st.sampled_from(["auto", "off"]), "deadline": seconds}
        ),
        "decode": st.fixed_dictionaries(
            {}, optional={"transfer": st.dictionaries(st.sampled_from(["Transferring"]), seconds)}
        ),
    },
)
documents = near_valid | st.dictionaries(
    st.sampled_from(["prefill", "bootstrap_queue", "decode", "prefil"]), values, max_size=3
)


@FUZZ
@given(document=documents)
def test_random_documents_parse_or_raise_a_short_config_error(document: dict) -> None:
    try:
        config = parse_config(document, source="fuzz.toml")
    except ConfigError as e:
        assert str(e).startswith("fuzz.toml: ") and len(str(e)) < 600, str(e)
        event("refused")
        return
    assert_valid(config)
    event("parsed")


# --------------------------------------------------------------------------- environment

env_values = st.one_of(
    st.sampled_from(["1", "0", "true", "off", " yes ", "", "maybe", "9" * 5000]),
    st.text(max_size=12),
).filter(lambda v: "\x00" not in v)


@FUZZ
@given(flag=st.none() | env_values, path=st.none() | env_values)
def test_random_environments(flag: str | None, path: str | None) -> None:
    env = {}
    if flag is not None:
        env["STALLGUARD_SGLANG"] = flag
    if path is not None:
        env[ENV] = path
    try:
        expected = load_config(env)
    except ConfigError as e:
        assert len(str(e)) < 600 + 4 * len(path or "")  # the path (escaped), once
        expected = e
    installed, stopped = run_plugin(env)
    if isinstance(expected, ConfigError):
        assert stopped is not None and installed == []
    elif expected is None:  # disabled
        assert stopped is None and installed == []
    else:
        assert stopped is None and installed == [expected]


# --------------------------------------------------------------------------- advise

SERIES = 'sglang:stallguard_state_seconds_bucket{backend="nixl",queue="inflight",state="A",'
METRIC_LINES = st.one_of(
    st.builds(
        lambda le, value: f'{SERIES}le="{le}"}} {value}',
        st.sampled_from(["1.0", "10.0", "+Inf", "NaN", "-Inf", "soon", "1e999", ""]),
        st.sampled_from(["0", "1", "5.0", "+Inf", "-Inf", "NaN", "-1", "1e308", "x", "9" * 400]),
    ),
    st.sampled_from(
        [
            'sglang:stallguard_state_seconds_sum{backend="nixl",queue="inflight",state="A"} NaN',
            'sglang:stallguard_deadline_seconds{backend="nixl",queue="inflight",state="A"} +Inf',
            'sglang:stallguard_forced_failures_total{backend="nixl",queue="inflight",'
            'state="A"} NaN',
            "# TYPE x counter",
            "oops",
            "a{b=1} 2",
        ]
    ),
    st.text(max_size=20),
)


@FUZZ
@given(
    lines=st.lists(METRIC_LINES, max_size=8),
    noise=st.just(b"") | st.binary(max_size=4),
    argv=st.sampled_from([[], ["--toml"], ["--min-samples", "1"], ["--margin", "nan"]]),
)
def test_advise_exits_0_or_2_with_one_line(lines: list[str], noise: bytes, argv: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "metrics.txt")
        with open(path, "wb") as f:
            f.write("\n".join(lines).encode("utf-8", "surrogatepass") + noise)
        with (
            mock.patch("sys.stdout", new_callable=_Text),
            mock.patch("sys.stderr", new_callable=_Text) as err,
        ):
            try:
                status = cli.main(["advise", "--file", path, *argv])
            except SystemExit as e:  # argparse
                status = e.code
    assert status in (0, 2)
    if status == 2:
        text = err.getvalue()
        assert text.count("\n") == 1 and "Traceback" not in text, text
        assert text.startswith("stallguard-sglang advise: ") or "error:" in text
    event(f"status {status}")
