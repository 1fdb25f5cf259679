"""The one builder: :func:`build` makes any :class:`~devlib.envs.VenvSpec` real, step by
step, each step skipped when its key (a hash of its inputs) is the one stamped in the
venv; :func:`env_command` builds what `tools/dev.py env` promises."""

from __future__ import annotations

import fcntl
import sys
import time
from collections.abc import Callable
from pathlib import Path

from . import common, locking, system
from .common import (
    ROOT,
    STAMP_VERSION,
    VENV,
    Stamps,
    StepError,
    base_key,
    ensure_venv,
    log,
    pip_install,
    sha,
    shown,
    site_packages,
    venv_python,
    write_if_changed,
)
from .envs import ENV_VENVS, MAIN, VenvSpec

LOCK = ROOT / ".venv.lock"  # serialises concurrent `env` runs in this checkout


class Steps:
    """Runs named steps, skipping those whose key is stamped; counts and defers."""

    def __init__(self) -> None:
        self.ran = 0
        self.skipped = 0
        self.deferred: list[str] = []

    def __call__(
        self,
        name: str,
        key: str | None,
        fn: Callable[[], str],
        stamps: Stamps,
        what: str = "",
        *,
        defer_failure: bool = False,
    ) -> None:
        if common.RECORD is not None:  # the plan: say the step, record its commands
            if key is None:
                common.RECORD.append(f"step {name} (system package: only when missing)")
            elif name.startswith("verify "):
                common.RECORD.append(f"step {name} key={key} (import check)")
            else:
                common.RECORD.append(f"step {name} key={key}")
                fn()
            return
        if key is not None and stamps.fresh(name, key):
            self.skipped += 1
            return
        log(f"{name}: {what or 'installing'} ...")
        t0 = time.monotonic()
        try:
            detail = fn()
        except StepError as e:
            if not defer_failure:
                raise
            # Keep building the rest of the environment; fail at the end (not stamped,
            # so the next run retries).
            log(f"{name}: FAILED after {time.monotonic() - t0:.1f}s: {e}")
            self.deferred.append(f"{name}: {e}")
            return
        self.ran += 1
        if key is not None:
            stamps.record(name, key)
        extra = f" ({detail})" if detail else ""
        log(f"{name}: done in {time.monotonic() - t0:.1f}s{extra}")


def install_lock(spec: VenvSpec) -> str:
    pins = locking.check_lock(spec)
    pip_install(
        spec.path, "--no-deps", "--require-hashes", "--no-warn-conflicts", "-r", spec.lock,
        total=len(pins), pip_of=spec.pip_of,
    )  # fmt: skip
    return f"{len(pins)} locked distributions"


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() or "."


def build(spec: VenvSpec, step: Steps, main_stamps: Stamps | None = None) -> Stamps:
    """Create/refresh the venv of *spec*: create, install (its lock, or its groups one
    step each), the system packages (.venv), the editable projects, the .pth files, the
    import check. *main_stamps*: .venv's (an overlay's check depends on them)."""
    t0 = time.monotonic()
    if common.RECORD is not None:
        common.RECORD.append(f"venv {spec.name} ({shown(spec.path)})")
    elif not venv_python(spec.path).exists():
        log(f"venv: creating {spec.path} ...")
    if ensure_venv(spec.path, with_pip=spec.with_pip):
        log(f"venv: created {spec.path} in {time.monotonic() - t0:.1f}s")
        Stamps(spec.path).forget()
        step.ran += 1
    stamps = Stamps(spec.path)
    if spec.locked:
        key = base_key()
        _install_locked(spec, step, stamps)
    else:
        key = sha(STAMP_VERSION, sys.version, spec.constraints)
        _install_groups(spec, step, stamps, key)
    if spec.system:
        # System libraries: checked every run (cheap), never stamped.
        dry = common.RECORD is not None
        if dry or not system.have_libibverbs():
            step(
                "libibverbs1", None, system.step_libibverbs, stamps,
                "installing libibverbs1 (apt-get)",
            )  # fmt: skip
        # Prometheus server and promtool, for the shipped rules' and dashboard's test
        # (tests/test_prometheus_rules.py); the same check, never stamped.
        if dry or not system.have_prometheus():
            step(
                "prometheus", None, system.step_prometheus, stamps,
                f"installing Debian's prometheus {system.PROMETHEUS_DEB} (apt-get, as root)",
            )  # fmt: skip
    for proj in spec.editable:
        _editable(spec, step, stamps, proj, key)
    for name, text in spec.pth:
        if write_if_changed(site_packages(spec.path) / name, text()) and spec is MAIN:
            log(f"stubs: wrote {site_packages(spec.path) / name}")
    verify = spec.verify
    if verify is not None:
        inputs = verify.inputs(spec, stamps, main_stamps or stamps)
        check = verify.check

        def run_check() -> str:
            return check(spec)

        step(
            f"verify {spec.name}",
            sha(*inputs),
            run_check,
            stamps,
            verify.what,
            defer_failure=verify.defer,
        )
    return stamps


def _install_locked(spec: VenvSpec, step: Steps, stamps: Stamps) -> None:
    pins = locking.check_lock(spec)
    overlay = site_packages(spec.path) / spec.overlay_pth if spec.overlay else None

    def install() -> str:
        # Without the overlay, pip neither sees nor touches .venv's packages.
        if overlay is not None and common.RECORD is None:
            overlay.unlink(missing_ok=True)
        return install_lock(spec)

    step(
        spec.install_step,
        sha(base_key(), spec.lock),
        install,
        stamps,
        spec.install_what.format(n=len(pins), lock=spec.lock.relative_to(ROOT)),
    )
    if spec.system and common.RECORD is None:
        extras = locking.unlocked_extras(spec, pins)
        if extras:
            log(
                f"note: {spec.name} also holds {len(extras)} distributions its lock does "
                f"not list ({', '.join(extras[:8])}{' ...' * (len(extras) > 8)}); left in "
                f"place. Delete {spec.name} for an exact copy of the lock"
            )


def _install_groups(spec: VenvSpec, step: Steps, stamps: Stamps, key: str) -> None:
    for group in spec.groups:
        if group.requirements is not None:
            what: object = group.requirements
            args: list[str | Path] = ["-r", group.requirements]
        else:
            what = list(group.packages)
            args = list(group.packages)
        step(group.name, sha(key, what), _pip_step(spec, "--no-deps", *args), stamps)


def _pip_step(spec: VenvSpec, *args: str | Path) -> Callable[[], str]:
    return lambda: _pip(spec, *args)


def _pip(spec: VenvSpec, *args: str | Path) -> str:
    """An unlocked venv's pip install: its exact pins as constraints."""
    pip_install(spec.path, "-c", spec.constraints, *args, pip_of=spec.pip_of)
    return ""


def _editable(spec: VenvSpec, step: Steps, stamps: Stamps, proj: Path, key: str) -> None:
    pyproject = proj / "pyproject.toml"
    if not pyproject.is_file():
        return
    rel = _rel(proj)
    name = spec.editable_step.format(rel=rel)
    if spec.locked:
        step(
            name,
            sha(key, spec.lock, pyproject, proj / "setup.py", proj / "setup.cfg"),
            # --no-deps: its dependencies are in the lock; --no-build-isolation: the
            # build backend (hatchling) is too, rather than fetched unpinned.
            lambda: _install_editable(spec, "--no-deps", "--no-build-isolation", "-e", proj),
            stamps,
            f"pip install -e {rel}",
            defer_failure=True,
        )
    else:
        step(
            name,
            sha(key, pyproject),
            lambda: _pip(spec, "--no-deps", "-e", proj),
            stamps,
            defer_failure=True,
        )


def _install_editable(spec: VenvSpec, *args: str | Path) -> str:
    pip_install(spec.path, *args, pip_of=spec.pip_of)
    return ""


def locked_env(fn: Callable[[], int]) -> int:
    """*fn*, serialised across concurrent callers in this checkout by a file lock."""
    with open(LOCK, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another `tools/dev.py env` to finish (lock {LOCK.name})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        return fn()


def env_command() -> int:
    """Build/refresh every venv of `env`; serialised across concurrent callers."""
    return locked_env(lambda: build_all(ENV_VENVS))


def build_all(specs: tuple[VenvSpec, ...]) -> int:
    """Build *specs* in order (the first being .venv when the overlays need it)."""
    t_all = time.monotonic()
    step = Steps()
    # Every lock first: a stale one stops `env` before anything is installed.
    for spec in specs:
        if spec.locked:
            locking.check_lock(spec)
    main_stamps: Stamps | None = None
    for spec in specs:
        stamps = build(spec, step, main_stamps)
        if spec.path == VENV:
            main_stamps = stamps
    total = time.monotonic() - t_all
    if common.RECORD is not None:
        return 0
    if step.deferred:
        log(f"env: FAILED after {total:.1f}s; everything else is installed. Failed steps:")
        for d in step.deferred:
            log(f"  {d}")
        return 1
    if step.ran:
        log(f"env: ready in {total:.1f}s ({step.ran} steps run, {step.skipped} up to date)")
    else:
        log(f"env: up to date ({total:.2f}s)")
    return 0


def plan(specs: tuple[VenvSpec, ...]) -> list[str]:
    """Every step of building *specs* and the commands it would run, nothing run or
    written (``tools/dev.py plan``); paths as ``<ROOT>``, this interpreter as ``<PY>``."""
    record: list[str] = []
    common.RECORD = record
    try:
        build_all(specs)
    finally:
        common.RECORD = None
    return record
