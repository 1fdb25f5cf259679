"""``python -m stallguard_sglang``: validate the configuration the environment names and
print the support tables, prefill and decode (what SGLang bounds on its own, what
stallguard enforces), without
starting SGLang. Exit status 2 on a bad configuration, 1 if the adapter is disabled."""

from __future__ import annotations

import argparse
import sys

from stallguard import ConfigError

from ._config import BACKENDS, ENV_CONFIG, ENV_ENABLE, load_config
from ._profiles import decode_support_table, format_support_table, support_table
from .package import SUPPORTED_SGLANG, is_supported, sglang_version


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stallguard_sglang", description=__doc__)
    parser.add_argument(
        "--backend",
        action="append",
        choices=BACKENDS,
        help="only these backends (repeatable; default: all)",
    )
    parser.add_argument(
        "--sglang-version", help="assume this SGLang release (default: the installed one)"
    )
    args = parser.parse_args(argv)
    try:
        config = load_config()
    except ConfigError as e:
        print(f"stallguard-sglang: invalid configuration: {e}", file=sys.stderr)
        return 2
    if config is None:
        print(f"stallguard-sglang is disabled: set {ENV_CONFIG}=<file.toml> or {ENV_ENABLE}=1")
        return 1
    version = args.sglang_version or sglang_version()
    print(f"config: {config.source}")
    support = "supported" if version and is_supported(version) else "NOT supported"
    print(f"SGLang: {version or 'not installed'} ({support}; supported {SUPPORTED_SGLANG})")
    rows = support_table(config, args.backend or BACKENDS, version=version)
    print(format_support_table(rows, version=version))
    print()
    print("decode queues (every backend):")
    print(format_support_table(decode_support_table(config), version="0.5.23", second="policy"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
