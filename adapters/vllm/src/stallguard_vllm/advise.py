"""``python -m stallguard_vllm advise`` (also ``stallguard-vllm advise``, and the 0.1
spelling ``python -m stallguard_vllm.advise``): suggested phase deadlines from vLLM's
metrics.

Reads the time-in-state histogram stallguard-vllm exports on vLLM's ``/metrics``
(``vllm:stallguard_state_seconds``, with the phase deadlines and the forced/reported
counters) from a Prometheus server's history (``--prometheus URL --window 7d``: every
pod, engine and restart in the window summed), a live scrape (``--url``) or a saved
exposition (``--file``: Prometheus text, OpenMetrics or ``/federate`` output), applies
:func:`stallguard.advise` per model, and prints a table and the TOML for the file
``STALLGUARD_VLLM_CONFIG`` names (docs/advice.md).

Exit status: 0 advice printed; 2 bad arguments (the message names the option and the
value), a source that cannot be read, or no stallguard-vllm series in it (one line on
stderr).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import stallguard
from stallguard import Advice, ConfigError, Statistics
from stallguard.adapters import (
    OneLineParser,
    describe_exception,
    exposition_from_prometheus,
    one_line,
    parse_window,
    printable,
    read_exposition_file,
    read_prometheus,
    run_console,
    scrape_exposition,
    shorten,
)

from ._names import DEADLINE, FORCED_FAILURES, STALLS_REPORTED, STATE_SECONDS

__all__ = [
    "DESCRIPTION",
    "PROMETHEUS_NAMES",
    "add_arguments",
    "advise_text",
    "main",
    "run",
    "toml_block",
]

#: The metric families read from a Prometheus server.
PROMETHEUS_NAMES = (STATE_SECONDS, DEADLINE, FORCED_FAILURES, STALLS_REPORTED)
#: The advised phases, by table of stallguard-vllm's file (docs/vllm.md); the file's
#: keys are the phase names
_TABLES = {"decode": ("Queued", "Receiving", "AbortedHeld"), "prefill": ("HeldForRead",)}


def _models(text: str) -> list[str]:
    return sorted(
        {
            labels.get("model_name", "")
            for name, labels, _ in read_prometheus(text)
            if name == f"{STATE_SECONDS}_bucket"
        }
    )


def advise_text(text: str, **kwargs: object) -> dict[str, Advice]:
    """Advice per ``model_name`` found in *text* (engines, pods summed; *kwargs*:
    :func:`stallguard.advise`'s)."""
    fired = STALLS_REPORTED if f"{STALLS_REPORTED}_total" in text else FORCED_FAILURES
    out: dict[str, Advice] = {}
    for model in _models(text):
        stats = stallguard.statistics_from_prometheus(
            text,
            histogram=STATE_SECONDS,
            spec=f"vllm.{model}",
            where={"model_name": model},
            deadline_gauge=DEADLINE,
            fired_counter=fired,
        )
        out[model] = stallguard.advise(stats, **kwargs)  # type: ignore[arg-type]
    return out


def toml_block(advice: Advice) -> str:
    """One model's suggestions as stallguard-vllm's TOML file (``[decode]``,
    ``[prefill]``), what :func:`stallguard_vllm.parse_config` reads; a phase without a
    suggestion is a comment saying why (it keeps its configured deadline), a table
    without any phase is left out (:meth:`stallguard.Advice.toml_lines`)."""
    lines = []
    for table, phases in _TABLES.items():
        body = advice.toml_lines(phases)
        if body:
            lines += [f"[{table}]", *body, ""]
    return "\n".join(lines)


def _read(args: argparse.Namespace) -> str:
    if args.prometheus is not None:
        step = None if args.step is None else parse_window(args.step, "--step")
        return exposition_from_prometheus(
            args.prometheus,
            PROMETHEUS_NAMES,
            window=parse_window(args.window),
            step=step,
            end=time.time(),
        )
    if args.url is not None:
        return scrape_exposition(args.url)
    return read_exposition_file(args.file)


#: The advise command's description (plain text, for ``--help``).
DESCRIPTION = (
    "Suggested phase deadlines from stallguard-vllm's time-in-state metrics: reads "
    "vllm:stallguard_state_seconds from a Prometheus server's history (--prometheus, "
    "--window: every pod, engine and restart summed), a live /metrics scrape (--url) or "
    "a saved exposition (--file), applies stallguard.advise per model, and prints a "
    "table and a TOML block for STALLGUARD_VLLM_CONFIG (docs/advice.md). Exit status 2 "
    "on bad input."
)

#: what the options are checked against (stallguard.advise's own checks)
_NO_STATS = Statistics(spec="stallguard-vllm advise", mode=None, states={})


def _advise_arg(key: str, convert: Callable[[str], float], kind: str) -> Callable[[str], float]:
    """An argparse ``type=`` for :func:`stallguard.advise`'s *key*, checked by advise
    itself at parse time: a bad value is an error naming the option and the value."""

    def parse(text: str) -> float:
        shown = printable(shorten(repr(text), 40))
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shown} is not {kind}") from None
        try:
            stallguard.advise(_NO_STATS, **{key: value})  # type: ignore[arg-type]
        except (ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(f"{shown}: {e}") from None
        return value

    return parse


#: the sources (one of them): option, metavar, help
_SOURCES = (
    (
        "--prometheus",
        "URL",
        "a Prometheus server (http://host:9090): its history over --window, every pod, "
        "engine and restart summed",
    ),
    ("--url", "URL", "scrape this /metrics URL (vLLM's API server)"),
    (
        "--file",
        "PATH",
        "a saved exposition: Prometheus text, OpenMetrics (ending # EOF) or /federate output",
    ),
)
#: stallguard.advise's parameters: option, metavar, default, its type and name, help
_RULE = (
    (
        "--false-timeout-rate",
        "RATE",
        0.001,
        float,
        "a number",
        "the share of healthy stays a suggested deadline may fail, in (0, 0.5] (default "
        "0.001: the deadline is built on the 99.9th percentile)",
    ),
    ("--margin", "FACTOR", 2.0, float, "a number", "factor >= 1 applied to that percentile"),
    ("--floor", "SECONDS", 10.0, float, "a number", "the shortest deadline to suggest, seconds"),
    (
        "--min-samples",
        "N",
        None,
        int,
        "an integer",
        "stays a phase needs before it gets a suggestion (default: 10 / the rate, rounded up)",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The advise command's options, on *parser*."""
    source = parser.add_mutually_exclusive_group(required=True)
    for option, metavar, text in _SOURCES:
        source.add_argument(option, metavar=metavar, help=text)
    parser.add_argument(
        "--window",
        metavar="DURATION",
        default="7d",
        help="with --prometheus: how far back to read (s, m, h, d, w; default 7d)",
    )
    parser.add_argument(
        "--step",
        metavar="DURATION",
        help="with --prometheus: seconds between samples read (default: window / 1000, at "
        "least 15s; no longer than the scrape interval loses nothing at restarts)",
    )
    for option, metavar, default, convert, kind, text in _RULE:
        parse = _advise_arg(option[2:].replace("-", "_"), convert, kind)
        if default is not None and "(default" not in text:
            text += f" (default {default:g})"
        parser.add_argument(option, metavar=metavar, type=parse, default=default, help=text)
    parser.add_argument("--toml", action="store_true", help="print only the TOML")


def main(argv: list[str] | None = None) -> int:
    """The advise command on its own (``python -m stallguard_vllm.advise``); returns
    the exit status (see the module docstring)."""
    parser = OneLineParser(
        prog="python -m stallguard_vllm advise",
        description=DESCRIPTION,
        epilog="exit status: 0 advice printed, 2 bad arguments or input",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the advise command on parsed arguments (see :func:`add_arguments`)."""
    try:
        advice = advise_text(
            _read(args),
            false_timeout_rate=args.false_timeout_rate,
            margin=args.margin,
            floor=args.floor,
            min_samples=args.min_samples,
        )
    except (OSError, ValueError, TypeError, ConfigError) as e:
        print(f"stallguard-vllm advise: {printable(one_line(str(e)))}", file=sys.stderr)
        return 2
    except Exception as e:  # not a documented error: still one line, status 2
        print(f"stallguard-vllm advise: cannot advise: {describe_exception(e)}", file=sys.stderr)
        return 2
    if not advice:
        print(
            f"stallguard-vllm advise: no {STATE_SECONDS} series in the metrics (is the "
            "stallguard connector configured?)",
            file=sys.stderr,
        )
        return 2
    for model, a in advice.items():
        if not args.toml:
            _print_table(model, a)
        print(toml_block(a))
    return 0


def _print_table(model: str, advice: Advice) -> None:
    """*model*'s advice table, and the line introducing its TOML block."""
    print(f"== model {model or '(no model_name)'} (engines and pods summed)")
    print(advice.table())
    print()
    print("# paste into the file STALLGUARD_VLLM_CONFIG names:")


if __name__ == "__main__":
    sys.exit(run_console(main, None))
