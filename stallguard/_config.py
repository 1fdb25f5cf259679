"""Specs and watchdog options from TOML files, dicts and environment variables.

The schema is documented in docs/config.md. Every error is a :class:`ConfigError` whose
message names the file (or ``<dict>``, or ``environment``), the key and the bad value::

    config.toml: [spec.kv_sender.deadlines] Transferring = -1: must be a positive, finite
    number of seconds, or "none" for no deadline
"""

from __future__ import annotations

import difflib
import enum
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from ._details import Mode
from ._errors import ConfigError
from ._spec import Deadline, Spec, State, state_label
from ._watchdog import Watchdog

__all__ = [
    "WatchdogConfig",
    "load_config",
    "load_spec",
    "parse_config_table",
    "parse_deadlines",
]

_SPEC_KEYS = ("deadlines", "lifetime", "memory", "mode", "terminal", "unknown_state")
_DEADLINE_KEYS = ("seconds", "stall")
_DEFAULT_PREFIX = "STALLGUARD"
_ENVIRON: Any = object()  # "use os.environ", resolved at call time


@attrs.frozen
class WatchdogConfig:
    """A spec and the options of its watchdog, as loaded by :func:`load_config`.

    Attributes:
        spec: the :class:`~stallguard.Spec`.
        mode: ``"enforce"`` or ``"report"``.
        unknown_state: ``"raise"`` or ``"ignore"``.
        memory: how many concluded keys the watchdog remembers.
        source: where it was loaded from (a file path, ``"<dict>"``...), for messages.
    """

    spec: Spec
    mode: Mode = "enforce"
    unknown_state: str = "raise"
    memory: int = 65_536
    source: str = "<dict>"

    def watchdog(self, **kwargs: Any) -> Watchdog[Any]:
        """A new :class:`~stallguard.Watchdog` with this spec and these options;
        *kwargs* (``clock``, ``on_expire``, or an option to override) are passed on."""
        options: dict[str, Any] = {
            "mode": self.mode,
            "unknown_state": self.unknown_state,
            "memory": self.memory,
        }
        options.update(kwargs)
        return Watchdog(self.spec, **options)


# --------------------------------------------------------------------------- messages


def _show(value: object) -> str:
    """*value* as it would be written in TOML (Python's repr for what TOML lacks)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_key(k)} = {_show(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _key(key: object) -> str:
    text = str(key)
    return text if re.fullmatch(r"[A-Za-z0-9_-]+", text) else json.dumps(text)


def _error(source: str, table: str, key: object, value: object, problem: str) -> ConfigError:
    """``source: [table] key = value: problem``; a tuple *key* is a dotted key."""
    where = f"[{table}] " if table else ""
    name = ".".join(map(_key, key)) if isinstance(key, tuple) else _key(key)
    shown = value.text if isinstance(value, _Raw) else _show(value)
    return ConfigError(f"{source}: {where}{name} = {shown}: {problem}")


class _Raw:
    """A value shown as it was written (an environment variable's text)."""

    __slots__ = ("text", "value")

    def __init__(self, value: object, text: str) -> None:
        self.value = value
        self.text = text


def did_you_mean(word: object, allowed: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of *allowed* to *word*, or ``""``
    (shared with the adapters' config loaders)."""
    close = difflib.get_close_matches(str(word), list(allowed), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _unknown_key(source: str, table: str, key: object, value: object, allowed: tuple[str, ...]):
    last = key[-1] if isinstance(key, tuple) else key
    hint = did_you_mean(last, allowed)
    return _error(
        source, table, key, value, f"unknown key{hint}; allowed keys: {', '.join(allowed)}"
    )


# --------------------------------------------------------------------------- values

_SECONDS = 'must be a positive, finite number of seconds, or "none" for no deadline'


def _parse_seconds(source: str, table: str, key: object, given: object) -> float | None:
    value = given.value if isinstance(given, _Raw) else given
    if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _error(source, table, key, given, _SECONDS)
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise _error(source, table, key, given, _SECONDS)
    return seconds


def _parse_deadline(source: str, table: str, key: str, value: object) -> Deadline:
    if isinstance(value, Deadline):
        return value
    if isinstance(value, Mapping):
        for field in value:
            if field not in _DEADLINE_KEYS:
                raise _unknown_key(source, table, (key, field), value[field], _DEADLINE_KEYS)
        return Deadline(
            seconds=_parse_seconds(source, table, (key, "seconds"), value.get("seconds")),
            stall=_parse_seconds(source, table, (key, "stall"), value.get("stall")),
        )
    return Deadline(seconds=_parse_seconds(source, table, key, value))


def _to_state(
    source: str, table: str, key: object, label: object, states: type[enum.Enum] | None
) -> State:
    if isinstance(label, enum.Enum) and states is None:
        return label
    if not isinstance(label, str) or not label:
        raise _error(source, table, key, label, "a state must be a non-empty string")
    if states is None:
        return label
    try:
        return states[label]
    except KeyError:
        raise _error(
            source,
            table,
            key,
            label,
            f"not a member of {states.__name__} (members: {', '.join(states.__members__)})",
        ) from None


def parse_deadlines(
    table: Mapping[str, object],
    *,
    source: str = "<dict>",
    prefix: str = "deadlines",
    states: type[enum.Enum] | None = None,
) -> dict[State, Deadline]:
    """Validate a deadlines table: ``state = seconds | "none" | {seconds = ..., stall = ...}``.

    For integrations with their own config tables (e.g. an adapter's ``[prefill]`` table)
    that want the same rules and messages as :func:`load_config`.

    Args:
        table: the parsed table (from :mod:`tomllib`, or a dict). Python ``None`` and
            :class:`~stallguard.Deadline` values are accepted too.
        source: the file the table came from, for messages.
        prefix: the table's dotted name in that file, for messages (``"prefill.deadlines"``
            gives ``config.toml: [prefill.deadlines] Transferring = -1: ...``).
        states: an :class:`enum.Enum` whose members name the states; the keys then map
            to its members (by name) instead of staying strings.

    Returns:
        state -> :class:`~stallguard.Deadline`, in the table's order; pass it to
        :class:`~stallguard.Spec` as ``deadlines``.

    Raises:
        ConfigError: naming *source*, the key and the bad value.
    """
    if not isinstance(table, Mapping):
        raise ConfigError(
            f"{source}: {prefix} = {_show(table)}: must be a table of state = seconds"
        )
    out: dict[State, Deadline] = {}
    for label, value in table.items():
        state = _to_state(source, prefix, label, label, states)
        out[state] = _parse_deadline(source, prefix, str(label), value)
    return out


def _choice(source: str, table: str, key: str, value: object, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise _error(source, table, key, value, f"must be one of {', '.join(map(_show, allowed))}")
    return value  # type: ignore[return-value]


def _memory(source: str, table: str, key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _error(source, table, key, value, "must be a positive integer")
    return value


def parse_config_table(
    table: Mapping[str, object],
    *,
    name: str,
    source: str = "<dict>",
    prefix: str | None = None,
    states: type[enum.Enum] | None = None,
) -> WatchdogConfig:
    """Validate one spec table (the body of ``[spec.<name>]``: ``deadlines``,
    ``terminal``, ``lifetime``, ``mode``, ``unknown_state``, ``memory``).

    Args:
        table: the parsed table.
        name: the spec's name.
        source: the file, for messages.
        prefix: the table's dotted name, for messages (default ``spec.<name>``).
        states: see :func:`parse_deadlines`.

    Raises:
        ConfigError: naming *source*, the key and the bad value.
    """
    if prefix is None:
        prefix = f"spec.{_key(name)}"
    if not isinstance(table, Mapping):
        raise ConfigError(f"{source}: {prefix} = {_show(table)}: must be a table")
    for key, value in table.items():
        if key not in _SPEC_KEYS:
            raise _unknown_key(source, prefix, key, value, _SPEC_KEYS)
    if "deadlines" not in table:
        raise ConfigError(
            f"{source}: [{prefix}] has no deadlines table; add [{prefix}.deadlines] with "
            'one "state = seconds" line per non-terminal state'
        )
    deadlines = parse_deadlines(
        table["deadlines"],  # type: ignore[arg-type]
        source=source,
        prefix=f"{prefix}.deadlines",
        states=states,
    )
    raw_terminal = table.get("terminal", [])
    if isinstance(raw_terminal, str) or not isinstance(raw_terminal, (list, tuple)):
        raise _error(source, prefix, "terminal", raw_terminal, "must be an array of state names")
    terminal = [_to_state(source, prefix, "terminal", s, states) for s in raw_terminal]
    lifetime = _parse_seconds(source, prefix, "lifetime", table.get("lifetime"))
    mode = _choice(source, prefix, "mode", table.get("mode", "enforce"), ("enforce", "report"))
    unknown = _choice(
        source, prefix, "unknown_state", table.get("unknown_state", "raise"), ("raise", "ignore")
    )
    memory = _memory(source, prefix, "memory", table.get("memory", 65_536))
    try:
        spec = Spec(name=name, deadlines=deadlines, terminal=terminal, lifetime=lifetime)
    except ConfigError as exc:
        raise ConfigError(f"{source}: [{prefix}]: {exc}") from None
    return WatchdogConfig(
        spec=spec,
        mode=mode,  # type: ignore[arg-type]
        unknown_state=unknown,
        memory=memory,
        source=source,
    )


# --------------------------------------------------------------------------- environment


def _env_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]", "_", text).upper()


_ENV_FORMS = (
    "MODE",
    "LIFETIME",
    "UNKNOWN_STATE",
    "MEMORY",
    "DEADLINE_<STATE>",
    "STALL_<STATE>",
)


def _apply_env(
    config: WatchdogConfig, env: Mapping[str, str], env_prefix: str, others: tuple[str, ...]
) -> WatchdogConfig:
    spec = config.spec
    head = f"{_env_name(env_prefix)}_{_env_name(spec.name)}_"
    # names of other specs that extend this one's prefix (spec "kv" vs "kv_sender")
    longer = tuple(
        f"{_env_name(env_prefix)}_{_env_name(o)}_"
        for o in others
        if o != spec.name and f"{_env_name(env_prefix)}_{_env_name(o)}_".startswith(head)
    )
    ours = sorted(
        (var, value)
        for var, value in env.items()
        if var.startswith(head) and not any(var.startswith(p) for p in longer)
    )
    if not ours:
        return config
    deadlines = dict(spec.deadlines)
    by_env = {_env_name(state_label(s)): s for s in deadlines}
    terminal = {_env_name(state_label(s)) for s in spec.terminal}
    changes: dict[str, Any] = {}
    spec_changes: dict[str, Any] = {}
    src = "environment"
    for var, value in ours:
        rest = var[len(head) :]
        if rest == "MODE":
            changes["mode"] = _choice(src, "", var, value.strip(), ("enforce", "report"))
        elif rest == "UNKNOWN_STATE":
            changes["unknown_state"] = _choice(src, "", var, value.strip(), ("raise", "ignore"))
        elif rest == "MEMORY":
            try:
                number = int(value.strip())
            except ValueError:
                number = 0
            if number < 1:
                raise _error(src, "", var, value, "must be a positive integer")
            changes["memory"] = number
        elif rest == "LIFETIME":
            spec_changes["lifetime"] = _parse_seconds(src, "", var, _env_number(value))
        elif rest.startswith(("DEADLINE_", "STALL_")):
            field, _, state_name = rest.partition("_")
            state = by_env.get(state_name)
            if state is None:
                problem = (
                    f"{state_name} is a terminal state of spec {spec.name!r}; it has no deadline"
                    if state_name in terminal
                    else f"spec {spec.name!r} has no state {state_name}; "
                    f"its states here are {', '.join(sorted(by_env))}"
                )
                raise _error(src, "", var, value, problem)
            seconds = _parse_seconds(src, "", var, _env_number(value))
            current = deadlines[state]
            if field == "DEADLINE":
                deadlines[state] = Deadline(seconds=seconds, stall=current.stall)
            else:
                deadlines[state] = Deadline(seconds=current.seconds, stall=seconds)
        else:
            raise _error(
                src,
                "",
                var,
                value,
                f"unknown setting {rest}; the settings of spec {spec.name!r} are "
                + ", ".join(head + form for form in _ENV_FORMS),
            )
    if deadlines != dict(spec.deadlines):
        spec_changes["deadlines"] = deadlines
    if spec_changes:
        spec = spec.evolve(**spec_changes)  # each value was validated above
    return attrs.evolve(config, spec=spec, **changes)


def _env_number(value: str) -> _Raw:
    """An environment value as a number if it is one (else the text), shown as written."""
    text = value.strip()
    number: object
    try:
        number = int(text)
    except ValueError:
        try:
            number = float(text)
        except ValueError:
            number = value
    return _Raw(number, _show(value))


# --------------------------------------------------------------------------- loading


def _read(source: str | os.PathLike[str]) -> tuple[str, Mapping[str, Any]]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib

    label = os.fspath(source)
    try:
        with open(label, "rb") as f:
            return label, tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read the config file: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{label}: not valid TOML: {exc}") from None


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any],
    *,
    name: str | None = None,
    env: Mapping[str, str] | None = _ENVIRON,
    env_prefix: str = _DEFAULT_PREFIX,
    states: type[enum.Enum] | None = None,
) -> WatchdogConfig:
    """Load one spec and its watchdog options from a TOML file or a dict, then apply
    environment overrides.

    The file holds one table per spec, ``[spec.<name>]`` (schema: docs/config.md)::

        [spec.kv_sender]
        terminal = ["Success", "Failed"]
        mode = "report"
        [spec.kv_sender.deadlines]
        Bootstrapping = 300
        Transferring = { seconds = 120, stall = 30 }
        Queued = "none"

    Environment variables override it: ``STALLGUARD_KV_SENDER_DEADLINE_TRANSFERRING=60``,
    ``STALLGUARD_KV_SENDER_STALL_TRANSFERRING=none``, ``STALLGUARD_KV_SENDER_MODE=enforce``,
    ``..._LIFETIME``, ``..._UNKNOWN_STATE``, ``..._MEMORY`` (names upper-cased, other
    characters than letters and digits replaced by ``_``).

    Args:
        source: a TOML file path, or the parsed document as a mapping (``{"spec":
            {"kv_sender": {...}}}``).
        name: which spec to load; may be omitted when the file holds only one.
        env: the environment to read overrides from (default :data:`os.environ`;
            ``None``: no overrides).
        env_prefix: the variables' prefix.
        states: an :class:`enum.Enum` naming the states (see :func:`parse_deadlines`).

    Returns:
        The :class:`WatchdogConfig`; ``config.watchdog(clock=..., on_expire=...)`` builds
        the watchdog.

    Raises:
        ConfigError: naming the file, the key and the bad value.
    """
    if isinstance(source, Mapping):
        label, document = "<dict>", source
    elif isinstance(source, (str, os.PathLike)):
        label, document = _read(source)
    else:
        raise ConfigError(
            f"source must be a TOML file path or a mapping, got {source!r} "
            f"({type(source).__name__})"
        )
    if env is _ENVIRON:
        env = os.environ
    specs = document.get("spec")
    if not isinstance(specs, Mapping) or not specs:
        found = ", ".join(map(_key, document)) or "nothing"
        raise ConfigError(
            f"{label}: no [spec.<name>] table (found: {found}); declare each spec as "
            "[spec.<name>] with a [spec.<name>.deadlines] table"
        )
    for spec_name, table in specs.items():
        if not isinstance(table, Mapping):
            raise _error(label, "spec", spec_name, table, "must be a table: [spec.<name>]")
    if name is None:
        if len(specs) > 1:
            raise ConfigError(
                f"{label}: holds several specs ({', '.join(map(_key, specs))}); "
                "pass name=... to choose one"
            )
        name = next(iter(specs))
    elif name not in specs:
        raise ConfigError(
            f"{label}: has no [spec.{_key(name)}] table; its specs: {', '.join(map(_key, specs))}"
        )
    config = parse_config_table(specs[name], name=name, source=label, states=states)
    if env is not None:
        config = _apply_env(config, env, env_prefix, tuple(specs))
    return config


def load_spec(
    source: str | os.PathLike[str] | Mapping[str, Any],
    *,
    name: str | None = None,
    env: Mapping[str, str] | None = _ENVIRON,
    env_prefix: str = _DEFAULT_PREFIX,
    states: type[enum.Enum] | None = None,
) -> Spec:
    """Like :func:`load_config`, but only the :class:`~stallguard.Spec`."""
    return load_config(source, name=name, env=env, env_prefix=env_prefix, states=states).spec
