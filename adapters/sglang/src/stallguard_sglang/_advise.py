"""``python -m stallguard_sglang advise``: suggested deadlines from a server's metrics.

Reads the time-in-state histogram the adapter exports (``_stats_export.py``) from a
Prometheus server's history (``--prometheus http://prometheus:9090 --window 7d``: every
pod and restart in the window, summed), a live scrape
(``--url http://127.0.0.1:30000/metrics``), a saved exposition or OpenMetrics scrape or
``/federate`` output (``--file metrics.txt``) or SGLang's multiprocess directory
(``--multiproc-dir``, default ``$PROMETHEUS_MULTIPROC_DIR``), applies
:func:`stallguard.advise` per queue and backend (tensor-parallel ranks summed), and
prints a table per backend and a TOML block for ``STALLGUARD_SGLANG_CONFIG``
(docs/advice.md). Exit status 2 on bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping

import stallguard
from stallguard import Advice, ConfigError, Statistics
from stallguard.adapters import (
    OneLineParser,
    describe_exception,
    exposition_from_prometheus,
    one_line,
    parse_window,
    read_exposition_file,
    read_prometheus,
    scrape_exposition,
    toml_number,
)

from . import _metrics, _stats_export
from ._config import DECODE_PHASES

__all__ = [
    "DESCRIPTION",
    "add_arguments",
    "advise_text",
    "main",
    "read_source",
    "run",
    "toml_block",
]

_PREFILL_STATES = ("Bootstrapping", "WaitingForInput", "Transferring")


#: The metric families advise reads from a Prometheus server.
PROMETHEUS_NAMES = (
    _stats_export.STATE_SECONDS,
    _stats_export.DEADLINE,
    _stats_export.REPORTED_COMPLETED,
    _metrics.FORCED_FAILURES,
    _metrics.STALLS_REPORTED,
)


def read_source(
    *,
    url: str | None = None,
    file: str | None = None,
    multiproc_dir: str | None = None,
    prometheus: str | None = None,
    window: float = 7 * 86400.0,
    step: float | None = None,
    end: float | None = None,
) -> str:
    """A Prometheus text exposition from one source (*prometheus*: a server's URL, read
    over ``[end - window, end]``, default end now; see
    ``stallguard.adapters.exposition_from_prometheus``).

    Raises:
        ValueError: naming the source, for anything that goes wrong reading it (the
            advise command prints it on one line and exits with status 2).
    """
    if prometheus is not None:
        return exposition_from_prometheus(
            prometheus,
            PROMETHEUS_NAMES,
            window=window,
            step=step,
            end=time.time() if end is None else end,
        )
    if url is not None:
        return scrape_exposition(url)
    if file is not None:
        return read_exposition_file(file)
    if multiproc_dir is not None:
        return _collect(multiproc_dir)
    raise ValueError("give one of --prometheus, --url, --file or --multiproc-dir")


def _collect(multiproc_dir: str) -> str:
    """The exposition of prometheus_client's multiprocess directory *multiproc_dir*."""
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    if not os.path.isdir(multiproc_dir):
        raise ValueError(f"--multiproc-dir {multiproc_dir!r} is not a directory")
    try:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=multiproc_dir)  # type: ignore[no-untyped-call]
        return generate_latest(registry).decode("utf-8")
    except Exception as e:  # a corrupt or foreign .db file, unreadable files...
        raise ValueError(
            f"--multiproc-dir {multiproc_dir!r}: cannot read the metrics in it: "
            f"{describe_exception(e)}"
        ) from None


def _backends(text: str, queue: str) -> list[str]:
    found = {
        labels.get("backend", "")
        for name, labels, _ in read_prometheus(text)
        if name == f"{_stats_export.STATE_SECONDS}_bucket" and labels.get("queue") == queue
    }
    return sorted(b for b in found if b)


def statistics(text: str, queue: str, backend: str) -> Statistics:
    """The statistics of one queue and backend, ranks summed."""
    return stallguard.statistics_from_prometheus(
        text,
        histogram=_stats_export.STATE_SECONDS,
        spec=f"sglang.{queue}.{backend}",
        where={"queue": queue, "backend": backend},
        deadline_gauge=_stats_export.DEADLINE,
        fired_counter=_fired_counter(text),
        completed_counter=_stats_export.REPORTED_COMPLETED,
    )


def _fired_counter(text: str) -> str:
    """Forced failures (enforce) or reported stalls (report), whichever the text has."""
    reported = f"{_metrics.STALLS_REPORTED}_total"
    return _metrics.STALLS_REPORTED if reported in text else _metrics.FORCED_FAILURES


def advise_text(
    text: str, *, baseline: str | None = None, **kwargs: object
) -> dict[tuple[str, str], Advice]:
    """Advice per ``(queue, backend)`` found in *text* (*kwargs*: :func:`stallguard.advise`'s)."""
    out: dict[tuple[str, str], Advice] = {}
    for queue in ("inflight", "bootstrap", "prealloc", "transfer"):
        for backend in _backends(text, queue):
            stats = statistics(text, queue, backend)
            out[queue, backend] = stallguard.advise(
                stats,
                baseline=_baseline(baseline, queue, backend),
                **kwargs,  # type: ignore[arg-type]
            )
    return out


def _baseline(baseline: str | None, queue: str, backend: str) -> Statistics | None:
    """The statistics of *queue* and *backend* in the *baseline* scrape, if it has them."""
    if baseline is None or backend not in _backends(baseline, queue):
        return None
    return statistics(baseline, queue, backend)


def toml_block(advice: Mapping[tuple[str, str], Advice]) -> str:
    """The suggestions as stallguard-sglang configuration: the backend with the most
    recorded stays (``fake`` only if it is the only one) in ``[prefill.deadlines]``,
    every other in ``[prefill.backends.<name>.deadlines]``, and the bootstrap queue's
    ``Bootstrapping`` (the longest across backends) as ``[bootstrap_queue] deadline``,
    and the decode queues' phases in ``[decode.prealloc]`` / ``[decode.transfer]`` (the
    longest across backends: decode deadlines are not per backend). States without a
    suggestion are left out (they keep their configured deadline)."""
    lines = _prefill_tables(_of_queue(advice, "inflight")) + _bootstrap_table(advice)
    for queue, phases in DECODE_PHASES.items():
        lines += _decode_table(queue, phases, advice)
    return "\n".join(lines)


def _of_queue(advice: Mapping[tuple[str, str], Advice], queue: str) -> dict[str, Advice]:
    """*queue*'s advice per backend, by backend name (in *advice*'s order)."""
    return {b: a for (q, b), a in advice.items() if q == queue}


def _suggestions(state: str, per_backend: Mapping[str, Advice]) -> list[tuple[float, str]]:
    """``(suggested seconds, backend)`` for each backend that has a suggestion for
    *state*."""
    return [
        (s.suggested, b)
        for b, a in per_backend.items()
        if (s := a.states.get(state)) is not None and s.suggested is not None
    ]


def _prefill_tables(inflight: Mapping[str, Advice]) -> list[str]:
    """``[prefill.deadlines]`` for the backend with the most recorded stays (``fake``
    last), ``[prefill.backends.<name>.deadlines]`` for each other."""

    def weight(backend: str) -> tuple[bool, int]:
        return backend != "fake", sum(s.count for s in inflight[backend].states.values())

    lines: list[str] = []
    for n, backend in enumerate(sorted(inflight, key=weight, reverse=True)):
        a = inflight[backend]
        table = "[prefill.deadlines]" if n == 0 else f"[prefill.backends.{backend}.deadlines]"
        lines.append(f"{table}  # {backend}: {_summary(a)}")
        lines += a.toml_lines(_PREFILL_STATES)
        lines.append("")
    return lines


def _bootstrap_table(advice: Mapping[tuple[str, str], Advice]) -> list[str]:
    """``[bootstrap_queue] deadline``: the longest ``Bootstrapping`` suggestion of the
    bootstrap queue across backends (nothing without one)."""
    boot = _suggestions("Bootstrapping", _of_queue(advice, "bootstrap"))
    if not boot:
        return []
    return ["[bootstrap_queue]", f"deadline = {toml_number(max(boot)[0])}", ""]


def _decode_table(
    queue: str, phases: tuple[str, ...], advice: Mapping[tuple[str, str], Advice]
) -> list[str]:
    """``[decode.<queue>]``: the decode deadlines are not per backend, so each phase
    gets the longest suggestion across the backends that have one (a comment names
    it); a phase no backend has a suggestion for is a comment saying why (it keeps its
    configured deadline); nothing when the queue has no stays at all."""
    per_backend = dict(sorted(_of_queue(advice, queue).items()))
    lines = [line for phase in phases if (line := _phase_line(phase, per_backend))]
    if not lines:
        return []
    return [f"[decode.{queue}]  # the longest suggestion across backends", *lines, ""]


def _phase_line(phase: str, per_backend: Mapping[str, Advice]) -> str | None:
    """*phase*'s line of a ``[decode.<queue>]`` table: its longest suggestion across
    backends (*per_backend*), else a comment with the reasons there is none (None: no
    backend has the phase)."""
    found = _suggestions(phase, per_backend)
    if found:
        seconds, backend = max(found)
        return f"{phase} = {toml_number(seconds)}  # {backend}"
    reasons = sorted(
        {s.reason for a in per_backend.values() if (s := a.states.get(phase)) is not None}
    )
    if reasons:
        return f"# {phase}: no suggestion ({'; '.join(str(r) for r in reasons)})"
    return None


def _summary(a: Advice) -> str:
    return f"p{(1 - a.false_timeout_rate) * 100:.6g} x {a.margin:g}, floor {a.floor:g}s, rounded up"


#: The advise command's description (plain text, for ``--help``).
DESCRIPTION = (
    "Suggested deadlines from a server's metrics: reads the time-in-state histogram "
    "stallguard-sglang exports from a Prometheus server's history (--prometheus, "
    "--window), a live /metrics scrape (--url), a saved exposition (--file) or SGLang's "
    "prometheus_client multiprocess directory (--multiproc-dir, "
    "default $PROMETHEUS_MULTIPROC_DIR), applies stallguard.advise per queue and backend "
    "(tensor-parallel ranks summed), and prints a table per backend and a TOML block for "
    "STALLGUARD_SGLANG_CONFIG (docs/advice.md). Exit status 2 on bad input."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The advise command's options, on *parser*."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--prometheus",
        metavar="URL",
        help="a Prometheus server (http://host:9090): its history over --window, every "
        "pod and restart summed",
    )
    source.add_argument("--url", help="scrape this /metrics URL")
    source.add_argument(
        "--file",
        help="a saved exposition: Prometheus text, OpenMetrics (ending # EOF) or /federate output",
    )
    source.add_argument(
        "--multiproc-dir",
        help="prometheus_client multiprocess directory (default: $PROMETHEUS_MULTIPROC_DIR)",
    )
    parser.add_argument(
        "--baseline", help="an earlier saved scrape: flags tails that grew since then"
    )
    parser.add_argument(
        "--false-timeout-rate",
        type=float,
        default=0.001,
        help="the share of healthy stays a suggested deadline may fail, in (0, 0.5] "
        "(default 0.001: the deadline is built on the 99.9th percentile)",
    )
    parser.add_argument(
        "--margin",
        type=float,
        default=2.0,
        help="factor >= 1 applied to that percentile (default 2)",
    )
    parser.add_argument(
        "--floor",
        type=float,
        default=10.0,
        help="never suggest less than this many seconds (default 10)",
    )
    parser.add_argument(
        "--min-samples",
        type=int,
        default=None,
        help="stays a state needs before it gets a suggestion (default: 10 / the rate, rounded up)",
    )
    parser.add_argument(
        "--window",
        default="7d",
        help="with --prometheus: how far back to read (s, m, h, d, w; default 7d)",
    )
    parser.add_argument(
        "--step",
        default=None,
        help="with --prometheus: seconds between samples read (default: window / 1000, at "
        "least 15s; no longer than the scrape interval loses nothing at restarts)",
    )
    parser.add_argument("--toml", action="store_true", help="print only the TOML block")


def main(argv: list[str] | None = None) -> int:
    """The advise command; returns the exit status: 0, or 2 for bad input (bad
    arguments, a source that cannot be read, metrics that cannot be used), with a
    one-line message on stderr."""
    parser = OneLineParser(prog="python -m stallguard_sglang advise", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the advise command on parsed arguments (see :func:`add_arguments`)."""
    try:
        advice = _advise(args)
    except (OSError, ValueError, TypeError, ConfigError) as e:
        print(f"stallguard-sglang advise: {one_line(str(e))}", file=sys.stderr)
        return 2
    except Exception as e:  # not a documented error: still one line, status 2
        print(f"stallguard-sglang advise: cannot advise: {describe_exception(e)}", file=sys.stderr)
        return 2
    if not advice:
        print(
            f"stallguard-sglang advise: no {_stats_export.STATE_SECONDS} series in the "
            "metrics (is the adapter enabled, and SGLang running with --enable-metrics?)",
            file=sys.stderr,
        )
        return 2
    if not args.toml:
        _print_tables(advice, "Prometheus history, pods summed" if args.prometheus else "scrape")
        print("# paste into the file STALLGUARD_SGLANG_CONFIG names:")
    print(toml_block(advice))
    return 0


def _advise(args: argparse.Namespace) -> dict[tuple[str, str], Advice]:
    """The advice for the source and the parameters *args* name."""
    text = read_source(
        url=args.url,
        file=args.file,
        multiproc_dir=_multiproc_dir(args),
        prometheus=args.prometheus,
        window=parse_window(args.window),
        step=None if args.step is None else parse_window(args.step, "--step"),
    )
    baseline = read_source(file=args.baseline) if args.baseline else None
    return advise_text(
        text,
        baseline=baseline,
        false_timeout_rate=args.false_timeout_rate,
        margin=args.margin,
        floor=args.floor,
        min_samples=args.min_samples,
    )


def _multiproc_dir(args: argparse.Namespace) -> str | None:
    """``--multiproc-dir``; without any source option, ``$PROMETHEUS_MULTIPROC_DIR``."""
    given = (args.url, args.file, args.multiproc_dir)
    if all(option is None for option in given) and not args.prometheus:
        return os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    return args.multiproc_dir  # type: ignore[no-any-return]


def _print_tables(advice: Mapping[tuple[str, str], Advice], what: str) -> None:
    """Each queue and backend's advice table; *what* says where the figures came from."""
    for (queue, backend), a in advice.items():
        print(f"== {queue} queue, {backend} (mode: {what}; ranks summed)")
        print(a.table())
        print()
