"""The inner connector's configuration of ``StallguardConnector`` (pure Python: the
config reader is fuzzed in .venv, where vLLM is absent; tests/test_vllm_inner_config.py)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from stallguard import ConfigError

__all__ = ["INNER_KEY", "inner_transfer_config"]

#: ``kv_connector_extra_config`` key of ``StallguardConnector``: the inner connector.
INNER_KEY = "inner"


def inner_transfer_config(outer: Any) -> Any:
    """The inner connector's ``KVTransferConfig``: *outer* with the keys of its
    ``kv_connector_extra_config["inner"]`` on top.

    Raises:
        stallguard.ConfigError: naming the key and the value, if ``inner`` is missing,
            not a table, lacks a ``kv_connector`` name or names a stallguard connector.
    """
    extra = outer.kv_connector_extra_config or {}
    inner = extra.get(INNER_KEY)
    if not isinstance(inner, Mapping):
        raise ConfigError(
            f"{_WHERE}.{INNER_KEY} = {inner!r}: must be a table naming the inner "
            'connector, e.g. {"kv_connector": "MooncakeConnector"}'
        )
    _check_name(inner.get("kv_connector"))
    fields = dict(inner)
    fields.setdefault("kv_connector_module_path", None)
    fields.setdefault("kv_connector_extra_config", {})
    _check_module_path(fields["kv_connector_module_path"])
    extra_config = fields["kv_connector_extra_config"]
    if not isinstance(extra_config, Mapping):
        raise ConfigError(
            f"{_WHERE}.{INNER_KEY}.kv_connector_extra_config = {extra_config!r}: must be a table"
        )
    fields["kv_connector_extra_config"] = dict(extra_config)
    out = copy.copy(outer)
    for key, value in fields.items():
        _set_field(outer, out, key, value)
    return out


_WHERE = "kv_transfer_config.kv_connector_extra_config"


def _check_name(name: object) -> None:
    """Refuse an inner ``kv_connector`` that is not a name, or names a stallguard
    connector."""
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f"{_WHERE}.{INNER_KEY}.kv_connector = {name!r}: must be the inner connector's name"
        )
    if name.startswith("Stallguard"):
        raise ConfigError(
            f"{_WHERE}.{INNER_KEY}.kv_connector = {name!r}: a stallguard connector cannot "
            "wrap another"
        )


def _check_module_path(path: object) -> None:
    """Refuse an inner ``kv_connector_module_path`` that is neither None nor a module
    path."""
    if path is not None and (not isinstance(path, str) or not path):
        raise ConfigError(
            f"{_WHERE}.{INNER_KEY}.kv_connector_module_path = {path!r}: must be a module "
            "path (a string) or left out"
        )


def _set_field(outer: Any, out: Any, key: object, value: object) -> None:
    """Set field *key* of *out* (a copy of *outer*) to *value*, if *key* is one of
    ``KVTransferConfig``'s fields and the value is valid for it."""
    if not isinstance(key, str) or key.startswith("_") or not hasattr(outer, key):
        raise ConfigError(f"{_WHERE}.{INNER_KEY}.{key} = {value!r}: not a KVTransferConfig field")
    try:
        setattr(out, key, value)
    except Exception as e:  # pydantic's validation on assignment
        raise ConfigError(f"{_WHERE}.{INNER_KEY}.{key} = {value!r}: {e}") from None
