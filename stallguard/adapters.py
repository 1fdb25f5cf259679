"""The adapter kit: what an engine adapter (stallguard-sglang, stallguard-vllm, yours)
needs from the core, public and documented (docs/adapters.md, "Writing an adapter").

Configuration, every error one :class:`~stallguard.ConfigError` naming the source, the
key and the value:

* :func:`env_enabled` - the enable switch and the config-file variable;
* :func:`read_toml`, :func:`read_config` - a TOML file named by a variable, through the
  adapter's schema;
* :class:`TableReader` - strict reading of one table (unknown keys with a hint,
  sub-tables, choices, seconds, deadlines tables);
* :class:`EnvReader` - per-key environment overrides, read by the same rules;
* :func:`did_you_mean`, :func:`describe_exception`, :func:`shorten`,
  :func:`printable` - the pieces of those messages.

Packaging and the command line: :func:`lazy_attribute` / :func:`lazy_names` (a cheap,
typed package face), :class:`VersionSupport` (the supported engine releases: one
specifier and its check), :func:`versions_line`, :func:`version_action`,
:class:`OneLineParser`, :func:`one_line`, :func:`seconds_arg`, :func:`run_console`,
:func:`text_table` (a support or coverage table, aligned).

Time in state on Prometheus: :data:`BOUNDS` and :data:`LADDER` (the statistics bucket
layout), :func:`histogram_buckets`, :class:`StatisticsExporter` (with the core's counts
of forced and reported expiries by state and reason), :func:`expiries_since` (those
counts for an adapter that ships them elsewhere), :func:`read_prometheus` (samples
of a text exposition), :func:`scrape_exposition` and :func:`read_exposition_file` (an
exposition from a ``/metrics`` URL or a saved file, for an ``advise`` command);
:func:`toml_number` (a suggested deadline as a TOML value, as
:meth:`stallguard.Advice.toml_lines` writes them).

Nothing here imports an engine, prometheus_client or (until a check runs) packaging.
"""

from __future__ import annotations

from collections.abc import Iterable

from ._adapters import (
    EnvReader,
    OneLineParser,
    TableReader,
    describe_exception,
    env_enabled,
    one_line,
    printable,
    read_config,
    read_toml,
    run_console,
    seconds_arg,
    text_table,
    version_action,
    versions_line,
)
from ._advice import read_prometheus, toml_number
from ._lazy import lazy_attribute, lazy_names
from ._prometheus import (
    StatisticsExporter,
    add_to_histogram,
    expiries_since,
    histogram_buckets,
    ladder_counts,
)
from ._stats import BOUNDS, LADDER
from ._validate import did_you_mean, shorten
from ._versions import VersionSupport, installed_version, release_of


def exposition_from_prometheus(
    base: str,
    names: Iterable[str],
    *,
    window: float,
    end: float,
    step: float | None = None,
    timeout: float = 30.0,
) -> str:
    """Time-in-state history from a Prometheus server's HTTP API as one text exposition:
    *names* (metric family names, ``prefix:rest``, either spelling found) over
    ``[end - window, end]``, summed across pods, restarts counted (a counter's drop starts
    a new run). What ``advise --prometheus`` reads.

    Raises:
        ValueError: the server cannot be reached or answers something else than a
            ``query_range`` matrix (the message names the URL).
    """
    from ._promapi import exposition_from_prometheus as read  # urllib only when used

    return read(base, names, window=window, end=end, step=step, timeout=timeout)


def scrape_exposition(url: str, *, what: str = "--url", timeout: float = 10.0) -> str:
    """The text exposition a ``/metrics`` *url* serves (what ``advise --url`` reads).

    Raises:
        ValueError: it cannot be read or is not UTF-8 (the message names *what*, the
            option that gave the URL, and the URL).
    """
    from ._promapi import scrape_exposition as scrape  # urllib only when used

    return scrape(url, what=what, timeout=timeout)


def read_exposition_file(path: str, *, what: str = "--file") -> str:
    """A saved text exposition (what ``advise --file`` reads).

    Raises:
        ValueError: it cannot be read or is not UTF-8 (the message names *what*, the
            path, and for bad UTF-8 the byte and its offset).
    """
    from ._promapi import read_exposition_file as read

    return read(path, what=what)


def parse_window(text: str, what: str = "--window") -> float:
    """Seconds in a Prometheus duration (``90s``, ``15m``, ``7d``, ``1w``); a
    :class:`ValueError` naming *what* and the text otherwise."""
    from ._promapi import parse_window as parse

    return parse(text, what)


__all__ = [
    "BOUNDS",
    "LADDER",
    "EnvReader",
    "OneLineParser",
    "StatisticsExporter",
    "TableReader",
    "add_to_histogram",
    "VersionSupport",
    "describe_exception",
    "did_you_mean",
    "env_enabled",
    "expiries_since",
    "exposition_from_prometheus",
    "histogram_buckets",
    "installed_version",
    "lazy_attribute",
    "lazy_names",
    "ladder_counts",
    "one_line",
    "parse_window",
    "printable",
    "read_config",
    "read_exposition_file",
    "read_prometheus",
    "read_toml",
    "release_of",
    "run_console",
    "scrape_exposition",
    "seconds_arg",
    "shorten",
    "text_table",
    "toml_number",
    "version_action",
    "versions_line",
]
