"""Shared pieces for engine adapters (stallguard-vllm; stallguard-sglang may move here).

An adapter is enabled by two environment variables (a TOML file, or "on with the
defaults") and reads its own small TOML schema. Both need the same things, with the
same message shape as the core's own config loader
(``file.toml: [table] key = value: problem``):

* :func:`env_enabled` - the enable/disable switch and the config-file variable;
* :func:`read_toml` - a TOML file named by an environment variable, every failure a
  :class:`~stallguard.ConfigError` naming the variable and the path;
* :func:`read_config` - that file through the adapter's schema, any exception while
  interpreting it a :class:`~stallguard.ConfigError` naming the file too;
* :class:`TableReader` - strict reading of one table: unknown keys (with a "did you
  mean" hint), sub-tables, choices, positive seconds.

Pure Python, no engine import; not part of the public API (adapters import it as
``stallguard._adapters`` and pin the core version they were released with).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ._config import _error, _parse_toml, _show, _unknown_key
from ._errors import ConfigError
from ._validate import TOO_LARGE, seconds_or_problem, shorten

__all__ = [
    "TableReader",
    "describe_exception",
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
    flag = environ.get(enable_var)
    enabled: bool | None = None
    if flag is not None:
        normalized = flag.strip().lower()
        if normalized in _TRUE:
            enabled = True
        elif normalized in _FALSE:
            enabled = False
        else:
            raise ConfigError(
                f"environment variable {enable_var}={shorten(repr(flag))}: expected 1 (enable "
                f"with the defaults) or 0 (disable), or unset it and name a file in {config_var}"
            )
    if enabled is False:
        return None
    path = environ.get(config_var, "").strip()
    if path:
        return path
    return "" if enabled else None


def read_toml(path: str, *, var: str) -> dict[str, Any]:
    """Parse the TOML file *path* (named by the environment variable *var*).

    Every failure to read or parse it is a :class:`ConfigError` naming the file: I/O,
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
    :class:`ConfigError` naming the file: *parse*'s own (naming the key and the value),
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


class TableReader:
    """Strict reader of one TOML table; every error names the source, the table, the key
    and the value.

    Args:
        table: the parsed table.
        source: the file (or ``"<dict>"``) for messages.
        where: the table's dotted name (``""`` for the top level).
        allowed: the keys the table may hold.

    Raises:
        ConfigError: on construction, if *table* is not a table or holds a key outside
            *allowed*.
    """

    def __init__(self, table: object, *, source: str, where: str, allowed: tuple[str, ...]) -> None:
        if not isinstance(table, Mapping):
            raise ConfigError(f"{source}: [{where}] must be a table, got {_show(table)}")
        for key, value in table.items():
            if key not in allowed:
                raise _unknown_key(source, where, key, value, allowed)
        self.table: Mapping[str, Any] = table
        self.source = source
        self.where = where

    def error(self, key: str, value: object, problem: str) -> ConfigError:
        """A :class:`ConfigError` for ``[where] key = value: problem``."""
        return _error(self.source, self.where, key, value, problem)

    def sub(self, key: str, allowed: tuple[str, ...]) -> TableReader:
        """The sub-table *key* (empty if absent), read with its own *allowed* keys."""
        value = self.table.get(key, {})
        dotted = f"{self.where}.{key}" if self.where else key
        if not isinstance(value, Mapping):
            raise self.error(key, value, f"must be a table ([{dotted}])")
        return TableReader(value, source=self.source, where=dotted, allowed=allowed)

    def choice(self, key: str, allowed: tuple[str, ...], default: str) -> str:
        """The string *key*, one of *allowed* (*default* if absent)."""
        value = self.table.get(key, default)
        if value not in allowed:
            shown = ", ".join(f'"{a}"' for a in allowed)
            raise self.error(key, value, f"must be one of {shown}")
        return str(value)

    def seconds(self, key: str, default: float | None) -> float | None:
        """A positive, finite number of seconds, or ``"none"`` (None: no deadline)."""
        if key not in self.table:
            return default
        value = self.table[key]
        if isinstance(value, str) and value.strip().lower() == "none":
            return None
        seconds = seconds_or_problem(value)  # the one rule (stallguard._validate)
        if isinstance(seconds, str):
            too_large = " (too large)" if seconds == TOO_LARGE else ""
            raise self.error(
                key,
                value,
                'must be a positive, finite number of seconds, or "none" for no deadline'
                + too_large,
            )
        return seconds


def versions_line(adapter: str, engine: str, engine_label: str, supported: str) -> str:
    """``"<adapter> X (stallguard Y; <engine_label> Z, supported S)"``, from the installed
    distributions' metadata (``not installed`` for a missing one): what an adapter's
    ``--version`` prints."""
    from importlib.metadata import PackageNotFoundError, version

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    return (
        f"{adapter} {of(adapter)} (stallguard {of('stallguard')}; "
        f"{engine_label} {of(engine)}, supported {supported})"
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
