# Shared helpers of the test-only `torchvision` stand-in (see torchvision/__init__.py for why).
from __future__ import annotations

import enum


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _unavailable_class(module: str, name: str) -> type:
    def _raise(*args, **kwargs):
        raise RuntimeError(
            f"{module}.{name} is a test stub: torchvision is not installed in stallguard's dev "
            "environment (no CPU build exists for torch 2.13.0+cpu); see tests/_stubs/torchvision"
        )

    return type(name, (), {"__module__": module, "__init__": _raise, "__call__": _raise})


def module_getattr(module: str):
    """A module-level `__getattr__`: any public name is a class that raises when used."""
    cache: dict[str, type] = {}

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        if name not in cache:
            cache[name] = _unavailable_class(module, name)
        return cache[name]

    return __getattr__
