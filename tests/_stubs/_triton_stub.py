# Test-only stand-in for `triton`, the Triton GPU kernel compiler (stallguard's tests never
# run a kernel).
# Why not the real package: SGLang imports `triton` unconditionally at import time
# (sglang/srt/utils/common.py), but this project's machines are CPU-only, so no kernel
# is ever compiled. The real wheel is 286 MB (about 1 GB installed) and nothing in it
# would be used. See shared/notes/sglang.md section 11 and sglang-0.5.17.md section 6.
#
# What it does: a meta-path finder, appended to sys.meta_path (so a real triton, if ever
# installed, wins), that serves `triton` and every `triton.*` as a permissive module:
#   * `__version__ = "3.6.0"`;
#   * `jit` / `autotune` / `heuristics` (and a few more) are identity decorators, bare or called;
#   * Capitalised names are dummy classes (torch's flop_counter does
#     `isinstance(x, triton.runtime.jit.JITFunction)`);
#   * well-known subpackages (`language`, `runtime`, ...) are modules of this stub;
#   * `triton.runtime.driver.active` RAISES, like real triton with no GPU backend, so
#     `get_available_device()` in sglang's fla/utils.py falls back to "cpu" (SGLang 0.5.17
#     does `getattr(torch, <backend>)` at import time and would crash on a MagicMock);
#   * any other attribute is a MagicMock; dunders raise AttributeError.
# Modules are marked with `__stallguard_stub__ = True`.
from __future__ import annotations

import sys
import types
from importlib.machinery import ModuleSpec

# Kept cheap: this module is imported at every interpreter start in the dev venvs (no
# importlib.abc, unittest.mock only when a MagicMock is first needed).

__all__ = ["install", "is_installed"]

_ROOT = "triton"
_SUBMODULES = {
    "language",
    "runtime",
    "compiler",
    "testing",
    "tools",
    "backends",
    "experimental",
    "language.core",
    "language.math",
    "language.extra",
    "language.extra.cuda",
    "language.extra.libdevice",
    "runtime.jit",
    "runtime.autotuner",
    "runtime.driver",
    "runtime.errors",
    "compiler.compiler",
    "tools.tensor_descriptor",
}
_DECORATORS = {"jit", "autotune", "heuristics", "constexpr_function", "must_use_result"}


def _decorator(*args, **kwargs):
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return lambda fn: fn


class _StubModule(types.ModuleType):
    __stallguard_stub__ = True

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        rel = full[len(_ROOT) + 1 :]
        if self.__name__ == "triton.runtime.driver" and name == "active":
            # Real triton without a GPU backend raises here too; never cached.
            raise RuntimeError(
                "0 active drivers ([]). There should only be one. "
                "(triton test stub: CPU-only machine)"
            )
        if rel in _SUBMODULES:
            value = __import__(full, fromlist=["_"])
        elif name in _DECORATORS:
            value = _decorator
        elif name[:1].isupper():
            value = type(
                name, (), {"__module__": self.__name__, "__init__": lambda self, *a, **k: None}
            )
        else:
            from unittest import mock

            value = mock.MagicMock(name=full)
        setattr(self, name, value)
        return value


class _Loader:
    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        module.__file__ = __file__
        if module.__name__ == _ROOT:
            module.__version__ = "3.6.0"
        # Subpackages must be packages so that `import triton.language.core` works.
        module.__path__ = []


class _Finder:
    _stallguard_triton_stub = True

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _ROOT and not fullname.startswith(_ROOT + "."):
            return None
        spec = ModuleSpec(fullname, _Loader(), is_package=True)
        spec.submodule_search_locations = []
        return spec


def is_installed() -> bool:
    return any(getattr(f, "_stallguard_triton_stub", False) for f in sys.meta_path)


def install() -> None:
    """Idempotent. Appended last: a real `triton` found on sys.path takes precedence."""
    if not is_installed():
        sys.meta_path.append(_Finder())
