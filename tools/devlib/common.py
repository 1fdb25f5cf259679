"""What every part of tools/dev.py shares: paths, logging, running a command, stamps,
venv creation."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
TOOLS = ROOT / "tools"
LOCKS = TOOLS / "lock"
VENV = ROOT / ".venv"
STAMP_NAME = ".stallguard-dev-stamps.json"
# Bump to force every install step to run again (a step's key is this, the interpreter,
# and the lock / pyproject.toml it installs).
STAMP_VERSION = 2
PY = f"python{sys.version_info.major}.{sys.version_info.minor}"
PIP_OPTS = ["--no-input", "--disable-pip-version-check", "--progress-bar", "off"]

# pip warns once per package about the machine's file:// extra indexes that lack it.
NOISE = re.compile(r"^WARNING: Location 'file://.*' is ignored: it is neither a file nor a dir")
# pip's lines worth showing, reworded: one per package, numbered against the lock.
PIP_COLLECTING = re.compile(r"^(?:Collecting|Processing) (\S+)")
PIP_SATISFIED = re.compile(r"^Requirement already satisfied: (\S+)")
PIP_QUIET = re.compile(r"^\s+(Using cached|Obtaining|File was already downloaded)\b")
# Say that a step is still running after this many seconds without a line.
HEARTBEAT_S = 15.0

#: When a list, :func:`run` records each command here instead of running it (the
#: ``plan`` command: every environment's install commands, nothing run).
RECORD: list[str] | None = None


class StepError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[dev] {msg}", flush=True)


def shown(part: object) -> str:
    """*part* as the plan prints it: the checkout is ``<ROOT>``, this interpreter ``<PY>``."""
    return str(part).replace(str(ROOT), "<ROOT>").replace(sys.executable, "<PY>")


def run(
    cmd: Sequence[str | os.PathLike[str]],
    *,
    env: dict[str, str] | None = None,
    check: bool = True,
    progress_total: int = 0,
) -> int:
    """Run `cmd` in ROOT, streaming its output minus known noise lines; pip's
    per-package lines become `[i/total] name` when `progress_total` is given; after
    HEARTBEAT_S seconds of silence (pip installing a large wheel, a build) a line says
    the command is still running."""
    words = [str(c) for c in cmd]
    if RECORD is not None:
        RECORD.append("  run " + " ".join(shown(w) for w in words))
        return 0
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    what = " ".join([Path(words[0]).name, *words[1:4]])
    t0 = time.monotonic()
    last = [t0]
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(1.0):
            now = time.monotonic()
            if now - last[0] >= HEARTBEAT_S:
                log(f"  ... still running ({now - t0:.0f}s): {what} ...")
                last[0] = now

    ticker = threading.Thread(target=heartbeat, daemon=True)
    ticker.start()
    try:
        with subprocess.Popen(
            words,
            env=full_env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        ) as proc:
            assert proc.stdout is not None
            progress = Progress(progress_total)
            for line in proc.stdout:
                last[0] = time.monotonic()
                out = progress.line(line)
                if out is not None:
                    sys.stdout.write(out)
                    sys.stdout.flush()
            rc = proc.wait()
    finally:
        done.set()
        ticker.join()
    sys.stdout.flush()
    if check and rc != 0:
        raise StepError(f"command failed (exit {rc}): {' '.join(words)}")
    return rc


class Progress:
    """pip's output, one line at a time: noise dropped; with a *total*, the per-package
    lines logged as ``[i/total] name`` and the rest of pip's chatter dropped."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.seen = 0

    def line(self, line: str) -> str | None:
        """The text to pass on for *line* (None: nothing; a progress line is logged)."""
        if NOISE.match(line):
            return None
        if not self.total:
            return line
        m = PIP_COLLECTING.match(line) or PIP_SATISFIED.match(line)
        if m:
            self.seen += 1
            present = "present " if line.startswith("Requirement") else ""
            log(f"  [{self.seen}/{self.total}] {present}{Path(m.group(1)).name}")
            return None
        if line.startswith("Installing collected packages: "):
            n = line.count(",") + 1
            log(f"  unpacking {n} distributions into the venv (big wheels take long)")
            return None
        if PIP_QUIET.match(line):
            return None
        return line


def sha(*parts: object) -> str:
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, Path):
            h.update(str(p).encode())
            h.update(p.read_bytes() if p.is_file() else b"<absent>")
        else:
            h.update(repr(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def base_key() -> str:
    """What every install step of a venv depends on."""
    return sha(STAMP_VERSION, sys.version)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if not m:
        raise StepError(f"cannot read a package name from requirement {req!r}")
    return canonical(m.group(1))


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def site_packages(venv: Path) -> Path:
    return venv / "lib" / PY / "site-packages"


def pip_install(
    target: Path, *args: str | os.PathLike[str], total: int = 0, pip_of: Path = VENV
) -> None:
    """`pip install ARGS` into venv `target` with the pip of venv *pip_of* (.venv's, for
    the overlays that have none), showing progress."""
    cmd: list[str | os.PathLike[str]] = [venv_python(pip_of), "-m", "pip"]
    if target != pip_of:
        cmd += ["--python", venv_python(target)]
    run([*cmd, "install", *PIP_OPTS, *args], progress_total=total)


def write_if_changed(path: Path, text: str) -> bool:
    if RECORD is not None:
        RECORD.append(f"  write {shown(path)} sha={sha(text)}")
        return False
    if path.is_file() and path.read_text() == text:
        return False
    path.write_text(text)
    return True


class Stamps:
    """The keys of the steps done in a venv (a JSON file inside it)."""

    def __init__(self, venv: Path):
        self.path = venv / STAMP_NAME
        try:
            self.data: dict[str, str] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.data = {}

    def fresh(self, step: str, key: str) -> bool:
        return self.data.get(step) == key

    def record(self, step: str, key: str) -> None:
        self.data[step] = key
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
        tmp.replace(self.path)

    def installs(self) -> dict[str, str]:
        """The install steps' keys (what a verification depends on)."""
        return {k: v for k, v in sorted(self.data.items()) if not k.startswith("verify")}

    def forget(self) -> None:
        self.data = {}
        self.path.unlink(missing_ok=True)


def venv_owner(venv: Path) -> tuple[str, Path] | None:
    """(Python version, home dir) recorded in `venv`'s pyvenv.cfg, None if unreadable."""
    try:
        text = (venv / "pyvenv.cfg").read_text()
    except OSError:
        return None
    fields = {k.strip(): v.strip() for k, _, v in (ln.partition("=") for ln in text.splitlines())}
    version = fields.get("version") or fields.get("version_info", "")
    return version, Path(fields.get("home", "/nonexistent")).resolve()


def ensure_venv(venv: Path, *, with_pip: bool) -> bool:
    """Create `venv` if it is absent or broken (checked without spawning it). Returns True
    if created. A working venv made by another interpreter is an error, not rebuilt: it
    may be in use, and rebuilding 2 GB by accident (e.g. `/usr/bin/python3 tools/dev.py`)
    is worse than a clear message."""
    if RECORD is not None:
        return False
    owner = venv_owner(venv)
    here = (platform.python_version(), Path(sys.executable).resolve().parent)
    if owner is not None and venv_python(venv).exists():
        if owner == here:
            return False
        raise StepError(
            f"{venv} was made by Python {owner[0]} from {owner[1]}, but this is Python "
            f"{here[0]} ({sys.executable}). Run tools/dev.py with that interpreter, or delete "
            f"{venv} to rebuild it with this one."
        )
    if venv.exists():
        log(f"{venv.name}: broken (no pyvenv.cfg or interpreter); recreating")
        shutil.rmtree(venv)
    cmd = [sys.executable, "-m", "venv", str(venv)]
    if not with_pip:
        cmd.insert(3, "--without-pip")
    run(cmd)
    return True
