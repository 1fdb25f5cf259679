"""stallguard-vllm's settings in vLLM's own ``kv_connector_extra_config`` (the
``"stallguard"`` table of ``--kv-transfer-config``; docs/vllm.md): the TOML file's
schema, validated by the same reader, over the file key by key; hypothesis feeds it
what a JSON command line (or a Python caller) can hold."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stallguard_vllm._config import EXTRA_SOURCE, Config, config_or_raise, connector_config

from stallguard import ConfigError


def test_extra_config_alone_configures_the_connector() -> None:
    extra = json.loads(
        '{"backends": ["UCX"], "stallguard": {"mode": "report", '
        '"decode": {"Receiving": 45, "Queued": "none"}}}'
    )
    config = connector_config({}, extra)
    assert config.mode == "report" and config.receiving == 45.0 and config.queued is None
    assert config.held_for_read == Config().held_for_read  # the defaults elsewhere
    assert config.source.endswith(" + " + EXTRA_SOURCE)


def test_extra_config_overrides_the_file_key_by_key(tmp_path: Path) -> None:
    path = tmp_path / "sg.toml"
    path.write_text('mode = "report"\n[decode]\nReceiving = 30\nAbortedHeld = 4\n')
    env = {"STALLGUARD_VLLM_CONFIG": str(path)}
    config = connector_config(env, {"stallguard": {"decode": {"Receiving": 90}}})
    assert (config.mode, config.receiving, config.aborted_held) == ("report", 90.0, 4.0)
    assert config.source == f"{path} + {EXTRA_SOURCE}"
    assert connector_config(env, {"backends": ["UCX"]}).receiving == 30.0  # none given


def test_the_kill_switch_wins_over_the_extra_config() -> None:
    config = connector_config({"STALLGUARD_VLLM": "0"}, {"stallguard": {"mode": "enforce"}})
    assert config.mode == "off"


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ({"decode": {"Receiving": -1}}, "[decode] Receiving = -1: must be a positive"),
        ({"decode": {"Recieving": 3}}, "unknown key (did you mean 'Receiving'?)"),
        ({"mode": "enforced"}, 'mode = "enforced": must be one of "enforce", "report", "off"'),
        ({"decode": 3}, "decode = 3: must be a table ([decode])"),
        ([1, 2], "the configuration must be a table, got [1, 2]"),
        ({"decode": {"Receiving": 10**400}}, "(this one is too large for a float)"),
    ],
)
def test_bad_extra_config_names_it_the_key_and_the_value(section: object, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_or_raise({}, {"stallguard": section})
    message = str(info.value)
    assert message.startswith(
        f"stallguard-vllm: invalid configuration, refusing to start: {EXTRA_SOURCE}: "
    ), message
    assert expected in message, message


def test_a_bad_file_is_named_before_the_extra_config(tmp_path: Path) -> None:
    path = tmp_path / "sg.toml"
    path.write_text("[decode]\nReceiving = 0\n")
    with pytest.raises(ConfigError, match=f"{path}: \\[decode\\] Receiving = 0"):
        connector_config({"STALLGUARD_VLLM_CONFIG": str(path)}, {"stallguard": {}})


#: what a JSON --kv-transfer-config (or a Python caller) can put in the table
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=10**300, max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=8).map(lambda b: b.decode("utf-8", "surrogateescape")),
    st.sampled_from(["none", "enforce", "report", "off", "Receiving", "decode"]),
)
keys = st.one_of(
    st.sampled_from(["mode", "decode", "prefill", "Receiving", "Queued", "HeldForRead"]),
    st.text(max_size=6),
    st.integers(),
)
tables = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(keys, inner, max_size=4)),
    max_leaves=12,
)


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = {"decode": value}
    return value


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(tables, st.dictionaries(keys, tables, max_size=4), st.integers(1, 3000).map(_nested))
)
def test_any_extra_config_is_a_config_or_one_named_error(section: object) -> None:
    """Nothing but a valid Config or a ConfigError naming the table (and, for a value,
    its key and the value), printable as UTF-8; never another exception."""
    try:
        config = config_or_raise({}, {"stallguard": section})
    except ConfigError as e:
        message = str(e)
        assert f"refusing to start: {EXTRA_SOURCE}: " in message, message
        message.encode("utf-8")
        return
    for seconds in config.deadlines().values():
        assert seconds is None or (seconds > 0 and math.isfinite(seconds))
    assert config.mode in ("enforce", "report", "off")
