"""The inner-connector reader of ``StallguardConnector`` (``_inner.inner_transfer_config``)
against adversarial ``kv_connector_extra_config`` values (what ``--kv-transfer-config``
JSON can hold): it returns the inner config or raises one ``ConfigError`` naming the
field and the value, never another exception. The outer config here is a plain
dataclass with ``KVTransferConfig``'s field names (vLLM is absent in .venv); the real
``KVTransferConfig`` goes through it in test_vllm_generic.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stallguard_vllm._inner import inner_transfer_config

from stallguard import ConfigError


@dataclasses.dataclass
class Outer:
    kv_connector: str | None = "StallguardConnector"
    kv_connector_module_path: str | None = "stallguard_vllm.connector"
    kv_role: str = "kv_consumer"
    engine_id: str = "D"
    kv_connector_extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=12), children, max_size=3)
    ),
    max_leaves=8,
)
KEYS = st.sampled_from(
    ["kv_connector", "kv_connector_module_path", "kv_connector_extra_config", "kv_role", "x", "_x"]
)
INNER = st.dictionaries(KEYS, JSON | st.sampled_from(["MooncakeConnector", "StallguardX"]))


@settings(max_examples=300, deadline=None)
@given(inner=INNER | JSON)
def test_only_a_named_config_error_escapes(inner: Any) -> None:
    outer = Outer(kv_connector_extra_config={"inner": inner})
    try:
        out = inner_transfer_config(outer)
    except ConfigError as e:
        assert str(e).startswith("kv_transfer_config.kv_connector_extra_config.inner"), e
        assert " = " in str(e)
        return
    assert isinstance(inner, dict)
    assert out.kv_connector == inner["kv_connector"]
    assert isinstance(out.kv_connector_extra_config, dict)
    assert out.kv_role == inner.get("kv_role", "kv_consumer")
    assert outer.kv_connector == "StallguardConnector"  # the outer is not changed


def test_inner_keys_on_top_of_the_outer() -> None:
    outer = Outer(
        kv_connector_extra_config={
            "inner": {
                "kv_connector": "MooncakeConnector",
                "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
            }
        }
    )
    out = inner_transfer_config(outer)
    assert out.kv_connector == "MooncakeConnector"
    assert out.kv_connector_module_path is None
    assert out.kv_connector_extra_config == {"mooncake_protocol": "tcp"}
    assert (out.kv_role, out.engine_id) == ("kv_consumer", "D")


@pytest.mark.parametrize(
    ("inner", "message"),
    [
        (None, "inner = None: must be a table"),
        ({}, "inner.kv_connector = None: must be the inner connector's name"),
        ({"kv_connector": "StallguardNixlConnector"}, "cannot wrap another"),
        ({"kv_connector": "X", "kv_connector_extra_config": [1]}, "extra_config = [1]"),
        ({"kv_connector": "X", "kv_connector_module_path": 3}, "module_path = 3"),
        ({"kv_connector": "X", "bogus": 1}, "inner.bogus = 1: not a KVTransferConfig field"),
    ],
)
def test_bad_inner_named(inner: Any, message: str) -> None:
    with pytest.raises(ConfigError, match="kv_transfer_config.kv_connector_extra_config") as e:
        inner_transfer_config(Outer(kv_connector_extra_config={"inner": inner}))
    assert message in str(e.value)
