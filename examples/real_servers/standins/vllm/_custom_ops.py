"""STAND-IN for ``vllm._custom_ops`` (see ``vllm/__init__.py`` here): import only."""

from __future__ import annotations


def rotary_embedding(*args: object, **kwargs: object) -> None:
    raise NotImplementedError(
        "stallguard real-server stand-in: vllm._custom_ops.rotary_embedding is CUDA only "
        "and must not be called on CPU"
    )
