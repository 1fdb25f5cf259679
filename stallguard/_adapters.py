"""The configuration and command-line pieces of :mod:`stallguard.adapters`.

An adapter is enabled by two environment variables (a TOML file, or "on with the
defaults"), reads its own small schema, and may take per-key overrides from the
environment. Every error has the core's message shape
(``file.toml: [table] key = value: problem``; ``environment: VAR = value: problem``).
Pure Python, no engine import. The public names are re-exported (and documented) by
:mod:`stallguard.adapters`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NoReturn, TypeVar

from ._config import _env_value, _key, _parse_toml, _show, parse_deadlines
from ._errors import ConfigError
from ._spec import Deadline
from ._validate import TOO_LARGE, did_you_mean, says_none, seconds_or_problem, shorten

__all__ = [
    "EnvReader",
    "OneLineParser",
    "TableReader",
    "describe_exception",
    "one_line",
    "printable",
    "seconds_arg",
    "env_enabled",
    "read_config",
    "read_toml",
    "run_console",
    "version_action",
    "versions_line",
]

T = TypeVar("T")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def env_enabled(environ: Mapping[str, str], *, enable_var: str, config_var: str) -> str | None:
    """Decide from the environment whether an adapter is on, and with which file.

    * ``<enable_var>=0`` (or false/no/off): off, even if a file is named (a kill switch);
    * ``<config_var>=/path.toml``: on, with that file;
    * ``<enable_var>=1`` (or true/yes/on): on, with the defaults;
    * neither: off.

    Returns:
        None (off), ``""`` (on, defaults) or the file's path (on, that file).

    Raises:
        ConfigError: if *enable_var* holds anything else, naming it and its value.
    """
    enabled = _switch(environ, enable_var, config_var)
    if enabled is False:
        return None
    path = environ.get(config_var, "").strip()
    if path:
        return path
    return "" if enabled else None


def _switch(environ: Mapping[str, str], enable_var: str, config_var: str) -> bool | None:
    """The enable switch *enable_var*: True (on), False (off) or None (unset)."""
    flag = environ.get(enable_var)
    if flag is None:
        return None
    normalized = flag.strip().lower()
    if normalized in _TRUE:
        return True
    if normalized in _FALSE:
        return False
    raise ConfigError(
        f"environment variable {enable_var}={shorten(repr(flag))}: expected 1 (enable "
        f"with the defaults) or 0 (disable), or unset it and name a file in {config_var}"
    )


def read_toml(path: str, *, var: str) -> dict[str, Any]:
    """Parse the TOML file *path* (named by the environment variable *var*).

    Every failure to read or parse it is a :class:`~stallguard.ConfigError` naming the file: I/O,
    encoding (TOML files are UTF-8), syntax, values nested thousands deep, integers of
    more digits than Python reads, anything else the parser raises.

    Raises:
        ConfigError: ``VAR='path': no such file`` (or: a directory, unreadable, not a
            usable path), or ``path: not valid TOML: <what is wrong>`` (or: not UTF-8
            text, naming the byte and its offset).
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{var}={path!r}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{var}={path!r}: is a directory, not a TOML file") from None
    except OSError as e:  # (strerror: the message without the path a second time)
        raise ConfigError(f"{var}={path!r}: cannot read it: {e.strerror or e}") from None
    except (ValueError, TypeError) as e:  # an embedded NUL; not a path at all
        raise ConfigError(f"{var}={shorten(repr(path))}: not a usable file path: {e}") from None
    return _parse_toml(data, path)


def read_config(path: str, *, var: str, parse: Callable[[dict[str, Any]], T]) -> T:
    """:func:`read_toml`, then *parse* (the adapter's schema) on the document: the
    boundary where an adapter's file becomes its configuration. Whatever goes wrong is a
    :class:`~stallguard.ConfigError` naming the file: *parse*'s own (naming the key and the value),
    and any other exception while interpreting the document (a value nested too deeply,
    a stallguard bug) as ``path: cannot interpret it: ...``, so an engine never starts
    on a file it was given but could not apply.

    Raises:
        ConfigError: as described.
    """
    document = read_toml(path, var=var)
    try:
        return parse(document)
    except ConfigError:
        raise
    except RecursionError:
        raise ConfigError(
            f"{path}: cannot interpret it: values nested too deeply; a config needs a few "
            "levels of tables"
        ) from None
    except Exception as e:
        raise ConfigError(
            f"{path}: cannot interpret it ({describe_exception(e)}); check its values "
            "against the documented schema (and report this: the message should have "
            "named the key)"
        ) from e


def describe_exception(e: BaseException) -> str:
    """``Type: message``, shortened, for an error message (never raises)."""
    try:
        text = str(e)
    except Exception:  # a __str__ that fails
        text = ""
    return f"{type(e).__name__}: {shorten(text)}" if text else type(e).__name__


def printable(text: str) -> str:
    """*text* with what cannot be written as UTF-8 (lone surrogates: the bytes of a
    non-UTF-8 environment value or command-line argument, as Python decodes them)
    shown as ``\\udcxx`` escapes, so that printing an error message never raises."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _render(value: object) -> str:
    """*value* for a message, TOML-looking, inline tables as ``{ k = v }``."""
    return printable(_show(value, spaced=True))


def _seconds_problem(problem: str, *, none: bool, advice: str | None) -> str:
    text = "must be a positive, finite number of seconds"
    if problem == TOO_LARGE:
        text += " (this one is too large for a float)"
    if none:
        text += ', or "none" for no deadline'
    return f"{text}; {advice}" if advice else text


class TableReader:
    """Strict reader of one table of an adapter's configuration (a parsed TOML table, or
    a dict from the engine's own configuration); every error is a
    :class:`~stallguard.ConfigError` naming the source, the table, the key and the value:
    ``source: [table] key = value: problem``.

    Args:
        table: the parsed table.
        source: the file (or ``"<dict>"``, or the engine option) for messages.
        where: the table's dotted name (``""`` for the top level).
        allowed: the keys the table may hold.
        what: what a key names, for the unknown-key message: ``"key"``, or
            ``"transfer backend"``, say.

    Raises:
        ConfigError: on construction, if *table* is not a table or holds a key outside
            *allowed* (with a "did you mean" hint).
    """

    def __init__(
        self,
        table: object,
        *,
        source: str,
        where: str,
        allowed: tuple[str, ...],
        what: str = "key",
    ) -> None:
        if not isinstance(table, Mapping):
            name = f"[{where}]" if where else "the configuration"
            raise ConfigError(f"{printable(source)}: {name} must be a table, got {_render(table)}")
        self.table: Mapping[Any, Any] = table
        self.source = source
        self.where = where
        self._refuse_unknown(allowed, what)

    def _refuse_unknown(self, allowed: tuple[str, ...], what: str) -> None:
        """Refuse the first key not in *allowed* (a *what*), with a hint."""
        for key, value in self.table.items():
            if key not in allowed:
                hint = did_you_mean(key, allowed)
                listing = "allowed keys:" if what == "key" else "known:"
                raise self.error(
                    key, value, f"unknown {what}{hint}; {listing} {', '.join(allowed)}"
                )

    def __contains__(self, key: str) -> bool:
        return key in self.table

    def error(self, key: object, value: object, problem: str) -> ConfigError:
        """A :class:`~stallguard.ConfigError` for ``source: [where] key = value: problem``."""
        where = f"[{self.where}] " if self.where else ""
        return ConfigError(
            printable(f"{self.source}: {where}{_key(key)} = {_render(value)}: {problem}")
        )

    def dotted(self, key: str) -> str:
        """The dotted name of the sub-table *key* (``prefill.deadlines``)."""
        return f"{self.where}.{key}" if self.where else key

    def sub(self, key: str, allowed: tuple[str, ...], *, what: str = "key") -> TableReader:
        """The sub-table *key* (empty if absent), read with its own *allowed* keys."""
        value = self.table.get(key, {})
        if not isinstance(value, Mapping):
            raise self.error(key, value, f"must be a table ([{self.dotted(key)}])")
        return TableReader(
            value, source=self.source, where=self.dotted(key), allowed=allowed, what=what
        )

    def choice(self, key: str, allowed: tuple[str, ...], default: str) -> str:
        """The string *key*, one of *allowed* (*default* if absent)."""
        value = self.table.get(key, default)
        if not isinstance(value, str) or value not in allowed:
            shown = ", ".join(f'"{a}"' for a in allowed)
            raise self.error(key, value, f"must be one of {shown}{did_you_mean(value, allowed)}")
        return value

    def seconds(
        self, key: str, default: float | None, *, none: bool = True, advice: str | None = None
    ) -> float | None:
        """A positive, finite number of seconds; ``"none"`` (None: no deadline) too if
        *none*. *advice* ends the message (what to write instead)."""
        if key not in self.table:
            return default
        value = self.table[key]
        if none and says_none(value):
            return None
        seconds = seconds_or_problem(value)  # the one rule (stallguard._validate)
        if isinstance(seconds, str):
            raise self.error(key, value, _seconds_problem(seconds, none=none, advice=advice))
        return seconds

    def deadlines(
        self,
        key: str,
        states: tuple[str, ...],
        *,
        terminal: tuple[str, ...] = (),
        unknown: str = "not a state that takes a deadline",
        listing: str = "states:",
    ) -> Mapping[str, Deadline]:
        """The sub-table *key* of deadlines, ``state = seconds | "none" | { seconds = ...,
        stall = ... }``, keyed by *states*, each value read by
        :func:`stallguard.parse_deadlines` (the core's rules and messages). A key in
        *terminal* is told it takes no deadline; another unknown key gets *unknown* and a
        hint; both end with ``; <listing> <states>``."""
        table = self.table.get(key, {})
        where = self.dotted(key)
        if not isinstance(table, Mapping):
            raise self.error(key, table, f"must be a table ([{where}])")
        reader = TableReader(table, source=self.source, where=where, allowed=tuple(table))
        for state, value in table.items():
            if state not in states:
                hint = _not_a_state(state, states, terminal, unknown)
                raise reader.error(state, value, f"{hint}; {listing} {', '.join(states)}")
        parsed = parse_deadlines(table, source=self.source, prefix=where)
        return MappingProxyType({str(state): deadline for state, deadline in parsed.items()})


def _not_a_state(
    key: object, states: tuple[str, ...], terminal: tuple[str, ...], unknown: str
) -> str:
    """Why *key* of a deadlines table is not one of *states*: a *terminal* state takes no
    deadline; another key is *unknown* (with a hint)."""
    if key in terminal:
        return f"{key} is terminal and takes no deadline"
    return unknown + did_you_mean(key, states)


class EnvReader:
    """Strict reader of an adapter's per-key environment overrides (``PREFIX_...``
    variables); every error is a :class:`~stallguard.ConfigError` naming the variable
    and its value as written: ``environment: VAR = "value": problem``.

    Args:
        environ: the environment (``os.environ``, or a dict in tests).
        prefix: the variables read, e.g. ``"STALLGUARD_SGLANG_"``.
        known: every variable name this adapter reads as an override.
        ignore: variables under *prefix* that are not overrides (the enable switch, the
            config-file variable...).
        forms: how the docs write the accepted names, for the unknown-variable message
            (``STALLGUARD_SGLANG_PREFILL_DEADLINE_<STATE>, ...``).

    Raises:
        ConfigError: on construction, for a variable under *prefix* that is neither
            in *known* nor in *ignore* (with a "did you mean" hint): a misspelt override is
            refused, never ignored.
    """

    def __init__(
        self,
        environ: Mapping[str, str],
        prefix: str,
        *,
        known: Iterable[str],
        ignore: Iterable[str] = (),
        forms: str = "",
    ) -> None:
        known = tuple(known)
        skip = set(ignore)
        self.values: dict[str, str] = {}
        for var, value in environ.items():
            if isinstance(var, str) and var.startswith(prefix) and var not in skip:
                self.values[var] = self._override(var, value, known, forms)

    def _override(self, var: str, value: object, known: tuple[str, ...], forms: str) -> str:
        """*value*, if *var* is a *known* override and *value* a string."""
        if not isinstance(value, str):
            raise self.error(var, value, "an environment value must be a string")
        if var not in known:
            listing = f"; the settings are {forms}" if forms else ""
            raise self.error(var, value, f"unknown setting{did_you_mean(var, known)}{listing}")
        return value

    def __contains__(self, var: str) -> bool:
        return var in self.values

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.values))

    def error(self, var: str, value: object, problem: str) -> ConfigError:
        """A :class:`~stallguard.ConfigError` for ``environment: VAR = value: problem``."""
        return ConfigError(printable(f"environment: {_key(var)} = {_show(value)}: {problem}"))

    def choice(self, var: str, allowed: tuple[str, ...]) -> str:
        """The variable's value (spaces around it ignored), one of *allowed*."""
        value = self.values[var]
        text = value.strip()
        if text not in allowed:
            shown = ", ".join(f'"{a}"' for a in allowed)
            raise self.error(var, value, f"must be one of {shown}{did_you_mean(text, allowed)}")
        return text

    def seconds(self, var: str, *, none: bool = True, advice: str | None = None) -> float | None:
        """The variable's value as seconds, by the rule :meth:`TableReader.seconds`
        applies (``none`` for no deadline if *none*)."""
        value = self.values[var]
        if none and says_none(value):
            return None
        seconds = seconds_or_problem(_env_value(value))
        if isinstance(seconds, str):
            raise self.error(var, value, _seconds_problem(seconds, none=none, advice=advice))
        return seconds


def versions_line(
    adapter: str,
    engine: str,
    engine_label: str,
    supported: str,
    *,
    engine_version: str | None = None,
) -> str:
    """``"<adapter> X (stallguard Y; <engine_label> Z, supported S)"``, from the installed
    distributions' metadata (``not installed`` for a missing one): what an adapter's
    ``--version`` prints. *engine_version*, if given, is the engine's version (found
    under another distribution name, :class:`VersionSupport`'s *also*) instead of
    *engine*'s metadata."""
    from ._versions import installed_version

    def of(version: str | None) -> str:
        return version if version is not None else "not installed"

    if engine_version is None:
        engine_version = installed_version(engine)
    return (
        f"{adapter} {of(installed_version(adapter))} "
        f"(stallguard {of(installed_version('stallguard'))}; "
        f"{engine_label} {of(engine_version)}, supported {supported})"
    )


def version_action(text: Callable[[], str]) -> type[argparse.Action]:
    """An argparse action class for ``--version`` that prints ``text()`` and exits 0."""

    class _VersionAction(argparse.Action):
        def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
            super().__init__(option_strings, dest, nargs=0, help="print the versions and exit")

        def __call__(
            self, parser: argparse.ArgumentParser, *args: object, **kwargs: object
        ) -> None:
            print(text())
            parser.exit(0)

    return _VersionAction


def text_table(rows: Sequence[Sequence[str]]) -> str:
    """*rows*, the header first, as left-aligned columns two spaces apart (trailing
    spaces trimmed), with a rule of dashes under the header: the support and coverage
    tables an adapter logs at start-up and prints from its ``check`` command."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [_aligned(row, widths) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _aligned(cells: Sequence[str], widths: list[int]) -> str:
    """*cells* left-aligned in columns of *widths*, two spaces apart."""
    return "  ".join(cell.ljust(w) for cell, w in zip(cells, widths, strict=True)).rstrip()


def one_line(text: str) -> str:
    """*text* on one line (an exception's message may hold line breaks)."""
    return " ".join(text.splitlines())


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (no usage dump), exit
    status 2 (argparse's own status for bad arguments)."""

    def error(self, message: str) -> NoReturn:
        """One line on stderr (no usage dump), exit status 2."""
        self.exit(2, f"{self.prog}: error: {printable(one_line(message))}\n")


def seconds_arg(text: str) -> float:
    """An argparse ``type=`` for a positive, finite number of seconds (the one rule).

    Raises:
        argparse.ArgumentTypeError: naming the value.
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if isinstance(seconds_or_problem(value), str):
        raise argparse.ArgumentTypeError(
            f"{printable(shorten(repr(text), 40))} is not a positive, finite number of seconds"
        )
    return value


def run_console(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """*main* for a command line: a reader that closes the pipe early (``| head``) ends
    the output quietly instead of with a traceback (exit status 1)."""
    try:
        status = main(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        # what is left to print goes nowhere (Python's documented recipe)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return status
