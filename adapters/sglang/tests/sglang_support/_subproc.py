"""Run a module-level function under another interpreter (e.g. .venv-sglang0517's).

The child runs `python -m sglang_support._runner IN OUT`: it unpickles
("module:function", args, kwargs) from IN, calls it, and pickles ("ok", result) or
("err", traceback) to OUT. Arguments and results must be plain picklable data that
both interpreters can load. sglang_support is importable there through the
`_stallguard_dev.pth` that tools/dev.py writes into both venvs.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from ._env import SUPPORT_ROOT

__all__ = ["ScriptResult", "SubprocessError", "run_in_python", "run_scripts"]


class SubprocessError(RuntimeError):
    """The function raised in the child, the child crashed, or it timed out."""


def _call_child(
    python: str | os.PathLike,
    module: str,
    request: object,
    what: str,
    timeout: float,
    env: dict[str, str] | None,
) -> Any:
    """Run `python -m module IN OUT` with *request* pickled in IN; return what the child
    pickled to OUT. Raises SubprocessError (*what* names the call) on a timeout or when
    the child left no result."""
    with tempfile.TemporaryDirectory(prefix="sglang-support-") as tmp:
        inp, out = Path(tmp, "in.pickle"), Path(tmp, "out.pickle")
        inp.write_bytes(pickle.dumps(request))
        full_env = dict(os.environ)
        full_env.update(env or {})
        # the child imports sglang_support (its runner) from where this copy lives
        pythonpath = full_env.get("PYTHONPATH")
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SUPPORT_ROOT), pythonpath]))
        cmd = [str(python), "-m", module, str(inp), str(out)]
        try:
            proc = subprocess.run(
                cmd,
                cwd=SUPPORT_ROOT,
                env=full_env,
                capture_output=True,
                text=True,
                timeout=timeout,
                errors="replace",
            )
        except subprocess.TimeoutExpired as e:
            tail = (e.stderr or "")[-4000:] if isinstance(e.stderr, str) else ""
            raise SubprocessError(
                f"{what} under {python} did not finish within {timeout}s "
                f"(killed)\n--- stderr tail:\n{tail}"
            ) from None
        output = f"--- stdout tail:\n{proc.stdout[-3000:]}\n--- stderr tail:\n{proc.stderr[-6000:]}"
        if not out.exists():
            raise SubprocessError(
                f"{what} under {python} exited {proc.returncode} without a result\n{output}"
            )
        return pickle.loads(out.read_bytes()), output


def run_in_python(
    python: str | os.PathLike,
    target: str,
    *,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> Any:
    """Call `target` ("package.module:function") with `args`/`kwargs` in a fresh
    `python` process and return its result. Raises SubprocessError with the child's
    traceback and output tail on failure, or after killing it at `timeout` seconds."""
    if ":" not in target:
        raise ValueError(f"target must be 'module:function', got {target!r}")
    request = (target, tuple(args), dict(kwargs or {}))
    (status, payload), output = _call_child(
        python, "sglang_support._runner", request, target, timeout, env
    )
    if status != "ok":
        raise SubprocessError(f"{target} under {python} raised:\n{payload}\n{output}")
    return payload


class ScriptResult(NamedTuple):
    """What one script of `run_scripts` left: as `subprocess.run` would report it."""

    returncode: int
    stdout: str
    stderr: str


def run_scripts(
    python: str | os.PathLike,
    scripts: list[tuple[dict[str, str | None], str]],
    *,
    preload: tuple[str, ...] = (),
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[ScriptResult]:
    """Run each ``(env changes, code)`` of *scripts* as ``python -c code`` would, each in
    its own process forked from one fresh `python` that imported *preload* first (so a
    heavy import, SGLang's scheduler module at 10-40 s, is paid once, not per script).
    A value of None in a script's env removes that variable. The scripts run one after
    the other; their order is kept. Raises SubprocessError if the forking parent fails
    or takes over `timeout` seconds in all."""
    request = (tuple(preload), list(scripts))
    what = f"{len(scripts)} forked scripts"
    results, _ = _call_child(python, "sglang_support._forker", request, what, timeout, env)
    return [ScriptResult(*r) for r in results]
