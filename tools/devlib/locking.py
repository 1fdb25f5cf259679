"""The locks in tools/lock/: every distribution of a venv with its exact version and
sha256 hashes, resolved by ``uv pip compile`` (an off-the-shelf resolver) from the
venv's :class:`~devlib.envs.VenvSpec`, and installed by ``pip install --no-deps
--require-hashes``.

uv does not read pip's configuration, so :func:`pip_sources` hands it this machine's
(``pip config list``: the find-links directory holding the local torch CPU wheel, the
extra indexes, the global constraints file), with ``--index-strategy
unsafe-best-match``, which is what pip does (the best version across every index; uv's
default stops at the first index that has the package). The ``--no-deps`` groups
(SGLang and NIXL, whose declared dependencies are the CUDA stack) are a second
``uv pip compile --no-deps`` of their own, merged with the first.
"""

from __future__ import annotations

import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomllib

from .common import (
    ROOT,
    VENV,
    StepError,
    canonical,
    log,
    requirement_name,
    run,
    sha,
)
from .envs import FORBIDDEN, UV, VENVS, VenvSpec

LOCK_FORMAT = 1
LOCK_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
#: one requirement of uv's output: ``name==version \`` then its ``--hash=sha256:`` lines
UV_ENTRY = re.compile(
    r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)((?:\s*\\\n\s+--hash=sha256:[0-9a-f]{64})*)", re.M
)
UV_VERSION = UV.split("==")[1]


def project_requirements(spec: VenvSpec) -> list[str]:
    """The editable projects' runtime dependencies, the extras named in `spec`, and
    their PEP 735 dependency groups (all, or those `spec` names), minus the projects
    themselves."""
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
        for name, group in groups.items():
            if spec.dependency_groups is not None and name not in spec.dependency_groups:
                continue
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
            f"{rel} is out of date: {spec.name}'s package lists (tools/devlib/envs.py), "
            f"{spec.constraints.relative_to(ROOT)} or a pyproject.toml's dependencies "
            f"changed since it was generated. Run `python3 tools/dev.py lock` and commit "
            f"the new lock"
        )
    return pins


def pip_sources(config: str) -> list[str]:
    """uv's arguments for the package sources in *config* (``pip config list``'s output:
    ``global.find-links='/opt/wheels'``, ``:env:.extra-index-url='...'``, ...): every
    find-links location, index and extra index, and the global constraints file."""
    values: dict[str, list[str]] = {}
    for line in config.splitlines():
        m = re.match(r"^\S*?\.([a-z-]+)='(.*)'$", line.strip())
        if m:
            for value in m.group(2).split():
                seen = values.setdefault(m.group(1), [])
                if value not in seen:
                    seen.append(value)
    args: list[str] = []
    for key, flag in (
        ("index-url", "--index-url"),
        ("extra-index-url", "--extra-index-url"),
        ("find-links", "--find-links"),
        ("constraint", "--constraint"),
    ):
        for value in values.get(key, []):
            args += [flag, value]
    return args


def uv_binary(tmp: Path) -> Path:
    """The pinned uv: .venv's (it is in .venv's lock), else installed for this run into
    *tmp* with pip (pinned, and hash-checked when .venv's lock lists it)."""
    target = tmp / "uv"
    if (target / "bin" / "uv").exists():
        return target / "bin" / "uv"  # installed by an earlier venv's resolution
    mine = VENV / "bin" / "uv"
    if mine.exists():
        said = subprocess.run([str(mine), "--version"], capture_output=True, text=True).stdout
        if said.split()[1:2] == [UV_VERSION]:
            return mine
    req = tmp / "uv-requirement.txt"
    entry = re.search(r"^uv==\S+ \\\n(?:\s+--hash=\S+(?: \\)?\n)+", _lock_text(VENVS[0]), re.M)
    if entry and entry.group(0).startswith(f"{UV} "):
        req.write_text(entry.group(0))
        pin = ["--require-hashes", "-r", str(req)]
    else:
        pin = [UV]
    log(f"lock: installing {UV} for this run")
    run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, *pin])
    return target / "bin" / "uv"


def _lock_text(spec: VenvSpec) -> str:
    try:
        return spec.lock.read_text()
    except OSError:
        return ""


def compile_command(
    uv: Path, spec: VenvSpec, reqs: Path, out: Path, *, no_deps: bool, sources: list[str]
) -> list[str]:
    """The ``uv pip compile`` of one pass (with dependencies, or ``--no-deps``)."""
    return [
        str(uv), "pip", "compile", "--quiet", "--no-header", "--no-annotate",
        "--generate-hashes", "--python", sys.executable, "--index-strategy",
        "unsafe-best-match", *sources, "--constraint", str(spec.constraints),
        *(["--no-deps"] if no_deps else []), "--output-file", str(out), str(reqs),
    ]  # fmt: skip


def parse_compiled(text: str) -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """{canonical name: (name, version, sha256s)} of uv's output."""
    found = {}
    for m in UV_ENTRY.finditer(text):
        digests = tuple(re.findall(r"sha256:([0-9a-f]{64})", m.group(3)))
        if not digests:
            raise StepError(f"uv reported no sha256 for {m.group(1)}=={m.group(2)}")
        found[canonical(m.group(1))] = (m.group(1), m.group(2), digests)
    return found


def resolve(spec: VenvSpec, tmp: Path) -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """{canonical name: (name, version, sha256s)} of every distribution `spec` installs,
    resolved by uv for this interpreter without installing anything."""
    with_deps = [p for g in spec.groups if g.deps for p in g.packages]
    with_deps += project_requirements(spec)
    no_deps = [p for g in spec.groups if not g.deps for p in g.packages]
    uv = uv_binary(tmp)
    config = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    sources = pip_sources(config)
    found: dict[str, tuple[str, str, tuple[str, ...]]] = {}
    for reqs, flag in ((with_deps, False), (no_deps, True)):
        if not reqs:
            continue
        infile = tmp / f"{spec.name.lstrip('.')}-{int(flag)}.in"
        infile.write_text("\n".join(reqs) + "\n")
        out = infile.with_suffix(".txt")
        log(f"lock {spec.name}: resolving {len(reqs)} requirements{' (--no-deps)' * flag}")
        run(compile_command(uv, spec, infile, out, no_deps=flag, sources=sources))
        for key, (name, version, digests) in parse_compiled(out.read_text()).items():
            if key in found and found[key][1] != version:
                raise StepError(
                    f"{name}: the --no-deps groups pin {version} but the others resolve "
                    f"{found[key][1]}; make the lists agree"
                )
            found[key] = (name, version, digests)
    bad = sorted(set(found) & {canonical(n) for n in FORBIDDEN})
    if bad:
        raise StepError(f"the resolution of {spec.name} pulls in forbidden {bad}")
    return found


def lock_text(spec: VenvSpec, found: dict[str, tuple[str, str, tuple[str, ...]]]) -> str:
    lines = [
        "# Generated by `python3 tools/dev.py lock` from tools/dev.py's lists for "
        f"{spec.name} and {spec.constraints.relative_to(ROOT)}; do not edit.",
        f"# Installed by `python3 tools/dev.py {spec.built_by}`: pip install --no-deps "
        f"--require-hashes -r {spec.lock.relative_to(ROOT)}",
        f"# Python {sys.version_info.major}.{sys.version_info.minor} on {platform.machine()}; "
        f"{len(found)} distributions; resolved by uv {UV_VERSION} (uv pip compile).",
        f"# inputs: {lock_inputs(spec)}",
    ]
    for key in sorted(found):
        _name, version, digests = found[key]
        hashes = " \\\n".join(f"    --hash=sha256:{d}" for d in digests)
        lines.append(f"{key}=={version} \\\n{hashes}")
    return "\n".join(lines) + "\n"


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
            spec.lock.parent.mkdir(parents=True, exist_ok=True)
            spec.lock.write_text(lock_text(spec, found))
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


def unlocked_extras(spec: VenvSpec, pins: dict[str, str]) -> list[str]:
    """Distributions in `spec`'s own site-packages that its lock does not list (left by
    an older lock or installed by hand); `env` reports them and leaves them."""
    import importlib.metadata as md

    from .common import site_packages

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
