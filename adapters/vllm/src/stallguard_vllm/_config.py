"""The adapter's configuration: environment variables, the TOML file, and the
``"stallguard"`` entry of vLLM's ``kv_connector_extra_config``.

Every error is a :class:`stallguard.ConfigError` naming the file (or variable), the
dotted key and the bad value, in the core's message shape::

    /etc/sg.toml: [decode] Receiving = -1: must be a positive, finite number of seconds,
    or "none" for no deadline
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from stallguard import ConfigError
from stallguard.adapters import (
    TableReader,
    describe_exception,
    env_enabled,
    read_config,
    read_toml,
)

__all__ = [
    "DEFAULTS",
    "ENV_CONFIG",
    "ENV_ENABLE",
    "EXTRA_CONFIG_KEY",
    "EXTRA_SOURCE",
    "Config",
    "Mode",
    "load_config",
    "parse_config",
]

#: Names a TOML file: enables the adapter with that configuration.
ENV_CONFIG = "STALLGUARD_VLLM_CONFIG"
#: ``1`` enables the adapter with the defaults; ``0`` disables it even when
#: :data:`ENV_CONFIG` is set or the stallguard connector is selected (a kill switch).
ENV_ENABLE = "STALLGUARD_VLLM"

#: The key of ``kv_connector_extra_config`` (in ``--kv-transfer-config``) whose value is
#: a table of this adapter's settings, the TOML file's schema:
#: ``{"stallguard": {"mode": "report", "decode": {"Receiving": 60}}}``.
EXTRA_CONFIG_KEY = "stallguard"
#: How messages name that table.
EXTRA_SOURCE = f'kv_connector_extra_config["{EXTRA_CONFIG_KEY}"]'

Mode = Literal["enforce", "report", "off"]

#: Default deadlines (seconds; None = no deadline), by phase.
DEFAULTS: Mapping[str, float | None] = {
    "Queued": 600.0,
    "Receiving": 120.0,
    "AbortedHeld": 30.0,
    "HeldForRead": 600.0,
    "Quarantined": 300.0,
}
_DECODE_KEYS = ("Queued", "Receiving", "AbortedHeld", "Quarantined")
_PREFILL_KEYS = ("HeldForRead",)
_TOP_KEYS = ("mode", "decode", "prefill")


@dataclass(frozen=True)
class Config:
    """The whole configuration (docs/vllm.md has the file format).

    Attributes:
        mode: ``"enforce"`` fails overdue requests through vLLM's failure path;
            ``"report"`` only logs, traces and counts them; ``"off"`` makes the stallguard
            connector behave exactly like vLLM's NIXL connector.
        queued: decode, request queued before its blocks are allocated (it keeps the
            prefill's blocks leased by heartbeats). Always report-only: vLLM gives a
            connector no way to fail a request it has not allocated.
        receiving: decode, ``WAITING_FOR_REMOTE_KVS``: handshake and READ in flight
            (pull) or registration, WRITE and notification awaited (push).
        aborted_held: decode, the request finished (abort, error) while receiving: its
            blocks stay held until the transfer ends.
        held_for_read: prefill, blocks held after the prefill for the decode to read.
        quarantined: decode, how long the blocks of a request stallguard failed (or
            that was aborted while receiving) may stay quarantined, waiting for NIXL to
            report every transfer into them over, before the hold is escalated (logged
            at ERROR, reported, counted). The blocks are never freed on this timer: a
            late READ or WRITE would land in another request's KV (docs/vllm.md).
        source: the file's path, or ``"STALLGUARD_VLLM=1"``, or ``"defaults"``.
    """

    mode: Mode = "enforce"
    queued: float | None = DEFAULTS["Queued"]
    receiving: float | None = DEFAULTS["Receiving"]
    aborted_held: float | None = DEFAULTS["AbortedHeld"]
    held_for_read: float | None = DEFAULTS["HeldForRead"]
    quarantined: float | None = DEFAULTS["Quarantined"]
    source: str = "defaults"

    def deadlines(self) -> dict[str, float | None]:
        """Phase name -> deadline in seconds (None: no deadline)."""
        return {
            "Queued": self.queued,
            "Receiving": self.receiving,
            "AbortedHeld": self.aborted_held,
            "HeldForRead": self.held_for_read,
            "Quarantined": self.quarantined,
        }


def load_config(environ: Mapping[str, str] | None = None) -> Config | None:
    """The configuration the environment asks for, or None if the adapter is disabled.

    * ``STALLGUARD_VLLM_CONFIG=/path/file.toml``: that file (parsed and validated now);
    * ``STALLGUARD_VLLM=1``: the defaults;
    * ``STALLGUARD_VLLM=0``: disabled, even if a file is named;
    * neither: None (the connector then runs with the defaults: selecting it is the
      opt-in; see :func:`connector_config`).

    Raises:
        stallguard.ConfigError: naming the file (or variable), the key and the bad value.
    """
    env = os.environ if environ is None else environ
    path = env_enabled(env, enable_var=ENV_ENABLE, config_var=ENV_CONFIG)
    if path is None:
        return None
    if path == "":
        return Config(source=f"{ENV_ENABLE}={env.get(ENV_ENABLE)}")
    # any failure to read or interpret the file is a ConfigError naming it
    return read_config(path, var=ENV_CONFIG, parse=lambda data: parse_config(data, source=path))


def connector_config(environ: Mapping[str, str] | None = None, extra: object = None) -> Config:
    """The configuration a stallguard connector runs with: :func:`load_config`'s, the
    defaults when the environment names none, ``mode = "off"`` under ``STALLGUARD_VLLM=0``
    (whatever else is set); then the ``"stallguard"`` table of *extra* (vLLM's
    ``kv_connector_extra_config``), if it has one, key by key over the file's.

    The table is validated on its own first, by the file's rules (:func:`parse_config`),
    so its errors name ``kv_connector_extra_config["stallguard"]``, the key and the value.

    Raises:
        stallguard.ConfigError: as :func:`load_config`, or for a bad extra-config table.
    """
    env = os.environ if environ is None else environ
    config = load_config(env)
    if config is None:
        if ENV_ENABLE in env:  # an explicit 0: the kill switch
            return Config(mode="off", source=f"{ENV_ENABLE}={env[ENV_ENABLE]}")
        config = Config(source="defaults (connector selected, no STALLGUARD_VLLM_CONFIG)")
    if not isinstance(extra, Mapping) or EXTRA_CONFIG_KEY not in extra:
        return config
    return _with_extra(config, env, extra[EXTRA_CONFIG_KEY])


def _with_extra(config: Config, env: Mapping[str, str], section: Any) -> Config:
    """*config* with the extra-config table *section* key by key over its file's."""
    parse_config(section, source=EXTRA_SOURCE)  # its own errors, naming it
    path = env_enabled(env, enable_var=ENV_ENABLE, config_var=ENV_CONFIG)
    document = read_toml(path, var=ENV_CONFIG) if path else {}
    merged = parse_config(_merge(document, section), source=EXTRA_SOURCE)
    return replace(merged, source=f"{config.source} + {EXTRA_SOURCE}")


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """*over*'s keys over *base*'s, table by table (both already validated)."""
    out = dict(base)
    for key, value in over.items():
        below = out.get(key)
        if isinstance(value, Mapping) and isinstance(below, Mapping):
            out[key] = _merge(below, value)
        else:
            out[key] = value
    return out


def parse_config(data: object, *, source: str = "<dict>") -> Config:
    """Validate an already-parsed TOML document into a :class:`Config`.

    Raises:
        stallguard.ConfigError: ``"<source>: [<table>] <key> = <value>: <problem>"``.
    """
    top = TableReader(data, source=source, where="", allowed=_TOP_KEYS)
    mode: Any = top.choice("mode", ("enforce", "report", "off"), "enforce")
    decode = top.sub("decode", _DECODE_KEYS)
    prefill = top.sub("prefill", _PREFILL_KEYS)
    return Config(
        mode=mode,
        queued=decode.seconds("Queued", DEFAULTS["Queued"]),
        receiving=decode.seconds("Receiving", DEFAULTS["Receiving"]),
        aborted_held=decode.seconds("AbortedHeld", DEFAULTS["AbortedHeld"]),
        held_for_read=prefill.seconds("HeldForRead", DEFAULTS["HeldForRead"]),
        quarantined=decode.seconds("Quarantined", DEFAULTS["Quarantined"]),
        source=source,
    )


def config_or_raise(environ: Mapping[str, str] | None = None, extra: object = None) -> Config:
    """:func:`connector_config`, with the error message prefixed by the adapter's name
    (what a vLLM operator sees when the engine refuses to start).

    Raises:
        stallguard.ConfigError: for a bad configuration, and for any other exception while
            loading it (never a raw traceback, never a connector without its config).
    """
    try:
        return connector_config(environ, extra)
    except ConfigError as e:
        raise ConfigError(
            f"stallguard-vllm: invalid configuration, refusing to start: {e}"
        ) from None
    except Exception as e:  # not a documented error: still the one named error
        raise ConfigError(
            "stallguard-vllm: cannot load the configuration, refusing to start: "
            f"{describe_exception(e)}"
        ) from e
