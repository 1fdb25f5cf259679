"""`test`'s last phase: the core tests again, against the compiled core.

The optional accelerator (hatch_build.py: mypyc compiles stallguard/_fifo.py and
stallguard/_core.py) is built into ``build/compiled/`` (a copy of the package with the
extension modules beside the sources, what a compiled wheel installs) by .venv's
python, and :data:`CORE_TESTS` run a second time with ``STALLGUARD_TEST_COMPILED``
naming it (the root conftest.py puts it first on the path; tests/test_compiled.py fails
if the sources run instead). The build is a keyed step like `env`'s: its key (the
package's files, hatch_build.py, the interpreter, mypy's version) is stamped in the
build directory and an unchanged key skips it (~40-60 s when it runs). Without a C
compiler it says so and is skipped: the suite has run on the sources already.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig

from .common import ROOT, VENV, Stamps, StepError, log, sha, venv_python

BUILD = ROOT / "build" / "compiled"
STEP = "compiled core (mypyc)"
#: the core tests (533), 0.5-2 min on 2 cores compiled (not the real engines, servers,
#: examples, docs, packaging or typing: they test no more of the core)
CORE_TESTS = [
    "tests/test_compiled.py",
    "tests/test_watchdog.py",
    "tests/test_watchdog_young.py",
    "tests/test_watchdog_time.py",
    "tests/test_watchdog_delivery.py",
    "tests/test_stateful.py",
    "tests/test_properties.py",
    "tests/test_threads.py",
    "tests/test_hardening.py",
    "tests/test_guard.py",
    "tests/test_runners.py",
    "tests/test_runner_failures.py",
    "tests/test_withdraw.py",
    "tests/test_expiry_counts.py",
    "tests/test_stats.py",
    "tests/test_describe.py",
    "tests/test_transitions.py",
    "tests/test_transitions_weak.py",
    "tests/test_quarantine.py",
    "tests/test_instrumentation.py",
    "tests/test_otel_metrics.py",
    "tests/test_otel_spans.py",
    "tests/test_config.py",
    "tests/test_config_edges.py",
    "tests/test_spec.py",
    "tests/test_adapter_kit.py",
    "tests/test_testing_freeze.py",
    "tests/test_advice.py",
]
#: pytest's marker selection of the phase (the slow and the timing-sensitive tests ran
#: on the sources; the real engines are not the core)
MARKERS = "not alone and not slow and not sglang and not vllm and not engines"


def inputs() -> list[object]:
    """What the build depends on: every file of the package, the build script."""
    files = sorted(p for p in (ROOT / "stallguard").rglob("*") if p.is_file())
    return [p for p in files if "__pycache__" not in p.parts] + [ROOT / "hatch_build.py"]


def compiler() -> str | None:
    """The C compiler the build would use, or None if there is none."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(os.environ.get("CC", cc).split()[0])


def build() -> bool:
    """Build (or keep) ``build/compiled``; False when it cannot be built here."""
    py = venv_python(VENV)
    if compiler() is None:
        log(f"{STEP}: no C compiler on this machine: the compiled core is not tested")
        return False
    mypy = subprocess.run(
        [str(py), "-c", "import mypy.version; print(mypy.version.__version__)"],
        capture_output=True,
        text=True,
    )
    if mypy.returncode:
        log(f"{STEP}: .venv has no mypy (mypyc): the compiled core is not tested")
        return False
    key = sha(*inputs(), mypy.stdout.strip(), str(py.resolve()))
    stamps = Stamps(BUILD)
    if stamps.fresh(STEP, key) and (BUILD / "stallguard" / "__init__.py").is_file():
        return True
    log(f"{STEP}: building {BUILD.relative_to(ROOT)} ...")
    done = subprocess.run(
        [str(py), str(ROOT / "hatch_build.py"), "--out", str(BUILD)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise StepError(f"{STEP}: the build failed:\n{done.stdout}{done.stderr}")
    Stamps(BUILD).record(STEP, key)  # (a new directory: the build replaced it)
    built = [line for line in done.stdout.splitlines() if line.endswith((".so", ".pyd"))]
    log(f"{STEP}: built {len(built)} extension modules")
    return True


def wanted(args: list[str], environ: dict[str, str] | None = None) -> bool:
    """Whether `test` runs the compiled phase: for the whole suite (no arguments), or
    when STALLGUARD_TEST_COMPILED_PHASE=1; never when it is 0."""
    environ = os.environ if environ is None else environ
    forced = environ.get("STALLGUARD_TEST_COMPILED_PHASE", "")
    if forced in ("0", "1"):
        return forced == "1"
    return not args


def phase(workers: list[str]) -> tuple[list[str], dict[str, str]]:
    """The pytest arguments and the environment of the compiled run."""
    env = {**os.environ, "STALLGUARD_TEST_COMPILED": str(BUILD), "PYTHONSAFEPATH": "1"}
    env.pop("STALLGUARD_PURE", None)
    args = ["--durations=10", *workers, "-p", "no:cacheprovider", "-m", MARKERS, *CORE_TESTS]
    return args, env


def run(workers: list[str]) -> int | None:
    """Build, then run the phase; None when it cannot run here (said why)."""
    if not build():
        return None
    args, env = phase(workers)
    cmd = [str(venv_python(VENV)), "-m", "pytest", *args]
    log("test (compiled core): " + " ".join(cmd))
    return subprocess.call(cmd, cwd=ROOT, env=env)


__all__ = ["BUILD", "CORE_TESTS", "build", "phase", "run", "wanted"]
