#!/usr/bin/env python3
"""Reproducible developer environment for stallguard (stdlib only, Python 3.11).

    python3 tools/dev.py env                 create/update .venv and its overlays, .venv-vllm
    python3 tools/dev.py test [pytest args]  `env`, then `.venv/bin/python -m pytest ARGS`
    python3 tools/dev.py demo [demo args]    `env`, then the demo: the PD wedge on SGLang's and
                                             vLLM's engines (examples/pd_wedge, vllm_wedge),
                                             then faults and report->advise->enforce on real
                                             SGLang servers (examples/real_servers;
                                             --no-real-servers skips them)
    python3 tools/dev.py docs                `env`, then build the docs site into docs/_build/html
    python3 tools/dev.py lock [VENV ...]     re-resolve the package lists into tools/lock/
                                             (all venvs, or only those named: .venv-realsrv)

Every venv is installed from a **lock**: `tools/lock/<venv>.txt` lists every
distribution of that venv with its exact version and sha256 hash, and `env` installs it
with `pip install --no-deps --require-hashes -r tools/lock/<venv>.txt`, so two fresh
machines get the same files, and a file that differs from the one locked is refused.
The lock is generated, never edited by hand:

* What to install is declared here, per venv (`VENVS`): package groups (a group is
  installed with its dependencies, or `--no-deps` when only the named packages may
  come in, e.g. sglang, whose full dependency list is the CUDA stack), the projects
  installed editable (their runtime dependencies and their PEP 735 dependency groups
  are added), and a constraints file of hand-chosen pins (tools/constraints*.txt:
  torch==2.13.0 and SGLang's own `==` pins).
* `python3 tools/dev.py lock` resolves that with pip (`pip install --dry-run
  --ignore-installed --report`, on this interpreter, against the configured indexes)
  and writes the lock, with the hash of the very file pip chose (torch: the local CPU
  wheel). The lock's first lines record a hash of its inputs; `env` refuses a lock
  whose inputs changed since (edit a list, then run `lock`, and commit both).

To add a venv (e.g. `.venv-vllm`): append a `VenvSpec` to `VENVS` with its groups and
constraints file, run `python3 tools/dev.py lock`, commit `tools/lock/venv-vllm.txt`,
and add its build/verify steps to `_env_locked` (as for .venv-sglang0517).

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
* test, lint, build and docs tooling (pytest, hypothesis, sybil, ruff, mypy, build,
  twine, sphinx, ...);
* the project itself, editable (`--no-deps --no-build-isolation`: hatchling comes from
  the lock too).

`.venv-sglang0517` is an overlay venv whose own site-packages only holds sglang==0.5.17
and the pins of 0.5.17 that differ from 0.5.23 (tools/lock/venv-sglang0517.txt); a .pth
file appends .venv's site-packages for everything else (torch, engines, tooling, the
project).

`.venv-realsrv` is an overlay venv like .venv-sglang0517, for running *real* SGLang
servers (`python -m sglang.launch_server`, prefill + decode, and the Rust `sglang-router`):
its own site-packages holds only what the HTTP server, tokenizer manager and router
import beyond .venv's disaggregation modules (REALSRV below, all --no-deps and pinned;
xgrammar without its real 1 GB triton, which tests/_stubs stands in for), and
`_stallguard_realsrv.pth`, which activates the CPU stand-ins of
examples/real_servers/standins (a `vllm._custom_ops` stub and NIXL VRAM->DRAM
registration; each says what it stands in for). Only the real-server rig
(examples/real_servers, tests/test_real_servers.py) uses it; .venv is unchanged.

* `.venv-vllm`: a separate venv (vLLM's pins conflict with SGLang's) for stallguard-vllm's
  tests: vllm==0.33.0 and the pure-Python packages it imports (tools/vllm-packages.txt),
  all --no-deps, torch==2.13.0 and nixl==1.5.1 + nixl-cu12==1.5.1 pinned by
  tools/constraints-vllm.txt, the non-CUDA Mooncake transfer engine (pinned as in
  .venv, for vLLM's MooncakeConnector), test tooling, the project and adapters/vllm editable
  (see env_vllm()).

Both SGLang venvs get `_stallguard_dev.pth`, which puts tests/_stubs (triton and torchvision
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
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
VENV = ROOT / ".venv"
VENV0517 = ROOT / ".venv-sglang0517"
CONSTRAINTS = TOOLS / "constraints.txt"
CONSTRAINTS0517 = TOOLS / "constraints-sglang0517.txt"
STUBS = ROOT / "tests" / "_stubs"
TESTS = ROOT / "adapters" / "sglang" / "tests"  # sglang_support
STAMP_NAME = ".stallguard-dev-stamps.json"
LOCKS = TOOLS / "lock"
# Bump to force every install step to run again (a step's key is this, the interpreter,
# and the lock / pyproject.toml it installs).
STAMP_VERSION = 2
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
# Tooling beyond the projects' own dependency groups (pyproject.toml [dependency-groups],
# added to the lock automatically): lint, types, packaging, the demo's plot, the
# editable installs' build backend (installed --no-build-isolation, so it is locked too).
TOOLING = [
    "matplotlib",
    "ruff",
    "mypy",
    "build",
    "twine",
    "hatchling",
    "editables",  # hatchling's editable wheels import it
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
# .venv-realsrv holds only these (all --no-deps; their dependencies are in .venv):
# what `sglang.launch_server` (HTTP server, tokenizer manager, grammar backends) and
# `sglang_router.launch_router` import beyond .venv (shared/notes/real-servers-cpu.md).
VENV_REALSRV = ROOT / ".venv-realsrv"
REALSRV_STANDINS = ROOT / "examples" / "real_servers" / "standins"
REALSRV_PTH_NAME = "_stallguard_realsrv.pth"
OVERLAY_REALSRV_PTH_NAME = "_0_realsrv_overlay.pth"
REALSRV = [
    "uvloop==0.23.0",
    "python-multipart==0.0.34",
    "interegular==0.3.3",
    "watchfiles==1.3.0",
    "xxhash==4.1.0",
    "zstandard==0.25.0",
    "tiktoken==0.14.0",
    "easydict==1.14",
    "openai-harmony==0.0.4",
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0",
    "rpds-py==2026.9.1",
    "soundfile==0.13.1",
    # --no-deps: its `triton` requirement is the real 1 GB package (tests/_stubs stands in)
    "xgrammar==0.2.7",
    # the real Rust router, PD mode (its Python deps, aiohttp/fastapi/uvicorn/orjson/
    # setproctitle, are in .venv)
    "sglang-router==0.3.2",
]
# Packages that must never be present (they drag in CUDA torch / GBs of wheels).
FORBIDDEN = ["torchvision", "triton"]

PIP_OPTS = ["--no-input", "--disable-pip-version-check", "--progress-bar", "off"]


@dataclass(frozen=True)
class Group:
    """Packages installed together: with their dependencies, or (deps=False) alone."""

    name: str
    packages: tuple[str, ...]
    deps: bool = True


@dataclass(frozen=True)
class VenvSpec:
    """What one venv holds; `tools/dev.py lock` turns it into `lock`."""

    name: str
    path: Path
    constraints: Path
    groups: tuple[Group, ...]
    # Projects installed editable: their [project] dependencies (plus the extras named
    # here) and all their [dependency-groups] join the resolution; the projects
    # themselves are not in the lock.
    editable: tuple[Path, ...] = ()
    extras: tuple[str, ...] = ()
    lock: Path = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "lock", LOCKS / f"{self.name.lstrip('.')}.txt")


MAIN = VenvSpec(
    ".venv",
    VENV,
    CONSTRAINTS,
    (
        Group("sglang", (SGLANG,), deps=False),
        Group("sglang-deps", tuple(SGLANG_DEPS)),
        Group("nixl", tuple(NIXL), deps=False),
        Group("mooncake", tuple(MOONCAKE)),
        Group("tooling", tuple(TOOLING)),
    ),
    editable=tuple(EDITABLE),
    extras=("transitions",),
)
OVERLAY0517 = VenvSpec(
    ".venv-sglang0517", VENV0517, CONSTRAINTS0517, (Group("sglang0517", tuple(SGLANG0517), False),)
)
OVERLAY_REALSRV = VenvSpec(
    ".venv-realsrv", VENV_REALSRV, CONSTRAINTS, (Group("realsrv", tuple(REALSRV), False),)
)
VENVS = (MAIN, OVERLAY0517, OVERLAY_REALSRV)


class StepError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[dev] {msg}", flush=True)


# pip warns once per package about the machine's file:// extra indexes that lack it.
NOISE = re.compile(r"^WARNING: Location 'file://.*' is ignored: it is neither a file nor a dir")


# pip's lines worth showing, reworded: one per package, numbered against the lock.
PIP_COLLECTING = re.compile(r"^(?:Collecting|Processing) (\S+)")
PIP_SATISFIED = re.compile(r"^Requirement already satisfied: (\S+)")
PIP_QUIET = re.compile(r"^\s+(Using cached|Obtaining|File was already downloaded)\b")
# Say that a step is still running after this many seconds without a line.
HEARTBEAT_S = 15.0


def run(
    cmd: list[str | os.PathLike],
    *,
    env: dict | None = None,
    check: bool = True,
    progress_total: int = 0,
) -> int:
    """Run `cmd` in ROOT, streaming its output minus known noise lines; pip's
    per-package lines become `[i/total] name` when `progress_total` is given; after
    HEARTBEAT_S seconds of silence (pip installing a large wheel, a build) a line says
    the command is still running."""
    cmd = [str(c) for c in cmd]
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    what = " ".join([Path(cmd[0]).name, *cmd[1:4]])
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
    seen = 0
    try:
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
                last[0] = time.monotonic()
                if NOISE.match(line):
                    continue
                if progress_total:
                    m = PIP_COLLECTING.match(line) or PIP_SATISFIED.match(line)
                    if m:
                        seen += 1
                        present = "present " if line.startswith("Requirement") else ""
                        log(f"  [{seen}/{progress_total}] {present}{Path(m.group(1)).name}")
                        continue
                    if line.startswith("Installing collected packages: "):
                        n = line.count(",") + 1
                        log(f"  unpacking {n} distributions into the venv (big wheels take long)")
                        continue
                    if PIP_QUIET.match(line):
                        continue
                sys.stdout.write(line)
                sys.stdout.flush()
            rc = proc.wait()
    finally:
        done.set()
        ticker.join()
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


def pip_install(target: Path, *args: str | os.PathLike, total: int = 0) -> None:
    """`pip install ARGS` into venv `target` (with .venv's pip), showing progress."""
    cmd: list[str | os.PathLike] = [venv_python(VENV), "-m", "pip"]
    if target != VENV:
        cmd += ["--python", venv_python(target)]
    run([*cmd, "install", *PIP_OPTS, *args], progress_total=total)


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
    """What every install step of a venv depends on."""
    return sha(STAMP_VERSION, sys.version)


# --------------------------------------------------------------------------- locks

LOCK_FORMAT = 1
LOCK_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if not m:
        raise StepError(f"cannot read a package name from requirement {req!r}")
    return canonical(m.group(1))


def project_requirements(spec: VenvSpec) -> list[str]:
    """The editable projects' runtime dependencies, the extras named in `spec`, and
    all their PEP 735 dependency groups, minus the projects themselves."""
    projects, reqs = [], []
    for proj in spec.editable:
        pyproject = proj / "pyproject.toml"
        if not pyproject.is_file():
            continue
        data = tomllib.loads(pyproject.read_text())
        project = data.get("project", {})
        projects.append(canonical(project.get("name", proj.name)))
        reqs += project.get("dependencies", [])
        optional = project.get("optional-dependencies", {})
        for extra in spec.extras:
            reqs += optional.get(extra, [])
        groups = data.get("dependency-groups", {})
        for group in groups.values():
            # {include-group = ...} entries name another group, which is included anyway
            reqs += [r for r in group if isinstance(r, str)]
    return [r for r in reqs if requirement_name(r) not in projects]


def lock_inputs(spec: VenvSpec) -> str:
    """A hash of everything the lock of `spec` is resolved from (relative paths and
    contents only, so that it is the same in every clone)."""
    groups = [(g.name, list(g.packages), g.deps) for g in spec.groups]
    return sha(
        LOCK_FORMAT,
        f"{sys.version_info.major}.{sys.version_info.minor}",
        platform.machine(),
        spec.constraints.read_text(),
        groups,
        sorted(project_requirements(spec)),
        sorted(FORBIDDEN),
    )


def read_lock(spec: VenvSpec) -> tuple[str | None, dict[str, str]]:
    """(inputs hash recorded in the lock, {canonical name: version})."""
    try:
        text = spec.lock.read_text()
    except OSError:
        return None, {}
    inputs = None
    pins = {}
    for line in text.splitlines():
        if line.startswith("# inputs: "):
            inputs = line.split(":", 1)[1].strip()
        m = LOCK_LINE.match(line)
        if m:
            pins[canonical(m.group(1))] = m.group(2)
    return inputs, pins


def check_lock(spec: VenvSpec) -> dict[str, str]:
    """The lock's pins, if the lock exists and matches the current inputs."""
    rel = spec.lock.relative_to(ROOT)
    inputs, pins = read_lock(spec)
    if not pins:
        raise StepError(f"{rel} is missing or empty: run `python3 tools/dev.py lock`")
    if inputs != lock_inputs(spec):
        raise StepError(
            f"{rel} is out of date: {spec.name}'s package lists (tools/dev.py), "
            f"{spec.constraints.relative_to(ROOT)} or a pyproject.toml's dependencies "
            f"changed since it was generated. Run `python3 tools/dev.py lock` and commit "
            f"the new lock"
        )
    return pins


def resolve(spec: VenvSpec, tmp: Path) -> dict[str, tuple[str, str, str]]:
    """{canonical name: (name, version, sha256)} of every distribution `spec` installs,
    resolved by pip on this interpreter without installing anything."""
    with_deps = [p for g in spec.groups if g.deps for p in g.packages]
    with_deps += project_requirements(spec)
    no_deps = [p for g in spec.groups if not g.deps for p in g.packages]
    found: dict[str, tuple[str, str, str]] = {}
    for reqs, flag in ((with_deps, []), (no_deps, ["--no-deps"])):
        if not reqs:
            continue
        report = tmp / f"report-{len(flag)}.json"
        log(f"lock {spec.name}: resolving {len(reqs)} requirements{' (--no-deps)' * bool(flag)}")
        run(
            [
                sys.executable, "-m", "pip", "install", *PIP_OPTS, "--dry-run",
                "--ignore-installed", "--report", report, "-c", spec.constraints, *flag, *reqs,
            ]
        )  # fmt: skip
        for item in json.loads(report.read_text())["install"]:
            name, version = item["metadata"]["name"], item["metadata"]["version"]
            archive = item.get("download_info", {}).get("archive_info")
            digest = (archive or {}).get("hashes", {}).get("sha256")
            if not digest:
                raise StepError(f"pip reported no sha256 for {name}=={version}: {item}")
            key = canonical(name)
            if key in found and found[key][1] != version:
                raise StepError(
                    f"{name}: the --no-deps groups pin {version} but the others resolve "
                    f"{found[key][1]}; make the lists agree"
                )
            found[key] = (name, version, digest)
    bad = sorted(set(found) & {canonical(n) for n in FORBIDDEN})
    if bad:
        raise StepError(f"the resolution of {spec.name} pulls in forbidden {bad}")
    return found


def write_lock(spec: VenvSpec, found: dict[str, tuple[str, str, str]]) -> None:
    lines = [
        "# Generated by `python3 tools/dev.py lock` from tools/dev.py's lists for "
        f"{spec.name} and {spec.constraints.relative_to(ROOT)}; do not edit.",
        f"# Installed by `python3 tools/dev.py env`: pip install --no-deps --require-hashes -r "
        f"{spec.lock.relative_to(ROOT)}",
        f"# Python {sys.version_info.major}.{sys.version_info.minor} on {platform.machine()}; "
        f"{len(found)} distributions.",
        f"# inputs: {lock_inputs(spec)}",
    ]
    for key in sorted(found):
        _name, version, digest = found[key]
        lines.append(f"{key}=={version} \\\n    --hash=sha256:{digest}")
    spec.lock.parent.mkdir(parents=True, exist_ok=True)
    spec.lock.write_text("\n".join(lines) + "\n")


def lock_command(names: list[str] | None = None) -> int:
    """Re-resolve the locks of every venv, or only of the venvs *names* (`.venv-realsrv`
    or `venv-realsrv`): the others' locks are left exactly as they are."""
    specs = list(VENVS)
    if names:
        by_name = {v.name: v for v in VENVS} | {v.name.lstrip("."): v for v in VENVS}
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise StepError(f"no venv named {unknown}; known: {[v.name for v in VENVS]}")
        specs = [by_name[n] for n in names]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="stallguard-lock-") as tmp:
        for spec in specs:
            found = resolve(spec, Path(tmp))
            _inputs, old = read_lock(spec)
            write_lock(spec, found)
            new = {k: v[1] for k, v in found.items()}
            changed = sorted(k for k in new.keys() | old.keys() if new.get(k) != old.get(k))
            log(
                f"lock {spec.name}: wrote {spec.lock.relative_to(ROOT)} ({len(found)} "
                f"distributions, {len(changed)} changed"
                + (f": {', '.join(changed[:12])}{' ...' * (len(changed) > 12)}" if changed else "")
                + ")"
            )
    log(f"lock: done in {time.monotonic() - t0:.1f}s")
    return 0


def install_lock(spec: VenvSpec) -> str:
    pins = check_lock(spec)
    pip_install(
        spec.path, "--no-deps", "--require-hashes", "--no-warn-conflicts", "-r", spec.lock,
        total=len(pins),
    )  # fmt: skip
    return f"{len(pins)} locked distributions"


def unlocked_extras(spec: VenvSpec, pins: dict[str, str]) -> list[str]:
    """Distributions in `spec`'s own site-packages that its lock does not list (left by
    an older lock or installed by hand); `env` reports them and leaves them."""
    import importlib.metadata as md

    here = {
        canonical(d.metadata["Name"] or "")
        for d in md.distributions(path=[str(site_packages(spec.path))])
    }
    ours = {"pip", "setuptools", ""}
    for proj in spec.editable:
        pyproject = proj / "pyproject.toml"
        if pyproject.is_file():
            ours.add(canonical(tomllib.loads(pyproject.read_text())["project"]["name"]))
    return sorted(here - set(pins) - ours)


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


#: Debian bookworm's prometheus package (apt-cache policy prometheus); the rules test
#: runs whatever apt installs and says which version it ran.
PROMETHEUS_DEB = "2.42"


def have_prometheus() -> bool:
    return shutil.which("prometheus") is not None and shutil.which("promtool") is not None


def step_prometheus() -> str:
    if have_prometheus():
        return "present"
    why = (
        "the shipped Prometheus rules and Grafana dashboard (deploy/) will not be tested "
        "on a real Prometheus: tests/test_prometheus_rules.py skips"
    )
    if os.geteuid() != 0:
        return f"SKIPPED: prometheus missing and not root; {why} (`apt-get install -y prometheus`)"
    if shutil.which("apt-get") is None:
        return f"SKIPPED: prometheus missing and no apt-get; {why}"
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], env=env)
    run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"], env=env)
    if not have_prometheus():
        raise StepError("apt-get installed prometheus but prometheus/promtool are not on PATH")
    return "installed"


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

    def step(
        name: str, key: str | None, fn, stamps: Stamps, what: str = "", *, defer_failure=False
    ) -> None:
        nonlocal ran, skipped
        if key is not None and stamps.fresh(name, key):
            skipped += 1
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
            deferred.append(f"{name}: {e}")
            return
        ran += 1
        if key is not None:
            stamps.record(name, key)
        extra = f" ({detail})" if detail else ""
        log(f"{name}: done in {time.monotonic() - t0:.1f}s{extra}")

    # Both locks first: a stale one stops `env` before anything is installed.
    main_pins = check_lock(MAIN)
    check_lock(OVERLAY0517)
    check_lock(OVERLAY_REALSRV)

    # ---- .venv
    t0 = time.monotonic()
    if not venv_python(VENV).exists():
        log(f"venv: creating {VENV} ...")
    if ensure_venv(VENV, with_pip=True):
        log(f"venv: created {VENV} in {time.monotonic() - t0:.1f}s")
        Stamps(VENV).forget()
        ran += 1
    stamps = Stamps(VENV)
    bk = base_key()
    step(
        "packages",
        sha(bk, MAIN.lock),
        lambda: install_lock(MAIN),
        stamps,
        f"installing {len(main_pins)} locked distributions from "
        f"{MAIN.lock.relative_to(ROOT)} (first run: a few minutes)",
    )
    extras = unlocked_extras(MAIN, main_pins)
    if extras:
        log(
            f"note: {VENV.name} also holds {len(extras)} distributions its lock does not list "
            f"({', '.join(extras[:8])}{' ...' * (len(extras) > 8)}); left in place. Delete "
            f"{VENV.name} for an exact copy of the lock"
        )
    # System library: checked every run (cheap), never stamped.
    if not have_libibverbs():
        step("libibverbs1", None, step_libibverbs, stamps, "installing libibverbs1 (apt-get)")
    # Prometheus server and promtool, for the shipped rules' and dashboard's test
    # (tests/test_prometheus_rules.py); the same check, never stamped.
    if not have_prometheus():
        step(
            "prometheus",
            None,
            step_prometheus,
            stamps,
            f"installing Debian's prometheus {PROMETHEUS_DEB} (apt-get, as root)",
        )
    for proj in MAIN.editable:
        pyproject = proj / "pyproject.toml"
        if not pyproject.is_file():
            continue
        rel = proj.relative_to(ROOT).as_posix() or "."
        step(
            f"editable {rel}",
            sha(bk, MAIN.lock, pyproject, proj / "setup.py", proj / "setup.cfg"),
            # --no-deps: its dependencies are in the lock; --no-build-isolation: the
            # build backend (hatchling) is too, rather than fetched unpinned.
            lambda proj=proj: pip_install(VENV, "--no-deps", "--no-build-isolation", "-e", proj),
            stamps,
            f"pip install -e {rel}",
            defer_failure=True,
        )
    if write_if_changed(site_packages(VENV) / PTH_NAME, pth_text()):
        log(f"stubs: wrote {site_packages(VENV) / PTH_NAME}")

    def verify() -> str:
        check_forbidden(VENV)
        return import_check(VENV, SGLANG.split("==")[1])

    step(
        "verify .venv",
        sha(stamps.installs(), pth_text()),
        verify,
        stamps,
        "importing sglang's disaggregation modules",
    )

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
        return install_lock(OVERLAY0517)

    step(
        "sglang0517",
        sha(base_key(), OVERLAY0517.lock),
        install0517,
        st0517,
        f"installing SGLang 0.5.17's overlay from {OVERLAY0517.lock.relative_to(ROOT)}",
    )
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
        "importing sglang 0.5.17's disaggregation modules",
    )

    env_realsrv(step, stamps)

    env_vllm(step)

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


# --------------------------------------------------------------------------- .venv-realsrv

REALSRV_IMPORT_CHECK = (
    "import importlib.metadata as md, sglang, torch\n"
    "import sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler\n"
    "import sglang.srt.layers.rotary_embedding, sglang_router.launch_router\n"
    "import sglang.srt.disaggregation.nixl.conn as c\n"
    "assert c._normalize_kv_mem_kinds(None, 1) == ['DRAM'], 'NIXL DRAM stand-in inactive'\n"
    "eps = [e.value for e in md.entry_points(group='sglang.srt.plugins')]\n"
    "assert 'stallguard_sglang.plugin:register' in eps, eps\n"
    "print(sglang.__version__, torch.__version__, md.version('sglang-router'))\n"
)


def realsrv_pth_text() -> str:
    return (
        "# Written by tools/dev.py: the CPU stand-ins of the real-server rig "
        "(examples/real_servers/standins/README.md).\n"
        f"import sys; p = {str(REALSRV_STANDINS)!r}; p in sys.path or sys.path.append(p); "
        "import _stallguard_realsrv\n"
    )


def env_realsrv(step, main_stamps: Stamps) -> None:
    """Build/refresh .venv-realsrv, an overlay on .venv (like .venv-sglang0517)."""
    t0 = time.monotonic()
    if ensure_venv(VENV_REALSRV, with_pip=False):
        log(f"venv: created {VENV_REALSRV} in {time.monotonic() - t0:.1f}s")
        Stamps(VENV_REALSRV).forget()
    stamps = Stamps(VENV_REALSRV)
    overlay = site_packages(VENV_REALSRV) / OVERLAY_REALSRV_PTH_NAME
    overlay_text = (
        "# Written by tools/dev.py: everything not installed here comes from .venv.\n"
        f"import site; site.addsitedir({str(site_packages(VENV))!r})\n"
    )

    def install() -> str:
        overlay.unlink(missing_ok=True)  # pip must neither see nor touch .venv's packages
        return install_lock(OVERLAY_REALSRV)

    step(
        "realsrv",
        sha(base_key(), OVERLAY_REALSRV.lock),
        install,
        stamps,
        f"installing the real-server overlay from {OVERLAY_REALSRV.lock.relative_to(ROOT)}",
    )
    write_if_changed(overlay, overlay_text)
    write_if_changed(site_packages(VENV_REALSRV) / PTH_NAME, pth_text())
    write_if_changed(site_packages(VENV_REALSRV) / REALSRV_PTH_NAME, realsrv_pth_text())

    def verify() -> str:
        check_forbidden(VENV_REALSRV)
        out = subprocess.run(
            [str(venv_python(VENV_REALSRV)), "-c", REALSRV_IMPORT_CHECK],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        words = out.stdout.split()
        if out.returncode != 0 or len(words) != 3:
            raise StepError(
                f".venv-realsrv does not import SGLang's HTTP server and the router:\n"
                f"{out.stdout}\n{out.stderr[-3000:]}"
            )
        return f"sglang {words[0]} torch {words[1]} sglang-router {words[2]} import OK"

    standins = sorted(REALSRV_STANDINS.rglob("*.py"))
    step(
        "verify .venv-realsrv",
        sha(stamps.installs(), main_stamps.installs(), overlay_text, realsrv_pth_text(), *standins),
        verify,
        stamps,
        "importing SGLang's HTTP server and the router (with the CPU stand-ins)",
        defer_failure=True,
    )


# --------------------------------------------------------------------------- .venv-vllm

VENV_VLLM = ROOT / ".venv-vllm"
CONSTRAINTS_VLLM = TOOLS / "constraints-vllm.txt"
VLLM_PACKAGES = TOOLS / "vllm-packages.txt"  # pure-Python deps, pinned, --no-deps
VLLM = ["vllm==0.33.0"]
VLLM_TORCH = ["torch==2.13.0"]
VLLM_NIXL = ["nixl==1.5.1", "nixl-cu12==1.5.1"]
# vLLM's MooncakeConnector (the generic guard's real tests): the same non-CUDA Mooncake
# transfer engine as .venv's (MOONCAKE), --no-deps (its aiohttp/requests are in
# tools/vllm-packages.txt; its msgpack import is only for the Mooncake store)
VLLM_MOONCAKE = list(MOONCAKE)
VLLM_TOOLING = [
    "pytest",
    "hypothesis",
    "pytest-timeout",
    "sortedcontainers",
    "iniconfig",
    "pluggy",
]
VLLM_EDITABLE = [ROOT, ROOT / "adapters" / "vllm"]
VLLM_IMPORT_CHECK = (
    "import vllm, torch, nixl._api, mooncake.engine\n"
    "from vllm.v1.core.sched.scheduler import Scheduler\n"
    "from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorWorker\n"
    "import stallguard_vllm\n"
    "print(vllm.__version__, torch.__version__)\n"
)


def env_vllm(step) -> None:
    """Build/refresh .venv-vllm (idempotent: its own stamps, in that venv)."""
    t0 = time.monotonic()
    if ensure_venv(VENV_VLLM, with_pip=True):
        log(f"venv: created {VENV_VLLM} in {time.monotonic() - t0:.1f}s")
        Stamps(VENV_VLLM).forget()
    stamps = Stamps(VENV_VLLM)
    key = sha(STAMP_VERSION, sys.version, CONSTRAINTS_VLLM)

    def vpip(*args: str | os.PathLike) -> str:
        # exact pins (tools/constraints-vllm.txt, tools/vllm-packages.txt), not yet a
        # hashed lock like .venv's: see docs/dependencies.md
        pip_install(VENV_VLLM, "-c", CONSTRAINTS_VLLM, *args)
        return ""

    step("vllm", sha(key, VLLM), lambda: vpip("--no-deps", *VLLM), stamps)
    step("vllm-torch", sha(key, VLLM_TORCH), lambda: vpip("--no-deps", *VLLM_TORCH), stamps)
    step(
        "vllm-deps", sha(key, VLLM_PACKAGES), lambda: vpip("--no-deps", "-r", VLLM_PACKAGES), stamps
    )
    step("vllm-nixl", sha(key, VLLM_NIXL), lambda: vpip("--no-deps", *VLLM_NIXL), stamps)
    step(
        "vllm-mooncake",
        sha(key, VLLM_MOONCAKE),
        lambda: vpip("--no-deps", *VLLM_MOONCAKE),
        stamps,
    )
    step("vllm-tooling", sha(key, VLLM_TOOLING), lambda: vpip("--no-deps", *VLLM_TOOLING), stamps)
    for proj in VLLM_EDITABLE:
        pyproject = proj / "pyproject.toml"
        if not pyproject.is_file():
            continue
        rel = proj.relative_to(ROOT).as_posix() or "."
        step(
            f"vllm editable {rel}",
            sha(key, pyproject),
            lambda proj=proj: vpip("--no-deps", "-e", proj),
            stamps,
            defer_failure=True,
        )

    def verify() -> str:
        sp = site_packages(VENV_VLLM)
        found = sorted(d.name for d in sp.glob("torch-*.dist-info"))
        if found != ["torch-2.13.0+cpu.dist-info"]:
            raise StepError(f"expected exactly torch 2.13.0+cpu in .venv-vllm, found {found}")
        out = subprocess.run(
            [str(venv_python(VENV_VLLM)), "-c", VLLM_IMPORT_CHECK],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
        )
        words = out.stdout.split()
        if out.returncode != 0 or not words or words[0] != VLLM[0].split("==")[1]:
            raise StepError(
                f".venv-vllm does not import vLLM's scheduler and NIXL connector:"
                f"\n{out.stdout}\n{out.stderr[-3000:]}"
            )
        return f"vllm {words[0]} torch {words[1]} import OK"

    step("verify .venv-vllm", sha(stamps.installs()), verify, stamps)


def test_command(args: list[str]) -> int:
    rc = env_command()
    if rc:
        return rc
    # the slowest tests are printed, so a run that grows toward CI's budget says where
    cmd = [str(venv_python(VENV)), "-m", "pytest", "--durations=30", *args]
    log("test: " + " ".join(cmd))
    rc = subprocess.call(cmd, cwd=ROOT)
    if rc == 5:
        log("test: pytest collected no tests (exit 5) -- treated as a failure")
    return rc


def demo_command(args: list[str]) -> int:
    """The project's main job: the PD wedge on real NIXL and Mooncake engines, run
    without and with stallguard-sglang (examples/pd_wedge; docs/demo.md), the vLLM
    section, then the same incident and four more faults on real SGLang servers behind
    the real sglang-router, and report -> advise -> enforce on them
    (examples/real_servers; skipped with ``--no-real-servers``, which is not passed on to
    examples/pd_wedge)."""
    rc = env_command()
    if rc:
        return rc
    real_servers = "--no-real-servers" not in args
    args = [a for a in args if a != "--no-real-servers"]
    cmd = [str(venv_python(VENV)), "-m", "examples.pd_wedge", *args]
    log("demo: " + " ".join(cmd))
    rc = subprocess.call(cmd, cwd=ROOT)
    # The vLLM section: vLLM's NIXL connector with and without stallguard-vllm, run in
    # .venv-vllm (examples/vllm_wedge.py; docs/demo.md).
    cmd = [str(venv_python(VENV)), "-m", "examples.vllm_wedge"]
    log("demo (vLLM): " + " ".join(cmd))
    rc = max(rc, subprocess.call(cmd, cwd=ROOT))
    if real_servers:
        # Real SGLang servers (launch_server prefill + decode, the Rust sglang-router):
        # the seeds' incident and the other faults, without and with stallguard-sglang,
        # from the servers' own /metrics (examples/real_servers; docs/demo.md). About
        # 12-20 minutes on 2 busy cores; then report -> advise -> enforce on them
        # (about 10 minutes more).
        for part in ("faults", "advice"):
            cmd = [str(venv_python(VENV)), "-m", "examples.real_servers", part]
            log(f"demo (real servers, {part}): " + " ".join(cmd))
            rc = max(rc, subprocess.call(cmd, cwd=ROOT))
    return rc


def docs_command() -> int:
    """The docs site (docs/conf.py), built as strictly as the test suite builds it."""
    rc = env_command()
    if rc:
        return rc
    out = ROOT / "docs" / "_build" / "html"
    cmd = [str(venv_python(VENV)), "-m", "sphinx", "-W", "--keep-going", "-n", "-b", "html"]
    cmd += [str(ROOT / "docs"), str(out)]
    log("docs: " + " ".join(cmd))
    rc = subprocess.call(cmd, cwd=ROOT)
    if rc == 0:
        log(f"docs: open file://{out / 'index.html'}")
    return rc


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
        if cmd == "docs":
            if rest:
                print(f"docs takes no arguments\n{USAGE}", file=sys.stderr)
                return 2
            return docs_command()
        if cmd == "lock":
            return lock_command(rest)
    except StepError as e:
        log(f"FAILED: {e}")
        return 1
    print(f"unknown command {cmd!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
