"""tools/dev.py's command line."""

from __future__ import annotations

import sys

from . import build, locking, runners
from .common import StepError, log
from .envs import ALL, VenvSpec


def usage(doc: str) -> str:
    return doc.split("\n\n")[1]


def plan_command(names: list[str]) -> int:
    """Print every step of building the venvs (all, or those named) and the commands it
    would run; nothing is run or written."""
    by_name = {v.name: v for v in ALL} | {v.name.lstrip("."): v for v in ALL}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise StepError(f"no venv named {unknown}; known: {[v.name for v in ALL]}")
    specs: tuple[VenvSpec, ...] = tuple(by_name[n] for n in names) if names else ALL
    for line in build.plan(specs):
        print(line)
    return 0


def main(argv: list[str], doc: str) -> int:
    """Run the command *argv* (``doc``: tools/dev.py's docstring, the help)."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(doc)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    no_args = {
        "env": runners.env_command,
        "docs": runners.docs_command,
        "env-real-vllm": runners.env_real_vllm_command,
        "lint": runners.lint_command,
    }
    try:
        if cmd in no_args:
            if rest:
                print(f"{cmd} takes no arguments\n{usage(doc)}", file=sys.stderr)
                return 2
            return no_args[cmd]()
        if cmd == "test":
            return runners.test_command(rest)
        if cmd == "demo":
            return runners.demo_command(rest)
        if cmd == "lock":
            return locking.lock_command(rest)
        if cmd == "plan":
            return plan_command(rest)
    except StepError as e:
        log(f"FAILED: {e}")
        return 1
    print(f"unknown command {cmd!r}\n{usage(doc)}", file=sys.stderr)
    return 2
