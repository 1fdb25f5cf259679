"""Which vLLM releases the adapter supports."""

from __future__ import annotations

from stallguard.adapters import VersionSupport

__all__ = ["SUPPORT", "SUPPORTED_VLLM", "TESTED_VLLM", "is_supported", "vllm_version"]

#: The releases whose NIXL connector layout (``nixl/`` package, pull and push
#: schedulers/workers) the adapter is written against.
SUPPORTED_VLLM = ">=0.33,<0.34"
#: Tested in CI (tools/dev.py builds .venv-vllm with it).
TESTED_VLLM = ("0.33.0",)
#: :data:`SUPPORTED_VLLM` and its check (PEP 440, ``packaging``).
SUPPORT = VersionSupport("vllm", SUPPORTED_VLLM, label="vLLM", tested=TESTED_VLLM)


def vllm_version() -> str | None:
    """The installed vLLM's version, or None (read from metadata: vLLM is not imported)."""
    return SUPPORT.installed()


def is_supported(v: str) -> bool:
    """True if vLLM *v* is in :data:`SUPPORTED_VLLM` (PEP 440: ``0.33.2+cpu`` is,
    ``0.34.0rc1`` is not); False for a version that is not PEP 440."""
    try:
        return SUPPORT.contains(v)
    except ValueError:
        return False
