"""The adapter's configuration: environment variables and the TOML file.

Written for the adapter alone (small and strict): every error names the file, the
dotted key and the bad value, and says what would be accepted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from stallguard import ConfigError, Deadline, parse_deadlines
from stallguard._adapters import env_enabled, read_config
from stallguard._config import _key, _show
from stallguard._validate import TOO_LARGE, did_you_mean, seconds_or_problem

from ._kvpoll import LIVE_STATES, TERMINAL_STATES

__all__ = [
    "BACKENDS",
    "BootstrapQueueConfig",
    "Config",
    "DECODE_PHASES",
    "DecodeConfig",
    "ENV_CONFIG",
    "ENV_ENABLE",
    "LIVE_STATES",
    "PrefillConfig",
    "load_config",
    "parse_config",
]

#: Names a TOML file: enables the adapter with that configuration.
ENV_CONFIG = "STALLGUARD_SGLANG_CONFIG"
#: ``1`` enables the adapter with the defaults; ``0`` disables it even when
#: :data:`ENV_CONFIG` is set (a kill switch for operators).
ENV_ENABLE = "STALLGUARD_SGLANG"

#: The non-terminal phases of a decode request that take a deadline, per decode queue
#: (``DecodePreallocQueue``, ``DecodeTransferQueue``); see docs/sglang.md.
DECODE_PHASES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "prealloc": ("Bootstrapping", "WaitingForPrefill", "WaitingForInput"),
        "transfer": ("WaitingForInput", "Transferring"),
    }
)
#: Seconds a quarantined decode hold may last before it is escalated (``[decode]
#: quarantine``): twice SGLang's own deferred-release timeout (30 s), so that a hold
#: SGLang would have ended on its own ("releasing anyway") is escalated soon after.
DEFAULT_QUARANTINE = 60.0

#: Transfer backends with a profile (``--disaggregation-transfer-backend``; ``fake`` is
#: also what warmup and health-check requests use on every backend).
BACKENDS = ("nixl", "mooncake", "ascend", "mori", "fake")


PrefillMode = Literal["enforce", "report", "off"]
BootstrapMode = Literal["auto", "enforce", "report", "off"]


def _frozen(mapping: Mapping[Any, Any]) -> Mapping[Any, Any]:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class PrefillConfig:
    """The ``[prefill]`` table: deadlines for requests in the prefill inflight queue
    (``disagg_prefill_inflight_queue``), counted from when the request entered it.

    Attributes:
        mode: ``"enforce"`` fails overdue requests through SGLang's own failure path;
            ``"report"`` only logs, traces and counts them; ``"off"`` installs nothing.
        deadlines: the deadlines the file sets, by ``KVPoll`` state name. A state the
            file does not set gets a default derived from SGLang's own settings (see
            :func:`stallguard_sglang.effective_deadlines`).
        backends: per-backend overrides (``[prefill.backends.<name>.deadlines]``).
    """

    mode: PrefillMode = "enforce"
    deadlines: Mapping[str, Deadline] = field(default_factory=lambda: _frozen({}))
    backends: Mapping[str, Mapping[str, Deadline]] = field(default_factory=lambda: _frozen({}))


@dataclass(frozen=True)
class BootstrapQueueConfig:
    """The ``[bootstrap_queue]`` table: a ``Bootstrapping`` deadline for requests waiting
    in SGLang's prefill bootstrap queue (``PrefillBootstrapQueue``), counted from when
    the request entered it.

    Attributes:
        mode: ``"auto"`` (default) guards only the backends SGLang leaves unbounded there
            (NIXL on SGLang <= 0.5.17); ``"enforce"`` / ``"report"`` guard every backend;
            ``"off"`` installs nothing.
        deadline: seconds, or None for the default:
            ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` (300 unless set), the deadline
            SGLang applies itself on the other backends.
    """

    mode: BootstrapMode = "auto"
    deadline: float | None = None


@dataclass(frozen=True)
class DecodeConfig:
    """The ``[decode]`` table: deadlines for requests in SGLang's decode queues, per
    phase, counted from when the request entered the queue (or the phase, for a later
    phase).

    Attributes:
        mode: ``"enforce"`` fails overdue requests through SGLang's own failure path;
            ``"report"`` only logs, traces and counts them; ``"off"`` installs nothing.
        prealloc: ``[decode.prealloc]``: deadlines in ``DecodePreallocQueue`` by phase
            (``Bootstrapping``, ``WaitingForPrefill``, ``WaitingForInput``).
        transfer: ``[decode.transfer]``: deadlines in ``DecodeTransferQueue`` by phase
            (``WaitingForInput``, ``Transferring``). A phase the file does not set
            gets a default derived from SGLang's own settings (see
            :func:`stallguard_sglang.decode_deadlines`).
        quarantine: seconds the pages of a request stallguard failed in the transfer
            queue may stay quarantined (held until the prefill proves its writes into
            them over) before the hold is escalated: logged at ERROR, reported, shown
            on the quarantine metrics. Never freed on this timer (docs/sglang.md).
    """

    mode: PrefillMode = "enforce"
    prealloc: Mapping[str, Deadline] = field(default_factory=lambda: _frozen({}))
    transfer: Mapping[str, Deadline] = field(default_factory=lambda: _frozen({}))
    quarantine: float = DEFAULT_QUARANTINE


@dataclass(frozen=True)
class Config:
    """The whole configuration (see docs/sglang.md for the file format).

    Attributes:
        prefill: the ``[prefill]`` table.
        bootstrap_queue: the ``[bootstrap_queue]`` table.
        decode: the ``[decode]`` table.
        source: where it came from: the file's path, or ``"STALLGUARD_SGLANG=1"``.
    """

    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    bootstrap_queue: BootstrapQueueConfig = field(default_factory=BootstrapQueueConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    source: str = "defaults"


# --------------------------------------------------------------------------- environment


def load_config(environ: Mapping[str, str] | None = None) -> Config | None:
    """The configuration the environment asks for, or None if the adapter is disabled.

    * ``STALLGUARD_SGLANG_CONFIG=/path/file.toml``: that file (parsed and validated now);
    * ``STALLGUARD_SGLANG=1``: the defaults;
    * ``STALLGUARD_SGLANG=0``: disabled, even if a file is named;
    * neither: disabled.

    Raises:
        stallguard.ConfigError: naming the file (or variable), the key and the bad value.
    """
    env = os.environ if environ is None else environ
    # the enable/config variables are read the same way for every adapter (core helper)
    path = env_enabled(env, enable_var=ENV_ENABLE, config_var=ENV_CONFIG)
    if path is None:
        return None
    if path:
        # any failure to read or interpret the file is a ConfigError naming it
        return read_config(path, var=ENV_CONFIG, parse=lambda data: parse_config(data, source=path))
    return Config(source=f"{ENV_ENABLE}={env[ENV_ENABLE]}")


# --------------------------------------------------------------------------- parsing


def parse_config(data: Mapping[str, Any], *, source: str = "<config>") -> Config:
    """Validate an already-parsed TOML document (a dict) into a :class:`Config`.

    Raises:
        stallguard.ConfigError: ``"<source>: [<table>] <key> = <value>: <what is wrong>"``.
    """
    _only(data, ("prefill", "bootstrap_queue", "decode"), "", source)
    prefill = _table(data, "prefill", source)
    boot = _table(data, "bootstrap_queue", source)
    decode = _table(data, "decode", source)
    return Config(
        prefill=_prefill(prefill, source),
        bootstrap_queue=_bootstrap(boot, source),
        decode=_decode(decode, source),
        source=source,
    )


def _fmt(value: Any) -> str:
    """A TOML-looking rendering of *value* for messages (bounded: a value nested
    thousands deep or an integer of 5,000 digits is shown by its start and its size)."""
    return _show(value, spaced=True)


def _error(source: str, table: str, key: str, value: Any, problem: str) -> ConfigError:
    """The same message shape as stallguard's own config loader:
    ``file.toml: [table] key = value: problem``."""
    where = f"[{table}] " if table else ""
    return ConfigError(f"{source}: {where}{_key(key)} = {_fmt(value)}: {problem}")


def _only(table: Mapping[str, Any], allowed: tuple[str, ...], where: str, source: str) -> None:
    for key, value in table.items():
        if key not in allowed:
            hint = did_you_mean(key, allowed)
            raise _error(
                source, where, key, value, f"unknown key{hint}; allowed keys: {', '.join(allowed)}"
            )


def _table(parent: Mapping[str, Any], key: str, source: str, where: str = "") -> Mapping[str, Any]:
    value = parent.get(key, {})
    if not isinstance(value, Mapping):
        dotted = f"{where}.{key}" if where else key
        raise _error(source, where, key, value, f"must be a table ([{dotted}])")
    return value


def _mode(table: Mapping[str, Any], where: str, allowed: tuple[str, ...], source: str) -> Any:
    value = table.get("mode", allowed[0])
    if value not in allowed:
        hint = did_you_mean(value, allowed) if isinstance(value, str) else ""
        raise _error(
            source, where, "mode", value, f"must be one of {', '.join(map(_fmt, allowed))}{hint}"
        )
    return value


def _deadlines(table: Mapping[str, Any], where: str, source: str) -> Mapping[str, Deadline]:
    """``state = seconds | "none" | { seconds = ..., stall = ... }``, keyed by the
    non-terminal KVPoll state names; values are validated by stallguard's own
    :func:`stallguard.parse_deadlines` (same rules and messages as the core's files)."""
    for state, value in table.items():
        if state not in LIVE_STATES:
            hint = (
                f"{state} is terminal and takes no deadline"
                if state in TERMINAL_STATES
                else "not a KVPoll state that takes a deadline" + did_you_mean(state, LIVE_STATES)
            )
            raise _error(
                source,
                where,
                state,
                value,
                f"{hint}; deadlines are keyed by {', '.join(LIVE_STATES)}",
            )
    parsed = parse_deadlines(table, source=source, prefix=where)
    return _frozen({str(state): deadline for state, deadline in parsed.items()})


def _prefill(table: Mapping[str, Any], source: str) -> PrefillConfig:
    _only(table, ("mode", "deadlines", "backends"), "prefill", source)
    mode = _mode(table, "prefill", ("enforce", "report", "off"), source)
    deadlines = _deadlines(
        _table(table, "deadlines", source, "prefill"), "prefill.deadlines", source
    )
    backends_table = _table(table, "backends", source, "prefill")
    backends: dict[str, Mapping[str, Deadline]] = {}
    for name, sub in backends_table.items():
        where = f"prefill.backends.{name}"
        if name not in BACKENDS:
            raise _error(
                source,
                "prefill.backends",
                name,
                sub,
                f"unknown transfer backend{did_you_mean(name, BACKENDS)}; known: "
                + ", ".join(BACKENDS),
            )
        if not isinstance(sub, Mapping):
            raise _error(
                source, "prefill.backends", name, sub, f"must be a table ([{where}.deadlines])"
            )
        _only(sub, ("deadlines",), where, source)
        backends[name] = _deadlines(
            _table(sub, "deadlines", source, where), f"{where}.deadlines", source
        )
    return PrefillConfig(mode=mode, deadlines=deadlines, backends=_frozen(backends))


def _bootstrap(table: Mapping[str, Any], source: str) -> BootstrapQueueConfig:
    _only(table, ("mode", "deadline"), "bootstrap_queue", source)
    mode = _mode(table, "bootstrap_queue", ("auto", "enforce", "report", "off"), source)
    deadline = None
    if "deadline" in table:
        value = table["deadline"]
        seconds = seconds_or_problem(value)  # the one rule (stallguard._validate)
        if isinstance(seconds, str):
            too_large = " (this one is too large for a float)" if seconds == TOO_LARGE else ""
            raise _error(
                source,
                "bootstrap_queue",
                "deadline",
                value,
                f"must be a positive, finite number of seconds{too_large}; use "
                'mode = "off" for no deadline',
            )
        deadline = seconds
    return BootstrapQueueConfig(mode=mode, deadline=deadline)


def _decode(table: Mapping[str, Any], source: str) -> DecodeConfig:
    _only(table, ("mode", "quarantine", *DECODE_PHASES), "decode", source)
    mode = _mode(table, "decode", ("enforce", "report", "off"), source)
    quarantine = DEFAULT_QUARANTINE
    if "quarantine" in table:
        value = table["quarantine"]
        seconds = seconds_or_problem(value)  # the one rule (stallguard._validate)
        if isinstance(seconds, str):
            too_large = " (this one is too large for a float)" if seconds == TOO_LARGE else ""
            raise _error(
                source,
                "decode",
                "quarantine",
                value,
                f"must be a positive, finite number of seconds{too_large} (how long a "
                "failed request's pages may stay quarantined before the hold is "
                "escalated; they are never freed on this timer)",
            )
        quarantine = seconds
    queues: dict[str, Mapping[str, Deadline]] = {}
    for queue, phases in DECODE_PHASES.items():
        where = f"decode.{queue}"
        sub = _table(table, queue, source, "decode")
        for phase, value in sub.items():
            if phase in phases:
                continue
            if phase in TERMINAL_STATES:
                hint = f"{phase} is terminal and takes no deadline"
            else:
                hint = f"not a phase of the decode {queue} queue{did_you_mean(phase, phases)}"
            raise _error(source, where, phase, value, f"{hint}; phases: {', '.join(phases)}")
        parsed = parse_deadlines(sub, source=source, prefix=where)
        queues[queue] = _frozen({str(phase): deadline for phase, deadline in parsed.items()})
    return DecodeConfig(
        mode=mode,
        prealloc=queues["prealloc"],
        transfer=queues["transfer"],
        quarantine=quarantine,
    )
