"""``python -m stallguard_sglang``: validate the adapter's configuration and print the
support tables, prefill and decode (what SGLang bounds on its own, what stallguard
enforces), without starting SGLang.

The configuration is the file ``--config`` names, else what the environment asks for
(``STALLGUARD_SGLANG_CONFIG`` / ``STALLGUARD_SGLANG``). Exit status:

* 0: the configuration is valid and the installed SGLang is supported;
* 1: the adapter is disabled (no ``--config``, and neither variable enables it);
* 2: bad input: an invalid configuration, or bad arguments (a one-line message);
* 3: SGLang is not installed here and ``--sglang-version`` does not name a release (the
  table is still printed);
* 4: the SGLang release (installed, or given with ``--sglang-version``) is outside the
  supported range.

``python -m stallguard_sglang advise ...`` suggests deadlines from a server's metrics
(``--help`` lists its options; docs/advice.md). Installed as the ``stallguard-sglang``
command too.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

from stallguard import ConfigError
from stallguard.adapters import OneLineParser, one_line, run_console, version_action

from ._config import BACKENDS, ENV_CONFIG, ENV_ENABLE, ENV_PREFIX, load_config
from ._profiles import decode_support_table, format_support_table, support_table
from .package import SUPPORTED_SGLANG, is_supported, parse_version, sglang_version, support

__all__ = [
    "OneLineParser",
    "EXIT_DISABLED",
    "EXIT_OK",
    "EXIT_SGLANG_MISSING",
    "EXIT_UNSUPPORTED",
    "EXIT_USAGE",
    "console",
    "main",
    "one_line",
]

EXIT_OK = 0
EXIT_DISABLED = 1
EXIT_USAGE = 2  # also argparse's own status for bad arguments
EXIT_SGLANG_MISSING = 3
EXIT_UNSUPPORTED = 4


def _version_arg(text: str) -> str:
    try:
        parse_version(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a PEP 440 version number (e.g. 0.5.23)"
        ) from None
    return text


_VersionAction = version_action(lambda: support().versions_line("stallguard-sglang"))


def _environment(path: str | None) -> Mapping[str, str] | None:
    """The environment to validate: the process's, or with ``--config`` that file with
    the process's ``STALLGUARD_SGLANG_*`` overrides (not its enable switch)."""
    if path is None:
        return None
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
    env[ENV_CONFIG] = path
    return env


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (see the module docstring)."""
    from . import _advise

    args = _parser().parse_args(argv)
    if args.command == "advise":
        return _advise.run(args)
    return _check(args)


def _parser() -> argparse.ArgumentParser:
    """The command line's parser, with the ``advise`` command."""
    from . import _advise

    parser = OneLineParser(
        prog="python -m stallguard_sglang",
        description="Validate stallguard-sglang's configuration and print the support "
        "tables, prefill and decode (what SGLang bounds on its own, what stallguard "
        "enforces), without starting SGLang.",
        epilog="exit status: 0 valid and supported, 1 disabled, 2 bad configuration or "
        "arguments, 3 SGLang not installed, 4 SGLang outside the supported range",
    )
    commands = parser.add_subparsers(
        dest="command",
        metavar="COMMAND",
        title="commands",
        description="without a command: validate the configuration and print the tables",
        parser_class=OneLineParser,
    )
    advise = commands.add_parser(
        "advise",
        help="suggest deadlines from a server's metrics (docs/advice.md)",
        description=_advise.DESCRIPTION,
    )
    _advise.add_arguments(advise)
    parser.add_argument(
        "--config",
        metavar="PATH",
        help=f"validate this TOML file, with the {ENV_PREFIX}* overrides of the environment "
        f"(default: what {ENV_CONFIG} / {ENV_ENABLE} ask for)",
    )
    parser.add_argument(
        "--backend",
        action="append",
        choices=BACKENDS,
        help="only these backends (repeatable; default: all)",
    )
    parser.add_argument(
        "--sglang-version",
        type=_version_arg,
        help="assume this SGLang release (default: the installed one)",
    )
    parser.add_argument("--version", action=_VersionAction)
    return parser


def _check(args: argparse.Namespace) -> int:
    """Validate the configuration, print the support tables; the exit status."""
    try:
        config = load_config(_environment(args.config))
    except ConfigError as e:  # (load_config turns every failure into one)
        print(f"stallguard-sglang: invalid configuration: {one_line(str(e))}", file=sys.stderr)
        return EXIT_USAGE
    if config is None:
        print(f"stallguard-sglang is disabled: set {ENV_CONFIG}=<file.toml> or {ENV_ENABLE}=1")
        return EXIT_DISABLED
    installed = sglang_version()
    version = args.sglang_version or installed
    supported = _supported(version)
    print(f"config: {config.source}")
    support = "supported" if supported else "NOT supported"
    print(f"SGLang: {version or 'not installed'} ({support}; supported {SUPPORTED_SGLANG})")
    rows = support_table(config, args.backend or list(BACKENDS), version=version)
    print(format_support_table(rows, version=version))
    print()
    print("decode queues (every backend; phases as in SGLang 0.5.23):")
    print(format_support_table(decode_support_table(config), version=version, second="policy"))
    return _status(version, supported)


def _supported(version: str | None) -> bool:
    """Whether SGLang *version* is in the supported range (not when unknown)."""
    try:
        return version is not None and is_supported(version)
    except ValueError:  # an installed SGLang whose version is not PEP 440
        return False


def _status(version: str | None, supported: bool) -> int:
    """The exit status for SGLang *version*, saying on stderr what is wrong with it."""
    if version is None:
        print("stallguard-sglang: SGLang is not installed here", file=sys.stderr)
        return EXIT_SGLANG_MISSING
    if not supported:
        print(
            f"stallguard-sglang: SGLang {version} is outside the supported range "
            f"{SUPPORTED_SGLANG}",
            file=sys.stderr,
        )
        return EXIT_UNSUPPORTED
    return EXIT_OK


def console(argv: list[str] | None = None) -> int:
    """:func:`main` for a command line (the ``stallguard-sglang`` script): quiet on a
    closed pipe (exit status 1)."""
    return run_console(main, argv)


if __name__ == "__main__":
    sys.exit(console())
