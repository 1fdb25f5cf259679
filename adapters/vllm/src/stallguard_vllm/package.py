"""Which vLLM releases the adapter supports."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["SUPPORTED_VLLM", "TESTED_VLLM", "is_supported", "vllm_version"]

#: The releases whose NIXL connector layout (``nixl/`` package, pull and push
#: schedulers/workers) the adapter is written against.
SUPPORTED_VLLM = ">=0.33,<0.34"
#: Tested in CI (tools/dev.py builds .venv-vllm with it).
TESTED_VLLM = ("0.33.0",)


def vllm_version() -> str | None:
    """The installed vLLM's version, or None (read from metadata: vLLM is not imported)."""
    try:
        return version("vllm")
    except PackageNotFoundError:
        return None


def is_supported(v: str) -> bool:
    """True if vLLM *v* is in :data:`SUPPORTED_VLLM`."""
    parts = v.split("+")[0].split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return False
    return (major, minor) == (0, 33)
