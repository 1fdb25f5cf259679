#!/usr/bin/env python3
"""Reproducible developer environment for stallguard (stdlib only, Python 3.11).

    python3 tools/dev.py env                 create/update .venv and .venv-sglang0517
    python3 tools/dev.py test [pytest args]  `env`, then `.venv/bin/python -m pytest ARGS`
    python3 tools/dev.py demo [demo args]    `env`, then the PD wedge demo (examples/pd_wedge)

`env` is idempotent: every step has a key (a hash of its inputs: the interpreter, the
constraints file, the step's package list or pyproject.toml, STAMP_VERSION) recorded in
a stamp file inside the venv, and a step whose key is unchanged is skipped, so a no-op
run takes ~0.01 s.  A failed `pip install -e` of the project does not stop the other
steps, but makes `env` exit 1.  Concurrent runs in one checkout are serialised by a
lock file.  `test` propagates pytest's exit code; pytest's 5 ("no tests collected") is
reported as a failure.

What gets installed (always with `-c tools/constraints.txt`, which pins torch==2.13.0,
the local CPU wheel; any other torch pulls gigabytes of CUDA wheels; torchvision is
never installed):

* sglang==0.5.23 (--no-deps) plus the minimal dependency list that lets its
  disaggregation modules import on CPU (shared/notes/sglang.md section 11);
* the real KV transfer engines: nixl==1.5.2 + nixl-cu12==1.5.1 (--no-deps) and
  mooncake-transfer-engine-non-cuda==0.3.13.post1 (+ the system lib libibverbs1);
* test tooling (pytest, hypothesis, ...);
* the project itself, editable, when its pyproject.toml files exist;
* `.venv-sglang0517`: an overlay venv whose own site-packages only holds
  sglang==0.5.17 and the pins of 0.5.17 that differ from 0.5.23; a .pth file appends
  .venv's site-packages for everything else (torch, engines, tooling, the project).

Both venvs get `_stallguard_dev.pth`, which puts tests/_stubs (triton and torchvision
stand-ins) and adapters/sglang/tests (for `import sglang_support`) on sys.path and
activates the triton stub, so spawned subprocesses see the same environment.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
VENV = ROOT / ".venv"
VENV0517 = ROOT / ".venv-sglang0517"
CONSTRAINTS = TOOLS / "constraints.txt"
CONSTRAINTS0517 = TOOLS / "constraints-sglang0517.txt"
STUBS = ROOT / "tests" / "_stubs"
TESTS = ROOT / "adapters" / "sglang" / "tests"  # sglang_support
STAMP_NAME = ".stallguard-dev-stamps.json"
# Bump to force every install step to run again (a step's key is this, the interpreter,
# the constraints file and the step's own package list / pyproject.toml).
STAMP_VERSION = 1
LOCK = ROOT / ".venv.lock"  # serialises concurrent `env` runs in this checkout
PTH_NAME = "_stallguard_dev.pth"
# Sorts before _stallguard_dev.pth, so .venv's site-packages lands on sys.path
# before tests/ (nothing in tests/ may shadow an installed package).
OVERLAY_PTH_NAME = "_0_sglang0517_overlay.pth"
PY = f"python{sys.version_info.major}.{sys.version_info.minor}"

SGLANG = "sglang==0.5.23"
# shared/notes/sglang.md section 11 (the 14 base deps, then what common.conn,
# mooncake.conn, prefill and decode need). setproctitle/uvicorn/fastapi are needed
# to import sglang.srt.managers.scheduler (both versions).
SGLANG_DEPS = [
    "torch==2.13.0",
    "numpy",
    "orjson",
    "psutil",
    "pybase64",
    "requests",
    "packaging",
    "pillow",
    "starlette",
    "msgspec",
    "pydantic",
    "pyzmq",
    "tqdm",
    "IPython",
    "aiohttp",
    "transformers==5.19.0",
    "dill",
    "apache-tvm-ffi==0.1.11",
    "sentencepiece==0.2.1",
    "compressed-tensors==0.18.0",
    "gguf",
    "prometheus-client",
    "openai==2.8.0",
    "partial-json-parser",
    "einops",
    "setproctitle",
    "uvicorn",
    "fastapi",
]
NIXL = ["nixl==1.5.2", "nixl-cu12==1.5.1"]
MOONCAKE = ["mooncake-transfer-engine-non-cuda==0.3.13.post1"]
TOOLING = [
    "pytest",
    "hypothesis",
    "pytest-timeout",
    "opentelemetry-api",
    "opentelemetry-sdk",
    "attrs",
    "anyio",
    "trio",
    "transitions",
    "matplotlib",
    "ruff",
    "prometheus-client",
]
EDITABLE = [ROOT, ROOT / "adapters" / "sglang"]
# .venv-sglang0517 holds only these (all --no-deps); shared/notes/sglang-0.5.17.md s6.
# transformers/openai: 0.5.17 pins versions that differ from the ones in .venv (it does
# not import with transformers 5.19.0: "'qwen3_asr' is already used by a Transformers
# config"); transformers 5.12.1 in turn needs tokenizers<=0.23.0 (.venv has 0.23.2).
SGLANG0517 = [
    "sglang==0.5.17",
    "xgrammar==0.2.1",
    "transformers==5.12.1",
    "openai==2.6.1",
    "tokenizers==0.22.2",
]
# Packages that must never be present (they drag in CUDA torch / GBs of wheels).
FORBIDDEN = ["torchvision", "triton"]

QUIET_PIP = ["-q", "--no-input", "--disable-pip-version-check", "--no-warn-conflicts"]


class StepError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[dev] {msg}", flush=True)


# pip warns once per package about the machine's file:// extra indexes that lack it.
NOISE = re.compile(r"^WARNING: Location 'file://.*' is ignored: it is neither a file nor a dir")


def run(cmd: list[str | os.PathLike], *, env: dict | None = None, check: bool = True) -> int:
    """Run `cmd` in ROOT, streaming its output minus known noise lines."""
    cmd = [str(c) for c in cmd]
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    with subprocess.Popen(
        cmd,
        env=full_env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if not NOISE.match(line):
                sys.stdout.write(line)
        rc = proc.wait()
    sys.stdout.flush()
    if check and rc != 0:
        raise StepError(f"command failed (exit {rc}): {' '.join(cmd)}")
    return rc


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


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def site_packages(venv: Path) -> Path:
    return venv / "lib" / PY / "site-packages"


def pip(*args: str | os.PathLike, constraints: Path = CONSTRAINTS) -> None:
    run([venv_python(VENV), "-m", "pip", "install", *QUIET_PIP, "-c", constraints, *args])


# --------------------------------------------------------------------------- stamps


class Stamps:
    def __init__(self, venv: Path):
        self.path = venv / STAMP_NAME
        try:
            self.data = json.loads(self.path.read_text())
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


# --------------------------------------------------------------------------- steps


def base_key() -> str:
    """What every install step of .venv depends on."""
    return sha(STAMP_VERSION, sys.version, CONSTRAINTS)


def pth_text() -> str:
    # One `import` line (executed by site.py) rather than path lines, so that it is
    # idempotent: .venv-sglang0517 runs it twice (its own copy, and .venv's via the overlay).
    paths = (str(STUBS), str(TESTS))
    return (
        "# Written by tools/dev.py: test stand-ins (tests/_stubs) and sglang_support on sys.path.\n"
        f"import sys; sys.path.extend(p for p in {paths!r} if p not in sys.path); "
        "import _stallguard_stubs\n"
    )


def write_if_changed(path: Path, text: str) -> bool:
    if path.is_file() and path.read_text() == text:
        return False
    path.write_text(text)
    return True


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


def have_libibverbs() -> bool:
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    except OSError:
        out = ""
    if "libibverbs.so.1" in out:
        return True
    return any(
        Path(d, "libibverbs.so.1").exists()
        for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")
    )


def step_libibverbs() -> str:
    if have_libibverbs():
        return "present"
    if os.geteuid() != 0:
        return (
            "SKIPPED: libibverbs1 missing and not root; mooncake.engine will not import "
            "(run `apt-get install -y libibverbs1` as root)"
        )
    if shutil.which("apt-get") is None:
        return "SKIPPED: libibverbs1 missing and no apt-get; mooncake.engine will not import"
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], env=env)
    run(["apt-get", "install", "-y", "-qq", "libibverbs1"], env=env)
    if not have_libibverbs():
        raise StepError("apt-get installed libibverbs1 but libibverbs.so.1 is still not found")
    return "installed"


def check_forbidden(venv: Path) -> None:
    sp = site_packages(venv)
    bad = [n for n in FORBIDDEN if list(sp.glob(f"{n}-*.dist-info"))]
    if bad:
        raise StepError(
            f"{venv.name} contains {', '.join(bad)} (a CUDA-torch trap / real package that "
            f"tests/_stubs stands in for); remove it: {venv_python(venv)} -m pip uninstall -y "
            + " ".join(bad)
        )
    torch_di = list(sp.glob("torch-*.dist-info"))
    if venv == VENV and [d.name for d in torch_di] != ["torch-2.13.0+cpu.dist-info"]:
        found = [d.name for d in torch_di]
        raise StepError(f"expected exactly torch 2.13.0+cpu in .venv, found {found}")


IMPORT_CHECK = (
    "import sglang, torch\n"
    "import sglang.srt.disaggregation.prefill, sglang.srt.disaggregation.nixl.conn\n"
    "import sglang.srt.disaggregation.mooncake.conn\n"
    "print(sglang.__version__, torch.__version__)\n"
)


def import_check(venv: Path, sglang_version: str) -> str:
    """The venv imports the SGLang prefill/NIXL/Mooncake modules (with the stubs)."""
    out = subprocess.run(
        [str(venv_python(venv)), "-c", IMPORT_CHECK], capture_output=True, text=True, cwd=ROOT
    )
    words = out.stdout.split()
    if out.returncode != 0 or not words or words[0] != sglang_version:
        raise StepError(
            f"{venv.name} does not import sglang {sglang_version}'s disaggregation modules:\n"
            f"{out.stdout}\n{out.stderr[-3000:]}"
        )
    return f"sglang {words[0]} torch {words[1]} import OK"


def env_command() -> int:
    """Build/refresh both venvs; serialised across concurrent callers by a file lock."""
    with open(LOCK, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another `tools/dev.py env` to finish (lock {LOCK.name})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        return _env_locked()


def _env_locked() -> int:
    t_all = time.monotonic()
    ran = 0
    skipped = 0
    deferred: list[str] = []

    def step(name: str, key: str | None, fn, stamps: Stamps, *, defer_failure=False) -> None:
        nonlocal ran, skipped
        if key is not None and stamps.fresh(name, key):
            skipped += 1
            return
        t0 = time.monotonic()
        try:
            detail = fn()
        except StepError as e:
            if not defer_failure:
                raise
            # Keep building the rest of the environment; fail at the end (not stamped,
            # so the next run retries).
            log(f"{name}: FAILED after {time.monotonic() - t0:.1f}s: {e}")
            deferred.append(f"{name}: {e}")
            return
        ran += 1
        if key is not None:
            stamps.record(name, key)
        extra = f" ({detail})" if detail else ""
        log(f"{name}: done in {time.monotonic() - t0:.1f}s{extra}")

    # ---- .venv
    t0 = time.monotonic()
    if ensure_venv(VENV, with_pip=True):
        log(f"venv: created {VENV} in {time.monotonic() - t0:.1f}s")
        Stamps(VENV).forget()
        ran += 1
    stamps = Stamps(VENV)
    bk = base_key()
    step("sglang", sha(bk, SGLANG), lambda: pip("--no-deps", SGLANG), stamps)
    step("sglang-deps", sha(bk, SGLANG_DEPS), lambda: pip(*SGLANG_DEPS), stamps)
    step("nixl", sha(bk, NIXL), lambda: pip("--no-deps", *NIXL), stamps)
    step("mooncake", sha(bk, MOONCAKE), lambda: pip(*MOONCAKE), stamps)
    # System library: checked every run (cheap), never stamped.
    if not have_libibverbs():
        step("libibverbs1", None, step_libibverbs, stamps)
    step("tooling", sha(bk, TOOLING), lambda: pip(*TOOLING), stamps)
    for proj in EDITABLE:
        pyproject = proj / "pyproject.toml"
        if not pyproject.is_file():
            continue
        rel = proj.relative_to(ROOT).as_posix() or "."
        step(
            f"editable {rel}",
            sha(bk, pyproject, proj / "setup.py", proj / "setup.cfg"),
            lambda proj=proj: pip("-e", proj),
            stamps,
            defer_failure=True,
        )
    if write_if_changed(site_packages(VENV) / PTH_NAME, pth_text()):
        log(f"stubs: wrote {site_packages(VENV) / PTH_NAME}")

    def verify() -> str:
        check_forbidden(VENV)
        return import_check(VENV, SGLANG.split("==")[1])

    step("verify .venv", sha(stamps.installs(), pth_text()), verify, stamps)

    # ---- .venv-sglang0517 (overlay on .venv)
    t0 = time.monotonic()
    if ensure_venv(VENV0517, with_pip=False):
        log(f"venv: created {VENV0517} in {time.monotonic() - t0:.1f}s")
        Stamps(VENV0517).forget()
        ran += 1
    st0517 = Stamps(VENV0517)
    overlay = site_packages(VENV0517) / OVERLAY_PTH_NAME
    overlay_text = (
        "# Written by tools/dev.py: everything not installed here comes from .venv.\n"
        f"import site; site.addsitedir({str(site_packages(VENV))!r})\n"
    )

    def install0517() -> str:
        # Without the overlay, pip neither sees nor touches .venv's sglang 0.5.23.
        overlay.unlink(missing_ok=True)
        run(
            [
                venv_python(VENV),
                "-m",
                "pip",
                "--python",
                venv_python(VENV0517),
                "install",
                *QUIET_PIP,
                "--no-deps",
                "-c",
                CONSTRAINTS0517,
                *SGLANG0517,
            ]
        )
        return ""

    key0517 = sha(STAMP_VERSION, sys.version, CONSTRAINTS0517, SGLANG0517)
    step("sglang0517", key0517, install0517, st0517)
    write_if_changed(overlay, overlay_text)
    write_if_changed(site_packages(VENV0517) / PTH_NAME, pth_text())

    def verify0517() -> str:
        check_forbidden(VENV0517)
        return import_check(VENV0517, "0.5.17")

    step(
        "verify .venv-sglang0517",
        sha(st0517.installs(), stamps.installs(), overlay_text, pth_text()),
        verify0517,
        st0517,
    )

    total = time.monotonic() - t_all
    if deferred:
        log(f"env: FAILED after {total:.1f}s; everything else is installed. Failed steps:")
        for d in deferred:
            log(f"  {d}")
        return 1
    if ran:
        log(f"env: ready in {total:.1f}s ({ran} steps run, {skipped} up to date)")
    else:
        log(f"env: up to date ({total:.2f}s)")
    return 0


def test_command(args: list[str]) -> int:
    rc = env_command()
    if rc:
        return rc
    cmd = [str(venv_python(VENV)), "-m", "pytest", *args]
    log("test: " + " ".join(cmd))
    rc = subprocess.call(cmd, cwd=ROOT)
    if rc == 5:
        log("test: pytest collected no tests (exit 5) -- treated as a failure")
    return rc


def demo_command(args: list[str]) -> int:
    """The project's main job: the PD wedge on real NIXL and Mooncake engines, run
    without and with stallguard-sglang (examples/pd_wedge; docs/demo.md)."""
    rc = env_command()
    if rc:
        return rc
    cmd = [str(venv_python(VENV)), "-m", "examples.pd_wedge", *args]
    log("demo: " + " ".join(cmd))
    return subprocess.call(cmd, cwd=ROOT)


USAGE = __doc__.split("\n\n")[1]


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd == "env":
            if rest:
                print(f"env takes no arguments\n{USAGE}", file=sys.stderr)
                return 2
            return env_command()
        if cmd == "test":
            return test_command(rest)
        if cmd == "demo":
            return demo_command(rest)
    except StepError as e:
        log(f"FAILED: {e}")
        return 1
    print(f"unknown command {cmd!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
