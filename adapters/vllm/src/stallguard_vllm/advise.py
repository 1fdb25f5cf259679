"""``python -m stallguard_vllm.advise``: suggested phase deadlines from vLLM's metrics.

Reads the time-in-state histogram stallguard-vllm exports on vLLM's ``/metrics``
(``vllm:stallguard_state_seconds``, with the phase deadlines and the forced/reported
counters) from a Prometheus server's history (``--prometheus URL --window 7d``: every
pod, engine and restart in the window summed), a live scrape (``--url``) or a saved
exposition (``--file``: Prometheus text, OpenMetrics or ``/federate`` output), applies
:func:`stallguard.advise` per model, and prints a table and the TOML for the file
``STALLGUARD_VLLM_CONFIG`` names (docs/advice.md).

Exit status: 0 advice printed; 2 bad arguments, a source that cannot be read, or no
stallguard-vllm series in it (one line on stderr).
"""

from __future__ import annotations

import argparse
import http.client
import sys
import time
import urllib.request
from typing import NoReturn

import stallguard
from stallguard import Advice, ConfigError
from stallguard.adapters import (
    describe_exception,
    exposition_from_prometheus,
    parse_window,
    read_prometheus,
    run_console,
)

from ._names import DEADLINE, FORCED_FAILURES, STALLS_REPORTED, STATE_SECONDS

__all__ = ["PROMETHEUS_NAMES", "advise_text", "main", "toml_block"]

#: The metric families read from a Prometheus server.
PROMETHEUS_NAMES = (STATE_SECONDS, DEADLINE, FORCED_FAILURES, STALLS_REPORTED)
#: TOML keys of the phases (stallguard-vllm's file format, docs/vllm.md)
_KEYS = {
    "Queued": "queued",
    "Receiving": "receiving",
    "AbortedHeld": "aborted_held",
    "HeldForRead": "held_for_read",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


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


def _toml_number(seconds: float) -> str:
    return str(int(seconds)) if seconds == int(seconds) else repr(seconds)


def toml_block(advice: Advice) -> str:
    """One model's suggestions as stallguard-vllm's TOML (phases without one left out)."""
    lines = []
    for state, key in _KEYS.items():
        s = advice.states.get(state)
        if s is None:
            continue
        if s.suggested is None:
            lines.append(f"# {key}: no suggestion ({s.reason})")
        else:
            lines.append(f"{key} = {_toml_number(s.suggested)}")
    return "\n".join(lines) + "\n"


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
        try:
            with urllib.request.urlopen(args.url, timeout=10) as response:
                return str(response.read().decode("utf-8"))
        except (OSError, ValueError, http.client.HTTPException) as e:
            raise ValueError(
                f"--url {args.url!r}: cannot scrape it: {describe_exception(e)}"
            ) from None
    try:
        with open(args.file, encoding="utf-8") as f:
            return f.read()
    except (OSError, ValueError) as e:
        raise ValueError(f"--file {args.file!r}: cannot read it: {describe_exception(e)}") from None


def main(argv: list[str] | None = None) -> int:
    """The advise command; returns the exit status (see the module docstring)."""
    parser = _Parser(
        prog="python -m stallguard_vllm.advise",
        description="Suggested phase deadlines from stallguard-vllm's time-in-state "
        "metrics (docs/advice.md).",
        epilog="exit status: 0 advice printed, 2 bad arguments or input",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prometheus", metavar="URL", help="a Prometheus server's URL")
    source.add_argument("--url", help="scrape this /metrics URL")
    source.add_argument("--file", help="a saved exposition (text, OpenMetrics, /federate)")
    parser.add_argument("--window", default="7d", help="with --prometheus (default 7d)")
    parser.add_argument("--step", default=None, help="with --prometheus: sample spacing")
    parser.add_argument(
        "--false-timeout-rate", type=float, default=0.001, help="in (0, 0.5] (default 0.001)"
    )
    parser.add_argument("--margin", type=float, default=2.0, help=">= 1 (default 2)")
    parser.add_argument("--floor", type=float, default=10.0, help="seconds (default 10)")
    parser.add_argument("--min-samples", type=int, default=None, help="stays needed per phase")
    parser.add_argument("--toml", action="store_true", help="print only the TOML")
    args = parser.parse_args(argv)
    try:
        advice = advise_text(
            _read(args),
            false_timeout_rate=args.false_timeout_rate,
            margin=args.margin,
            floor=args.floor,
            min_samples=args.min_samples,
        )
    except (OSError, ValueError, TypeError, ConfigError) as e:
        print(f"stallguard-vllm advise: {' '.join(str(e).split())}", file=sys.stderr)
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
            print(f"== model {model or '(no model_name)'} (engines and pods summed)")
            print(a.table())
            print()
            print("# paste into the file STALLGUARD_VLLM_CONFIG names:")
        print(toml_block(a))
    return 0


if __name__ == "__main__":
    sys.exit(run_console(main, None))
