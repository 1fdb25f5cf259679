"""``python -m stallguard_vllm`` (installed as the ``stallguard-vllm`` command too):
validate a configuration (``--config``, else the one the environment names) and print
the coverage table (what vLLM bounds on its own, what stallguard adds), without starting
vLLM. Exit status:

* 0: the configuration is valid and the installed vLLM is supported;
* 2: bad input: an invalid configuration, or bad arguments (a one-line message);
* 3: vLLM is not installed here (the table is still printed);
* 4: the installed vLLM is outside the supported range.

``python -m stallguard_vllm advise ...`` suggests phase deadlines from vLLM's metrics
(``--help`` lists its options; :mod:`stallguard_vllm.advise`, docs/advice.md).
"""

from __future__ import annotations

import argparse
import sys

from stallguard import ConfigError
from stallguard.adapters import OneLineParser, run_console, seconds_arg, version_action

from ._config import ENV_CONFIG, ENV_ENABLE, connector_config
from ._coverage import coverage_rows, format_coverage
from .package import SUPPORT, SUPPORTED_VLLM, is_supported, vllm_version

EXIT_OK = 0
EXIT_USAGE = 2  # also argparse's own status for bad arguments
EXIT_VLLM_MISSING = 3
EXIT_UNSUPPORTED = 4


_VersionAction = version_action(lambda: SUPPORT.versions_line("stallguard-vllm"))


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (see the module docstring)."""
    from . import advise as _advise

    args = _parser().parse_args(argv)
    if args.command == "advise":
        return _advise.run(args)
    return _check(args)


def _parser() -> argparse.ArgumentParser:
    """The command line's parser, with the ``advise`` command."""
    from . import advise as _advise

    parser = OneLineParser(
        prog="python -m stallguard_vllm",
        description="Validate stallguard-vllm's configuration and print the coverage "
        "table (what vLLM bounds on its own, what stallguard adds), without starting vLLM.",
        epilog="exit status: 0 valid and supported, 2 bad configuration or arguments, "
        "3 vLLM not installed, 4 vLLM outside the supported range",
    )
    # (without a command: validate the configuration and print the table)
    commands = parser.add_subparsers(dest="command", title="commands", parser_class=OneLineParser)
    advise = "suggest phase deadlines from vLLM's metrics (docs/advice.md)"
    _advise.add_arguments(
        commands.add_parser("advise", help=advise, description=_advise.DESCRIPTION)
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
        "--lease", type=seconds_arg, help="the prefill's kv_lease_duration (default: vLLM's 30 s)"
    )
    return parser


def _check(args: argparse.Namespace) -> int:
    """Validate the configuration, print the coverage table; the exit status."""
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
    return _status(version)


def _status(version: str | None) -> int:
    """The exit status for vLLM *version*, saying on stderr what is wrong with it."""
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
