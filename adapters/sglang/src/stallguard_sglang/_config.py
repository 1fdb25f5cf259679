"""The adapter's configuration: environment variables and the TOML file.

Written for the adapter alone (small and strict): every error names the file, the
dotted key and the bad value, and says what would be accepted.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

from stallguard import Deadline
from stallguard.adapters import EnvReader, TableReader, env_enabled, read_config

from ._kvpoll import LIVE_STATES, TERMINAL_STATES

__all__ = [
    "BACKENDS",
    "BootstrapQueueConfig",
    "Config",
    "DECODE_PHASES",
    "DecodeConfig",
    "ENV_CONFIG",
    "ENV_ENABLE",
    "ENV_MODE",
    "ENV_PREFIX",
    "LIVE_STATES",
    "apply_environment",
    "PrefillConfig",
    "load_config",
    "parse_config",
]

#: Names a TOML file: enables the adapter with that configuration.
ENV_CONFIG = "STALLGUARD_SGLANG_CONFIG"
#: ``1`` enables the adapter with the defaults; ``0`` disables it even when
#: :data:`ENV_CONFIG` is set (a kill switch for operators).
ENV_ENABLE = "STALLGUARD_SGLANG"
#: Per-key overrides of the configuration are the variables under this prefix
#: (``STALLGUARD_SGLANG_PREFILL_DEADLINE_TRANSFERRING=60``; docs/sglang.md lists them).
ENV_PREFIX = "STALLGUARD_SGLANG_"
#: ``report`` makes every guard that would enforce report instead (``enforce``: the
#: other way round); a table's own ``..._MODE`` variable wins over it; tables that are
#: ``off`` stay off. The switch for a canary.
ENV_MODE = "STALLGUARD_SGLANG_MODE"
#: Variables under :data:`ENV_PREFIX` that are not overrides.
_ENV_OTHERS = (ENV_CONFIG, "STALLGUARD_SGLANG_ACTIVATION")

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
    #: what ``mode = "auto"`` does on the backends it guards: ``"enforce"``, or
    #: ``"report"`` under ``STALLGUARD_SGLANG_MODE=report`` (:data:`ENV_MODE`)
    auto_mode: Literal["enforce", "report"] = "enforce"


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

    Enabled, the ``STALLGUARD_SGLANG_*`` overrides then apply (:func:`apply_environment`).

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
        config = read_config(
            path, var=ENV_CONFIG, parse=lambda data: parse_config(data, source=path)
        )
    else:
        config = Config(source=f"{ENV_ENABLE}={env[ENV_ENABLE]}")
    return apply_environment(config, env)


# --------------------------------------------------------------------------- parsing

_MODES = ("enforce", "report", "off")
_BOOTSTRAP_MODES = ("auto", "enforce", "report", "off")


def parse_config(data: Mapping[str, Any], *, source: str = "<config>") -> Config:
    """Validate an already-parsed TOML document (a dict) into a :class:`Config`.

    Raises:
        stallguard.ConfigError: ``"<source>: [<table>] <key> = <value>: <what is wrong>"``.
    """
    top = TableReader(
        data, source=source, where="", allowed=("prefill", "bootstrap_queue", "decode")
    )
    return Config(
        prefill=_prefill(top.sub("prefill", ("mode", "deadlines", "backends"))),
        bootstrap_queue=_bootstrap(top.sub("bootstrap_queue", ("mode", "deadline"))),
        decode=_decode(top.sub("decode", ("mode", "quarantine", *DECODE_PHASES))),
        source=source,
    )


def _states(table: TableReader, key: str) -> Mapping[str, Deadline]:
    """``state = seconds | "none" | { seconds = ..., stall = ... }``, keyed by the
    non-terminal KVPoll state names (stallguard's own deadline rules and messages)."""
    return table.deadlines(
        key,
        LIVE_STATES,
        terminal=TERMINAL_STATES,
        unknown="not a KVPoll state that takes a deadline",
        listing="deadlines are keyed by",
    )


def _prefill(table: TableReader) -> PrefillConfig:
    mode: Any = table.choice("mode", _MODES, "enforce")
    backends_table = table.sub("backends", BACKENDS, what="transfer backend")
    backends = {
        name: _states(backends_table.sub(name, ("deadlines",)), "deadlines")
        for name in backends_table.table
    }
    return PrefillConfig(
        mode=mode, deadlines=_states(table, "deadlines"), backends=_frozen(backends)
    )


def _bootstrap(table: TableReader) -> BootstrapQueueConfig:
    mode: Any = table.choice("mode", _BOOTSTRAP_MODES, "auto")
    deadline = table.seconds(
        "deadline", None, none=False, advice='use mode = "off" for no deadline'
    )
    return BootstrapQueueConfig(mode=mode, deadline=deadline)


_QUARANTINE_ADVICE = (
    "how long a failed request's pages may stay quarantined before the hold is "
    "escalated; they are never freed on this timer"
)


def _decode(table: TableReader) -> DecodeConfig:
    mode: Any = table.choice("mode", _MODES, "enforce")
    quarantine = table.seconds(
        "quarantine", DEFAULT_QUARANTINE, none=False, advice=_QUARANTINE_ADVICE
    )
    queues = {
        queue: table.deadlines(
            queue,
            phases,
            terminal=TERMINAL_STATES,
            unknown=f"not a phase of the decode {queue} queue",
            listing="phases:",
        )
        for queue, phases in DECODE_PHASES.items()
    }
    return DecodeConfig(
        mode=mode,
        prealloc=queues["prealloc"],
        transfer=queues["transfer"],
        quarantine=DEFAULT_QUARANTINE if quarantine is None else quarantine,
    )


# --------------------------------------------------------------------------- environment


def _env_name(text: str) -> str:
    """A name as it appears in a variable: ``WaitingForInput`` -> ``WAITINGFORINPUT``
    (the core's rule for its own ``STALLGUARD_<SPEC>_DEADLINE_<STATE>`` variables)."""
    return re.sub(r"[^A-Za-z0-9]", "_", text).upper()


def _deadline_vars(head: str, states: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """``<head>DEADLINE_<STATE>`` / ``<head>STALL_<STATE>`` -> (field, state)."""
    return {
        f"{head}{word}_{_env_name(state)}": (field, state)
        for state in states
        for field, word in (("seconds", "DEADLINE"), ("stall", "STALL"))
    }


def _env_tables() -> dict[str, tuple[str, ...]]:
    """Variable-name head -> the states its deadline variables take."""
    p = ENV_PREFIX
    heads = {f"{p}PREFILL_": LIVE_STATES}
    heads.update({f"{p}PREFILL_{_env_name(b)}_": LIVE_STATES for b in BACKENDS})
    heads.update({f"{p}DECODE_{_env_name(q)}_": ph for q, ph in DECODE_PHASES.items()})
    return heads


def _known_vars() -> tuple[str, ...]:
    p = ENV_PREFIX
    names = [ENV_MODE, f"{p}PREFILL_MODE", f"{p}BOOTSTRAP_QUEUE_MODE"]
    names += [f"{p}BOOTSTRAP_QUEUE_DEADLINE", f"{p}DECODE_MODE", f"{p}DECODE_QUARANTINE"]
    for head, states in _env_tables().items():
        names += _deadline_vars(head, states)
    return tuple(names)


_ENV_FORMS = (
    "STALLGUARD_SGLANG_MODE, STALLGUARD_SGLANG_{PREFILL,DECODE,BOOTSTRAP_QUEUE}_MODE, "
    "STALLGUARD_SGLANG_PREFILL[_<BACKEND>]_{DEADLINE,STALL}_<STATE>, "
    "STALLGUARD_SGLANG_DECODE_{PREALLOC,TRANSFER}_{DEADLINE,STALL}_<PHASE>, "
    "STALLGUARD_SGLANG_BOOTSTRAP_QUEUE_DEADLINE, STALLGUARD_SGLANG_DECODE_QUARANTINE "
    "(docs/sglang.md)"
)


def _env_deadlines(
    env: EnvReader, head: str, states: tuple[str, ...], current: Mapping[str, Deadline]
) -> Mapping[str, Deadline]:
    """*current* with the ``<head>DEADLINE_/STALL_<STATE>`` variables applied: a
    deadline variable sets the state deadline (keeping the stall window), a stall one
    the window (keeping the deadline, which must be set)."""
    out = dict(current)
    for var, (field_name, state) in _deadline_vars(head, states).items():
        if var in env:
            out[state] = _env_deadline(env, var, head, field_name, state, out.get(state))
    return _frozen(out) if out != dict(current) else current


def _env_deadline(
    env: EnvReader, var: str, head: str, field_name: str, state: str, before: Deadline | None
) -> Deadline:
    """*state*'s deadline (*before*: as set so far) with variable *var* applied: a
    deadline variable (*field_name* ``"seconds"``) keeps the stall window, a stall one
    keeps the deadline, which must be set."""
    seconds = env.seconds(var)
    if field_name == "seconds":
        return Deadline(seconds=seconds, stall=before.stall if before else None)
    if before is None:
        raise env.error(
            var,
            env.values[var],
            f"{state} has no deadline set in the file; set "
            f"{head}DEADLINE_{_env_name(state)} too (a stall window keeps the deadline "
            "it is given)",
        )
    return Deadline(seconds=before.seconds, stall=seconds)


def apply_environment(config: Config, environ: Mapping[str, str] | None = None) -> Config:
    """*config* with the ``STALLGUARD_SGLANG_*`` per-key overrides applied (docs/sglang.md):
    ``..._PREFILL_MODE``, ``..._PREFILL_DEADLINE_TRANSFERRING=60``,
    ``..._PREFILL_NIXL_STALL_TRANSFERRING=10``, ``..._DECODE_TRANSFER_DEADLINE_WAITINGFORINPUT``,
    ``..._BOOTSTRAP_QUEUE_DEADLINE``, ``..._DECODE_QUARANTINE``, and the
    :data:`ENV_MODE` switch. Each value is read by the file's rules.

    Raises:
        stallguard.ConfigError: ``environment: VAR = "value": <what is wrong>``, for a
            bad value or a variable under the prefix that is not one of these (a
            misspelt override is refused, never ignored).
    """
    env = EnvReader(
        os.environ if environ is None else environ,
        ENV_PREFIX,
        known=_known_vars(),
        ignore=_ENV_OTHERS,
        forms=_ENV_FORMS,
    )
    if not env.values:
        return config
    prefill = _env_prefill(env, config.prefill)
    boot = _env_bootstrap_queue(env, config.bootstrap_queue)
    decode = _env_decode(env, config.decode)
    if ENV_MODE in env:
        prefill, boot, decode = _switch(
            env, env.choice(ENV_MODE, ("enforce", "report")), prefill, boot, decode
        )
    return Config(
        prefill=prefill,
        bootstrap_queue=boot,
        decode=decode,
        source=f"{config.source} + environment ({', '.join(env)})",
    )


def _env_prefill(env: EnvReader, prefill: PrefillConfig) -> PrefillConfig:
    """*prefill* with the ``..._PREFILL_*`` overrides applied."""
    p = ENV_PREFIX
    if f"{p}PREFILL_MODE" in env:
        prefill = replace(prefill, mode=env.choice(f"{p}PREFILL_MODE", _MODES))  # type: ignore[arg-type]
    backends = dict(prefill.backends)
    for b in BACKENDS:
        found = _env_deadlines(env, f"{p}PREFILL_{_env_name(b)}_", LIVE_STATES, backends.get(b, {}))
        if found:
            backends[b] = found
    return replace(
        prefill,
        deadlines=_env_deadlines(env, f"{p}PREFILL_", LIVE_STATES, prefill.deadlines),
        backends=_frozen(backends),
    )


def _env_bootstrap_queue(env: EnvReader, boot: BootstrapQueueConfig) -> BootstrapQueueConfig:
    """*boot* with the ``..._BOOTSTRAP_QUEUE_*`` overrides applied."""
    p = ENV_PREFIX
    if f"{p}BOOTSTRAP_QUEUE_MODE" in env:
        boot = replace(boot, mode=env.choice(f"{p}BOOTSTRAP_QUEUE_MODE", _BOOTSTRAP_MODES))  # type: ignore[arg-type]
    if f"{p}BOOTSTRAP_QUEUE_DEADLINE" in env:
        advice = f"set {p}BOOTSTRAP_QUEUE_MODE=off for no deadline"
        deadline = env.seconds(f"{p}BOOTSTRAP_QUEUE_DEADLINE", none=False, advice=advice)
        boot = replace(boot, deadline=deadline)
    return boot


def _env_decode(env: EnvReader, decode: DecodeConfig) -> DecodeConfig:
    """*decode* with the ``..._DECODE_*`` overrides applied."""
    p = ENV_PREFIX
    if f"{p}DECODE_MODE" in env:
        decode = replace(decode, mode=env.choice(f"{p}DECODE_MODE", _MODES))  # type: ignore[arg-type]
    if f"{p}DECODE_QUARANTINE" in env:
        seconds = env.seconds(f"{p}DECODE_QUARANTINE", none=False, advice=_QUARANTINE_ADVICE)
        decode = replace(decode, quarantine=decode.quarantine if seconds is None else seconds)
    return replace(
        decode,
        prealloc=_env_deadlines(
            env, f"{p}DECODE_PREALLOC_", DECODE_PHASES["prealloc"], decode.prealloc
        ),
        transfer=_env_deadlines(
            env, f"{p}DECODE_TRANSFER_", DECODE_PHASES["transfer"], decode.transfer
        ),
    )


def _switch(
    env: EnvReader,
    mode: Any,
    prefill: PrefillConfig,
    boot: BootstrapQueueConfig,
    decode: DecodeConfig,
) -> tuple[PrefillConfig, BootstrapQueueConfig, DecodeConfig]:
    """:data:`ENV_MODE`: every table that guards (not ``off``) and whose own mode
    variable is unset enforces or reports, as *mode* says."""
    p = ENV_PREFIX
    if prefill.mode != "off" and f"{p}PREFILL_MODE" not in env:
        prefill = replace(prefill, mode=mode)
    if decode.mode != "off" and f"{p}DECODE_MODE" not in env:
        decode = replace(decode, mode=mode)
    if f"{p}BOOTSTRAP_QUEUE_MODE" not in env:
        boot = _switch_bootstrap_queue(boot, mode)
    return prefill, boot, decode


def _switch_bootstrap_queue(boot: BootstrapQueueConfig, mode: Any) -> BootstrapQueueConfig:
    """:data:`ENV_MODE` on the bootstrap queue: ``auto`` enforces or reports when it
    guards, ``off`` stays off."""
    if boot.mode == "auto":
        return replace(boot, auto_mode=mode)
    if boot.mode != "off":
        return replace(boot, mode=mode)
    return boot
