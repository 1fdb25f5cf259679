"""``python -m stallguard_vllm`` (installed as the ``stallguard-vllm`` command too):
validate a configuration (``--config``, else the one the environment names) and print
the coverage table (what vLLM bounds on its own, what stallguard adds), without starting
vLLM. Exit status:

* 0: the configuration is valid and the installed vLLM is supported;
* 2: bad input: an invalid configuration, or bad arguments (a one-line message);
* 3: vLLM is not installed here (the table is still printed);
* 4: the installed vLLM is outside the supported range.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from stallguard import ConfigError
from stallguard._adapters import run_console, version_action, versions_line
from stallguard._validate import seconds_or_problem

from ._config import ENV_CONFIG, ENV_ENABLE, connector_config
from ._coverage import coverage_rows, format_coverage
from .package import SUPPORTED_VLLM, is_supported, vllm_version

EXIT_OK = 0
EXIT_USAGE = 2  # also argparse's own status for bad arguments
EXIT_VLLM_MISSING = 3
EXIT_UNSUPPORTED = 4


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


def _versions() -> str:
    return versions_line("stallguard-vllm", "vllm", "vLLM", SUPPORTED_VLLM)


_VersionAction = version_action(lambda: _versions())


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (see the module docstring)."""
    parser = _Parser(
        prog="python -m stallguard_vllm",
        description="Validate stallguard-vllm's configuration and print the coverage "
        "table (what vLLM bounds on its own, what stallguard adds), without starting vLLM.",
        epilog="exit status: 0 valid and supported, 2 bad configuration or arguments, "
        "3 vLLM not installed, 4 vLLM outside the supported range",
    )
    parser.add_argument(
        "--config",
        metavar="PATH",
        help=f"validate this TOML file (default: what {ENV_CONFIG} / {ENV_ENABLE} ask for)",
    )
    parser.add_argument("--version", action=_VersionAction)
    parser.add_argument(
        "--transfer",
        action="append",
        choices=("pull", "push", "mooncake", "generic"),
        help="only this connector's rows: NIXL pull or push, Mooncake, or a connector "
        "stallguard has no refinement for (repeatable; default: every one)",
    )
    parser.add_argument(
        "--lease", type=_seconds, help="the prefill's kv_lease_duration (default: vLLM's 30 s)"
    )
    args = parser.parse_args(argv)
    try:
        config = connector_config({ENV_CONFIG: args.config} if args.config is not None else None)
    except ConfigError as e:  # (connector_config turns every failure into one)
        print(f"stallguard-vllm: invalid configuration: {e}", file=sys.stderr)
        return EXIT_USAGE
    version = vllm_version()
    support = "supported" if version and is_supported(version) else "NOT supported"
    print(f"config: {config.source} (set {ENV_CONFIG}=<file.toml>; {ENV_ENABLE}=0 disables)")
    print(f"vLLM: {version or 'not installed'} ({support}; supported {SUPPORTED_VLLM})")
    print(f"mode: {config.mode}")
    rows = coverage_rows(
        config, lease=args.lease, modes=args.transfer or ("pull", "push", "mooncake", "generic")
    )
    print(format_coverage(rows))
    if version is None:
        print("stallguard-vllm: vLLM is not installed here", file=sys.stderr)
        return EXIT_VLLM_MISSING
    if not is_supported(version):
        print(
            f"stallguard-vllm: vLLM {version} is outside the supported range {SUPPORTED_VLLM}",
            file=sys.stderr,
        )
        return EXIT_UNSUPPORTED
    return EXIT_OK


def console(argv: list[str] | None = None) -> int:
    """:func:`main` for a command line (the ``stallguard-vllm`` script): quiet on a
    closed pipe (exit status 1)."""
    return run_console(main, argv)


if __name__ == "__main__":
    sys.exit(console())
