"""``python -m stallguard_vllm``: validate the configuration the environment names and
print the coverage table (what vLLM bounds on its own, what stallguard adds), without
starting vLLM. Exit status 2 on a bad configuration or bad arguments, with a one-line
message."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from stallguard import ConfigError
from stallguard._validate import seconds_or_problem

from ._config import ENV_CONFIG, ENV_ENABLE, connector_config
from ._coverage import coverage_rows, format_coverage
from .package import SUPPORTED_VLLM, is_supported, vllm_version

EXIT_USAGE = 2  # also argparse's own status for bad arguments


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line on stderr (no usage dump), exit status 2."""
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    seconds = seconds_or_problem(value)
    if isinstance(seconds, str):
        raise argparse.ArgumentTypeError(
            f"{text[:40]!r} is not a positive, finite number of seconds"
        )
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m stallguard_vllm", description=__doc__)
    parser.add_argument(
        "--transfer",
        action="append",
        choices=("pull", "push"),
        help="only this NIXL transfer mode (repeatable; default: both)",
    )
    parser.add_argument(
        "--lease", type=_seconds, help="the prefill's kv_lease_duration (default: vLLM's 30 s)"
    )
    args = parser.parse_args(argv)
    try:
        config = connector_config()
    except ConfigError as e:  # (connector_config turns every failure into one)
        print(f"stallguard-vllm: invalid configuration: {e}", file=sys.stderr)
        return EXIT_USAGE
    version = vllm_version()
    support = "supported" if version and is_supported(version) else "NOT supported"
    print(f"config: {config.source} (set {ENV_CONFIG}=<file.toml>; {ENV_ENABLE}=0 disables)")
    print(f"vLLM: {version or 'not installed'} ({support}; supported {SUPPORTED_VLLM})")
    print(f"mode: {config.mode}")
    rows = coverage_rows(config, lease=args.lease, modes=args.transfer or ("pull", "push"))
    print(format_coverage(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
