"""Issue 20 for stallguard-vllm: a bad configuration is the one named error
(``stallguard.ConfigError``) that stops the engine, never a raw traceback: regressions
(a file that is not UTF-8, values nested thousands deep, a 5,000-digit integer) and
fuzzing of the reader, the connector's and the plugin's entry points and
``python -m stallguard_vllm`` (random bytes, deep nesting, huge integers, non-finite
floats, wrong types). Pure Python (vLLM is not needed: the plugin validates before it
looks for vLLM)."""

from __future__ import annotations

import math
import os
import tempfile
from unittest import mock

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from stallguard_vllm import plugin
from stallguard_vllm.__main__ import main
from stallguard_vllm._config import Config, config_or_raise, load_config, parse_config

from stallguard import ConfigError

ENV = "STALLGUARD_VLLM_CONFIG"

FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

BAD_FILES = {
    "latin1": (b"[decode]\nReceiving = 7 # 7 \xb5s\n", "not UTF-8 text"),  # was UnicodeDecodeError
    "deep": (b"x = " + b"[" * 3000 + b"]" * 3000 + b"\n", "values nested too deeply"),
    "digits": (b"[decode]\nReceiving = " + b"9" * 5000 + b"\n", "an integer of more than"),
    "400 digits": (
        b"[decode]\nReceiving = " + b"9" * 400 + b"\n",
        "[decode] Receiving = 99999999999999999999... (400 digits): must be a positive",
    ),
}


def write(directory: str, data: bytes) -> str:
    path = os.path.join(directory, "sg.toml")
    with open(path, "wb") as f:
        f.write(data)
    return path


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_a_bad_file_is_a_config_error_everywhere(tmp_path, name) -> None:
    data, expected = BAD_FILES[name]
    path = write(str(tmp_path), data)
    with pytest.raises(ConfigError) as info:
        load_config({ENV: path})
    assert str(info.value).startswith(f"{path}: ") and expected in str(info.value)
    assert len(str(info.value)) < 400
    with pytest.raises(ConfigError, match="^stallguard-vllm: invalid configuration, refusing"):
        config_or_raise({ENV: path})  # the connector's constructor
    with (
        mock.patch.dict(os.environ, {ENV: path}, clear=True),
        pytest.raises(ConfigError, match="refusing to start: " + path),
    ):
        plugin.register()  # vLLM lets it stop the engine


def test_any_other_failure_loading_is_the_named_error(tmp_path) -> None:
    path = write(str(tmp_path), b"")
    with (
        mock.patch("stallguard_vllm._config.parse_config", side_effect=KeyError("surprise")),
        pytest.raises(ConfigError) as info,
    ):
        load_config({ENV: path})
    assert str(info.value).startswith(f"{path}: cannot interpret it (KeyError: 'surprise')")
    with (
        mock.patch("stallguard_vllm._config.connector_config", side_effect=RuntimeError("x")),
        pytest.raises(ConfigError, match="cannot load the configuration, refusing"),
    ):
        config_or_raise({})
    with (
        mock.patch.object(plugin, "load_config", side_effect=RuntimeError("disk on fire")),
        pytest.raises(ConfigError, match="refusing to start: RuntimeError: disk on fire"),
    ):
        plugin.register()


@pytest.mark.parametrize("lease", ["nan", "inf", "-1", "0", "soon"])
def test_the_cli_refuses_a_bad_lease_on_one_line(capsys, lease) -> None:
    with mock.patch.dict(os.environ, {}, clear=True), pytest.raises(SystemExit) as info:
        main(["--lease", lease])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a positive, finite number of seconds" in err


# --------------------------------------------------------------------------- fuzzing

LINES = [
    'mode = "enforce"',
    'mode = "report"',
    'mode = "off"',
    'mode = "enforced"',
    "[decode]",
    "[prefill]",
    "[decod]",
    "Receiving = 45",
    "Receiving = { seconds = 1 }",
    'Queued = "none"',
    "AbortedHeld = 5.5",
    "HeldForRead = 90",
    "Receiving = nan",
    "Receiving = -inf",
    "Receiving = inf",
    "Receiving = -1",
    "Receiving = true",
    "Receiving = 1979-05-27",
    "Receiving = " + "9" * 400,
    "Receiving = " + "9" * 5000,
    "x = " + "[" * 3000 + "]" * 3000,
    "= broken",
]
files = st.tuples(
    st.lists(st.sampled_from(LINES) | st.text(max_size=16), max_size=8),
    st.just(b"") | st.binary(max_size=8) | st.just(b"# \xb5s"),
    st.integers(min_value=0, max_value=200),
).map(lambda t: splice("\n".join(t[0]).encode("utf-8", "surrogatepass"), t[1], t[2]))


def splice(data: bytes, noise: bytes, where: int) -> bytes:
    return data[:where] + noise + data[where:]


def assert_valid(config: Config) -> None:
    for seconds in config.deadlines().values():
        assert seconds is None or (math.isfinite(seconds) and seconds > 0)


@FUZZ
@given(data=files)
def test_random_files_every_entry_point(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write(tmp, data)
        try:
            config = load_config({ENV: path})
        except ConfigError as e:
            message = str(e)
            assert message.startswith(path) and len(message) < 600 + len(path), message
            expected: Config | ConfigError = e
            event("refused")
        else:
            assert config is not None
            assert_valid(config)
            expected = config
            event("loaded")
        # the connector, the plugin and the CLI agree, and raise nothing else
        if isinstance(expected, ConfigError):
            with pytest.raises(ConfigError, match="refusing to start"):
                config_or_raise({ENV: path})
        else:
            assert config_or_raise({ENV: path}) == expected
        with mock.patch.dict(os.environ, {ENV: path}, clear=True):
            try:
                plugin.register()
            except ConfigError as e:
                assert isinstance(expected, ConfigError) and str(expected) in str(e)
            else:
                assert not isinstance(expected, ConfigError)
            with (
                mock.patch("sys.stdout", new_callable=_Text),
                mock.patch("sys.stderr", new_callable=_Text) as err,
            ):
                status = main([])
        if isinstance(expected, ConfigError):
            assert status == 2
            assert err.getvalue() == f"stallguard-vllm: invalid configuration: {expected}\n"
        else:
            # valid: 0, or the documented status for the vLLM installed here (3: none,
            # as in .venv; 4: outside the supported range)
            from stallguard_vllm.package import is_supported, vllm_version

            version = vllm_version()
            want = 3 if version is None else 0 if is_supported(version) else 4
            assert status == want, err.getvalue()


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
values = st.recursive(
    st.one_of(
        numbers,
        st.booleans(),
        st.sampled_from(["none", "enforce", "report", "off", ""]),
        st.text(max_size=6),
        st.integers(min_value=500, max_value=3000).map(nested),
    ),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["Receiving", "Queued", "HeldForRead", "x"]), inner)
    ),
    max_leaves=8,
)
seconds = st.one_of(st.integers(1, 10**6), st.floats(1e-3, 1e6), st.just("none"), numbers)
near_valid = st.fixed_dictionaries(
    {},
    optional={
        "mode": st.sampled_from(["enforce", "report", "off", "on"]),
        "decode": st.dictionaries(st.sampled_from(["Queued", "Receiving", "AbortedHeld"]), seconds),
        "prefill": st.dictionaries(st.sampled_from(["HeldForRead"]), seconds | values),
    },
)
documents = near_valid | st.dictionaries(
    st.sampled_from(["mode", "decode", "prefill", "other"]), values
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


@FUZZ
@given(
    flag=st.none() | st.text(max_size=8) | st.just("9" * 5000),
    path=st.none() | st.text(max_size=8),
)
def test_random_environments(flag: str | None, path: str | None) -> None:
    env = {k: v for k, v in (("STALLGUARD_VLLM", flag), (ENV, path)) if v is not None}
    if any("\x00" in v for v in env.values()):
        return  # not an environment variable
    try:
        config_or_raise(env)
    except ConfigError as e:
        assert len(str(e)) < 600 + 4 * len(path or "")
