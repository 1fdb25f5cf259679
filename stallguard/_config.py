"""Specs and watchdog options from TOML files, dicts and environment variables.

The schema is documented in docs/config.md. Every error is a :class:`ConfigError` whose
message names the file (or ``<dict>``, or ``environment``), the key and the bad value::

    config.toml: [spec.kv_sender.deadlines] Transferring = -1: must be a positive, finite
    number of seconds, or "none" for no deadline
"""

from __future__ import annotations

import datetime
import enum
import itertools
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from ._details import Mode
from ._errors import ConfigError
from ._options import WatchdogOptions
from ._spec import Deadline, Spec, State, state_label
from ._validate import (
    DEFAULT_MEMORY,
    SHOW_LIMIT,
    TOO_LARGE,
    did_you_mean,
    digits,
    is_count,
    is_text,
    says_none,
    seconds_or_problem,
    shorten,
)
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

    The options are validated, and defaulted, by :class:`~stallguard.WatchdogOptions`
    (:attr:`options`), the one owner of watchdog settings.
    """

    spec: Spec
    mode: Mode = "enforce"
    unknown_state: str = "raise"
    memory: int = DEFAULT_MEMORY
    source: str = "<dict>"

    def __attrs_post_init__(self) -> None:
        self.options  # noqa: B018 - validates mode, unknown_state and memory

    @property
    def options(self) -> WatchdogOptions:
        """These options as a :class:`~stallguard.WatchdogOptions` (default clock)."""
        return WatchdogOptions(mode=self.mode, unknown_state=self.unknown_state, memory=self.memory)

    def watchdog(self, **kwargs: Any) -> Watchdog[Any]:
        """A new :class:`~stallguard.Watchdog` with this spec and these options;
        *kwargs* (``on_expire``, or an option to override, e.g. ``clock``) are passed
        on."""
        return Watchdog(self.spec, options=self.options, **kwargs)


# --------------------------------------------------------------------------- messages


#: How deep, and how many items per level, a value is rendered in a message.
_SHOW_DEPTH = 3
_SHOW_ITEMS = 8
#: an integer with more digits than this is shown by its first digits and its size; a
#: longer string by its first characters and its length
_SHOW_DIGITS = 40
_SHOW_CHARS = 60


def _show(value: object, *, spaced: bool = False) -> str:
    """*value* as it would be written in TOML (Python's repr for what TOML lacks), for a
    message: bounded whatever the value (nested thousands deep, 5,000 digits, a long
    string): a few levels and items, a few lines' worth of characters at most.
    *spaced* writes inline tables as ``{ k = v }`` (stallguard-sglang's messages)."""
    return shorten(_render(value, _SHOW_DEPTH, spaced), 2 * SHOW_LIMIT)


def _render(value: object, depth: int, spaced: bool) -> str:
    for types, render in _SCALARS:
        if isinstance(value, types):
            return render(value)
    if isinstance(value, (list, tuple)):
        return _render_list(value, depth, spaced)
    if isinstance(value, Mapping):
        return _render_table(value, depth, spaced)
    if isinstance(value, (datetime.date, datetime.time)):  # TOML dates and times
        return value.isoformat()
    return _render_other(value)


def _render_bool(value: bool) -> str:
    return "true" if value else "false"


def _render_other(value: object) -> str:
    """Python's repr, shortened, for what TOML cannot hold."""
    try:
        return shorten(repr(value))
    except Exception:  # a repr that fails, or recurses too deeply
        return f"<{type(value).__name__} object>"


def _render_str(value: str) -> str:
    if len(value) > _SHOW_CHARS:
        head = json.dumps(value[:_SHOW_CHARS], ensure_ascii=False)[:-1]
        return f'{head}..." ({len(value)} characters)'
    return json.dumps(value, ensure_ascii=False)


def _render_float(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)


def _render_int(value: int) -> str:
    count = digits(value)
    if count <= _SHOW_DIGITS:
        return repr(value)
    head = value // 10 ** (count - 20) if value > 0 else -(-value // 10 ** (count - 20))
    return f"{head}... ({count} digits)"


def _render_list(value: list[Any] | tuple[Any, ...], depth: int, spaced: bool) -> str:
    if depth <= 0:
        return "[...]" if value else "[]"
    items = (_render(v, depth - 1, spaced) for v in value)
    return "[" + _first_few(items, len(value), "items") + "]"


def _first_few(shown: Iterable[str], total: int, unit: str) -> str:
    """The first :data:`_SHOW_ITEMS` of *shown* (the rendered items or keys of a
    collection of *total*), comma-separated, then ``... (total unit)`` if there are
    more."""
    first = list(itertools.islice(shown, _SHOW_ITEMS))
    more = [f"... ({total} {unit})"] if total > _SHOW_ITEMS else []
    return ", ".join([*first, *more])


#: how scalars are written, in the order they are tried (a bool is an int too)
_SCALARS: tuple[tuple[type, Callable[[Any], str]], ...] = (
    (bool, _render_bool),
    (str, _render_str),
    (float, _render_float),
    (int, _render_int),
)


def _render_table(value: Mapping[Any, Any], depth: int, spaced: bool) -> str:
    if not value:
        return "{}"
    if depth <= 0:
        return "{...}"
    pairs = (f"{_key(k)} = {_render(v, depth - 1, spaced)}" for k, v in value.items())
    inner = _first_few(pairs, len(value), "keys")
    return "{ " + inner + " }" if spaced else "{" + inner + "}"


def _key(key: object) -> str:
    if isinstance(key, int) and not isinstance(key, bool):
        text = _render(key, 0, False)
    else:
        try:
            text = str(key)
        except Exception:  # a str() that fails, or recurses too deeply
            text = f"<{type(key).__name__} object>"
    if re.fullmatch(r"[A-Za-z0-9_-]+", text) and len(text) <= SHOW_LIMIT:
        return text
    return _render(text, 0, False)  # quoted, and shortened


def _keys(table: Mapping[Any, Any]) -> str:
    """The keys of *table*, comma-separated (the first few of a large table)."""
    return _first_few(map(_key, table), len(table), "keys")


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


def _unknown_key(
    source: str, table: str, key: object, value: object, allowed: tuple[str, ...]
) -> ConfigError:
    last = key[-1] if isinstance(key, tuple) else key
    hint = did_you_mean(last, allowed)
    return _error(
        source, table, key, value, f"unknown key{hint}; allowed keys: {', '.join(allowed)}"
    )


# --------------------------------------------------------------------------- values

_SECONDS = 'must be a positive, finite number of seconds, or "none" for no deadline'


def _parse_seconds(source: str, table: str, key: object, given: object) -> float | None:
    value = given.value if isinstance(given, _Raw) else given
    if value is None or says_none(value):
        return None
    seconds = seconds_or_problem(value)  # the one rule (stallguard._validate)
    if seconds == TOO_LARGE:  # an int beyond the float range (a 400-digit TOML integer)
        raise _error(source, table, key, given, _SECONDS + " (too large)")
    if isinstance(seconds, str):
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
    if not is_text(label):
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


def _check_states(states: object) -> type[enum.Enum] | None:
    if states is None or (isinstance(states, type) and issubclass(states, enum.Enum)):
        return states
    raise ConfigError(f"states must be an enum.Enum subclass or None, got {states!r}")


def _check_str(argument: str, value: object, *, empty: bool = False) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise ConfigError(f"{argument} must be a non-empty string, got {value!r}")
    return value


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
        ConfigError: naming *source*, the key and the bad value (or the bad argument).
    """
    source = _check_str("source", source)
    prefix = _check_str("prefix", prefix)
    states = _check_states(states)
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
    return value  # type: ignore[return-value,unused-ignore]


def _memory(source: str, table: str, key: str, value: object) -> int:
    if not is_count(value, 1):
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
        ConfigError: naming *source*, the key and the bad value (or the bad argument).
    """
    name = _check_str("name", name)
    source = _check_str("source", source)
    states = _check_states(states)
    if prefix is None:
        prefix = f"spec.{_key(name)}"
    prefix = _check_str("prefix", prefix)
    if not isinstance(table, Mapping):
        raise ConfigError(f"{source}: {prefix} = {_show(table)}: must be a table")
    _check_spec_keys(source, prefix, table)
    deadlines = parse_deadlines(
        table["deadlines"],  # type: ignore[arg-type]
        source=source,
        prefix=f"{prefix}.deadlines",
        states=states,
    )
    terminal = _terminal(source, prefix, table.get("terminal", []), states)
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


def _check_spec_keys(source: str, prefix: str, table: Mapping[str, object]) -> None:
    """Refuse a spec table with an unknown key, or without its deadlines."""
    for key, value in table.items():
        if key not in _SPEC_KEYS:
            raise _unknown_key(source, prefix, key, value, _SPEC_KEYS)
    if "deadlines" not in table:
        raise ConfigError(
            f"{source}: [{prefix}] has no deadlines table; add [{prefix}.deadlines] with "
            'one "state = seconds" line per non-terminal state'
        )


def _terminal(source: str, prefix: str, raw: object, states: type[enum.Enum] | None) -> list[State]:
    """A spec table's ``terminal`` array, as states."""
    if isinstance(raw, str) or not isinstance(raw, (list, tuple)):
        raise _error(source, prefix, "terminal", raw, "must be an array of state names")
    return [_to_state(source, prefix, "terminal", s, states) for s in raw]


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


def _env_head(env_prefix: str, name: str) -> str:
    """The prefix of spec *name*'s environment variables: ``STALLGUARD_KV_SENDER_``."""
    return f"{_env_name(env_prefix)}_{_env_name(name)}_"


_SETTINGS = ("MODE", "UNKNOWN_STATE", "MEMORY", "LIFETIME")


def _is_setting(rest: str, states: Mapping[str, list[State]]) -> bool:
    """Whether *rest* (a variable name without its spec's head) names a setting of the
    spec whose states, by environment name, are *states*."""
    if rest in _SETTINGS:
        return True
    field, _, state_name = rest.partition("_")
    return field in ("DEADLINE", "STALL") and state_name in states


def _env_states(spec: Spec) -> dict[str, list[State]]:
    """Environment name -> the spec's states (terminal ones too) that it names; two states
    whose names differ only in punctuation (``Wait-Input``, ``Wait_Input``) share one."""
    out: dict[str, list[State]] = {}
    for state in (*spec.deadlines, *spec.terminal):
        out.setdefault(_env_name(state_label(state)), []).append(state)
    return out


def _ours(
    spec: Spec,
    env: Mapping[str, str],
    env_prefix: str,
    others: tuple[str, ...],
    states: Mapping[str, list[State]],
) -> list[tuple[str, str]]:
    """The environment variables addressed to *spec*, sorted; a variable that another
    spec of the file could claim as well is refused (never guessed)."""
    head = _env_head(env_prefix, spec.name)
    heads = {o: _env_head(env_prefix, o) for o in others if o != spec.name}
    addressed = [(var, value) for var, value in env.items() if _under(var, head)]
    _refuse_twins(spec.name, head, heads, addressed)
    longer = _longer_heads(head, heads)
    return sorted(
        (var, _env_text(var, value))
        for var, value in addressed
        if not _claimed_by_another(spec, var, var[len(head) :], longer, states)
    )


def _env_text(var: str, value: object) -> str:
    """*var*'s *value*, refused unless a string (an ``env`` mapping may hold anything)."""
    if not isinstance(value, str):
        raise _error(_ENV, "", var, value, "an environment value must be a string")
    return value


def _under(var: object, head: str) -> bool:
    """Whether *var* is a variable name starting with *head*."""
    return isinstance(var, str) and var.startswith(head)


def _longer_heads(head: str, heads: Mapping[str, str]) -> dict[str, str]:
    """The other specs (*heads*: name -> head) whose head extends *head* (spec
    ``kv_sender`` for spec ``kv``)."""
    return {o: h for o, h in heads.items() if h != head and h.startswith(head)}


def _refuse_twins(
    name: str, head: str, heads: Mapping[str, str], addressed: list[tuple[str, str]]
) -> None:
    """Refuse the variables *addressed* to spec *name* (*head*), naming the first, if
    another spec's variables (*heads*: name -> head) start with the same head."""
    twins = [o for o, h in heads.items() if h == head]
    if twins and addressed:
        var = addressed[0][0]
        raise ConfigError(
            f"environment: {var}: ambiguous: specs {name!r} and {twins[0]!r} both read the "
            f"variables {head}*; rename one of them so that their names differ in more "
            "than punctuation and case"
        )


def _claimed_by_another(
    spec: Spec,
    var: str,
    rest: str,
    longer: Mapping[str, str],
    states: Mapping[str, list[State]],
) -> bool:
    """Whether *var* belongs to one of the specs whose heads extend *spec*'s (*longer*:
    name -> head); refused when it is also a setting (*rest*) of *spec*."""
    owners = [o for o, h in longer.items() if var.startswith(h)]
    if owners and _is_setting(rest, states):
        other = max(owners, key=len)
        raise ConfigError(
            f"environment: {var}: ambiguous: it is setting {rest} of spec "
            f"{spec.name!r} and setting {var[len(longer[other]) :]} of spec "
            f"{other!r}; rename one of the specs"
        )
    return bool(owners)


_ENV = "environment"


def _env_mode(var: str, value: str) -> str:
    return _choice(_ENV, "", var, value.strip(), ("enforce", "report"))


def _env_unknown_state(var: str, value: str) -> str:
    return _choice(_ENV, "", var, value.strip(), ("raise", "ignore"))


def _env_memory(var: str, value: str) -> int:
    try:
        number = int(value.strip())
    except ValueError:  # not an integer, or more digits than int() accepts
        number = 0
    if number < 1:
        raise _error(_ENV, "", var, value, "must be a positive integer")
    return number


def _env_seconds(var: str, value: str) -> float | None:
    return _parse_seconds(_ENV, "", var, _env_number(value))


#: the settings set by a variable: its name after the spec's head -> whose field it is
#: (the :class:`WatchdogConfig`'s or its spec's), the field and the value's parser
_ENV_OPTIONS: dict[str, tuple[str, str, Callable[[str, str], object]]] = {
    "MODE": ("config", "mode", _env_mode),
    "UNKNOWN_STATE": ("config", "unknown_state", _env_unknown_state),
    "MEMORY": ("config", "memory", _env_memory),
    "LIFETIME": ("spec", "lifetime", _env_seconds),
}


def _apply_env(
    config: WatchdogConfig, env: Mapping[str, str], env_prefix: str, others: tuple[str, ...]
) -> WatchdogConfig:
    spec = config.spec
    states = _env_states(spec)
    ours = _ours(spec, env, env_prefix, others, states)
    if not ours:
        return config
    head = _env_head(env_prefix, spec.name)
    deadlines = dict(spec.deadlines)
    changes: dict[str, dict[str, Any]] = {"config": {}, "spec": {}}
    for var, value in ours:
        rest = var[len(head) :]
        if rest in _ENV_OPTIONS:
            owner, field, parse = _ENV_OPTIONS[rest]
            changes[owner][field] = parse(var, value)
        elif rest.startswith(("DEADLINE_", "STALL_")):
            _env_deadline(spec, states, deadlines, var, rest, value)
        else:
            raise _unknown_setting(spec, head, var, value, rest)
    if deadlines != dict(spec.deadlines):
        changes["spec"]["deadlines"] = deadlines
    if changes["spec"]:
        spec = spec.evolve(**changes["spec"])  # each value was validated above
    return attrs.evolve(config, spec=spec, **changes["config"])


def _unknown_setting(spec: Spec, head: str, var: str, value: str, rest: str) -> ConfigError:
    """The error for *var*, addressed to *spec* (*head*) but naming none of its
    settings (*rest*: the name after the head), listing the settings it has."""
    settings = ", ".join(head + form for form in _ENV_FORMS)
    return _error(
        _ENV,
        "",
        var,
        value,
        f"unknown setting {rest}; the settings of spec {spec.name!r} are {settings}",
    )


def _env_deadline(
    spec: Spec,
    states: Mapping[str, list[State]],
    deadlines: dict[State, Deadline],
    var: str,
    rest: str,
    value: str,
) -> None:
    """Apply *var*, ``..._DEADLINE_<STATE>`` or ``..._STALL_<STATE>`` (*rest* after the
    spec's head), to *deadlines*."""
    field, _, state_name = rest.partition("_")
    state = _env_state(spec, states, deadlines, var, value, state_name)
    seconds = _env_seconds(var, value)
    deadlines[state] = attrs.evolve(deadlines[state], **{_DEADLINE_FIELDS[field]: seconds})


#: a deadline variable's field -> the :class:`~stallguard.Deadline` attribute it sets
_DEADLINE_FIELDS = {"DEADLINE": "seconds", "STALL": "stall"}


def _env_state(
    spec: Spec,
    states: Mapping[str, list[State]],
    deadlines: Mapping[State, Deadline],
    var: str,
    value: str,
    state_name: str,
) -> State:
    """The state with a deadline that *state_name*, in variable *var*, names."""
    found = states.get(state_name, [])
    if len(found) > 1:
        names = " and ".join(repr(state_label(s)) for s in found)
        raise _error(
            _ENV,
            "",
            var,
            value,
            f"ambiguous: states {names} of spec {spec.name!r} are both {state_name} "
            "in an environment variable's name; rename one of them",
        )
    if found and found[0] in deadlines:
        return found[0]
    raise _error(_ENV, "", var, value, _no_deadline(spec, states, deadlines, state_name, found))


def _no_deadline(
    spec: Spec,
    states: Mapping[str, list[State]],
    deadlines: Mapping[State, Deadline],
    state_name: str,
    found: list[State],
) -> str:
    """Why *state_name* (an environment spelling; *found*: the states it names) names no
    state with a deadline: a terminal state, or none of *spec*'s (listing those it has)."""
    if found:
        return f"{state_name} is a terminal state of spec {spec.name!r}; it has no deadline"
    by_env = sorted(name for name, f in states.items() if f[0] in deadlines)
    return f"spec {spec.name!r} has no state {state_name}; its states here are {', '.join(by_env)}"


def _env_number(value: str) -> _Raw:
    """An environment value as a number if it is one (else the text), shown as written."""
    return _Raw(_env_value(value), _show(value))


def _env_value(value: str) -> object:
    """An environment value as a number if it is one (an int, else a float; spaces
    around it ignored), else the text as written (adapters read theirs the same way)."""
    text = value.strip()
    try:
        return int(text)
    except ValueError:  # not an integer, or more digits than int() reads
        pass
    try:
        return float(text)
    except ValueError:
        return value


# --------------------------------------------------------------------------- loading


def _read(source: str | os.PathLike[str]) -> tuple[str, Mapping[str, Any]]:
    path = os.fspath(source)
    label = os.fsdecode(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read the config file: {exc.strerror or exc}") from None
    except ValueError as exc:  # an embedded NUL in the path
        raise ConfigError(f"{label!r}: not a usable file path: {exc}") from None
    return label, _parse_toml(data, label)


def _parse_toml(data: bytes, label: str) -> dict[str, Any]:
    """The bytes of a TOML file, parsed; every failure (encoding, syntax, nesting depth,
    integer size, anything the parser raises) a :class:`ConfigError` naming *label* (the
    file). The core's loader and the adapters' (``stallguard.adapters.read_toml``) both
    use it."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{label}: not UTF-8 text (TOML files must be UTF-8): byte "
            f"{data[exc.start]:#04x} at offset {exc.start} cannot be decoded; save it as UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{label}: not valid TOML: {exc}") from None
    except RecursionError:  # arrays or inline tables nested thousands deep
        raise ConfigError(
            f"{label}: not valid TOML: values nested too deeply (arrays or inline tables "
            "thousands deep); a config needs a few levels"
        ) from None
    except ValueError as exc:  # int() refusing more than sys.get_int_max_str_digits()
        raise _toml_value_error(label, exc) from None
    except Exception as exc:  # anything else the parser raises: still this file's problem
        raise ConfigError(
            f"{label}: cannot parse it as TOML: {type(exc).__name__}: {shorten(str(exc))}"
        ) from None


def _toml_value_error(label: str, exc: ValueError) -> ConfigError:
    """The error for the parser's *exc*: too many digits for ``int()``, or other."""
    if "digits" not in str(exc):
        return ConfigError(f"{label}: not valid TOML: {exc}")
    limit = getattr(sys, "get_int_max_str_digits", lambda: 4300)()
    return ConfigError(
        f"{label}: not valid TOML: an integer of more than {limit} digits (TOML "
        'integers are 64-bit); write a number of seconds, or "none" for no deadline'
    )


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
        ConfigError: naming the file, the key and the bad value (or the bad argument);
            also for an override that two specs, or two states, could both claim
            (names that differ only in punctuation or case).
    """
    if name is not None:
        name = _check_str("name", name)
    env_prefix = _check_str("env_prefix", env_prefix)
    states = _check_states(states)
    _check_env(env)
    label, document = _document(source)
    if env is _ENVIRON:
        env = os.environ
    specs = _specs(label, document)
    name = _chosen(label, specs, name)
    config = parse_config_table(specs[name], name=name, source=label, states=states)
    if env is not None:
        config = _apply_env(config, env, env_prefix, tuple(specs))
    return config


def _check_env(env: object) -> None:
    """Refuse an *env* argument that is neither the default, None nor a mapping."""
    if env is _ENVIRON or env is None or isinstance(env, Mapping):
        return
    raise ConfigError(f"env must be a mapping of variable names to values or None, got {env!r}")


def _document(source: object) -> tuple[str, Mapping[str, Any]]:
    """*source*'s label for messages and its parsed document."""
    if isinstance(source, Mapping):
        return "<dict>", source
    if isinstance(source, (str, os.PathLike)):
        return _read(source)
    raise ConfigError(
        f"source must be a TOML file path or a mapping, got {source!r} ({type(source).__name__})"
    )


def _specs(label: str, document: Mapping[str, Any]) -> Mapping[Any, Any]:
    """The document's ``[spec.<name>]`` tables, checked to be named tables."""
    specs = document.get("spec")
    if not isinstance(specs, Mapping) or not specs:
        found = _keys(document) or "nothing"
        raise ConfigError(
            f"{label}: no [spec.<name>] table (found: {found}); declare each spec as "
            "[spec.<name>] with a [spec.<name>.deadlines] table"
        )
    for spec_name, table in specs.items():
        _check_spec_table(label, spec_name, table)
    return specs


def _check_spec_table(label: str, spec_name: object, table: object) -> None:
    """Refuse a ``[spec.<name>]`` entry without a name, or that is not a table."""
    if not isinstance(spec_name, str) or not spec_name.strip():
        raise _error(label, "spec", spec_name, table, "a spec name must be a non-empty string")
    if not isinstance(table, Mapping):
        raise _error(label, "spec", spec_name, table, "must be a table: [spec.<name>]")


def _chosen(label: str, specs: Mapping[Any, Any], name: str | None) -> str:
    """The spec to load: *name*, or the document's only one."""
    if name is None:
        if len(specs) > 1:
            raise ConfigError(
                f"{label}: holds several specs ({_keys(specs)}); pass name=... to choose one"
            )
        only: str = next(iter(specs))
        return only
    if name not in specs:
        raise ConfigError(f"{label}: has no [spec.{_key(name)}] table; its specs: {_keys(specs)}")
    return name


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
