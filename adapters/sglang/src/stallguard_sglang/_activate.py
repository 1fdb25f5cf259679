"""Activation for SGLang builds without the plugin framework.

The wheel installs ``stallguard_sglang_activate.pth`` into site-packages. Python runs it
at every interpreter start, including the ``multiprocessing`` ``spawn`` children that
SGLang's schedulers run in. Disabled, it costs two environment lookups; enabled
(``STALLGUARD_SGLANG_CONFIG`` or ``STALLGUARD_SGLANG`` set), it imports this module and
looks for SGLang's plugin framework on disk, about a millisecond (docs/sglang.md has the
measured figure): nothing it imports pulls in ``importlib.metadata``, ``packaging`` or
stallguard itself.

**It never stops an interpreter.** A ``.pth`` runs in every interpreter of the
environment (``pip`` included): on a bad ``STALLGUARD_SGLANG_ACTIVATION`` or any error
it prints one warning line on stderr and stands aside. Refusing to start on a bad
configuration is left to the adapter inside SGLang (the plugin entry point, or the
import hook below when SGLang's prefill module is imported).

:func:`install_import_hook` then puts a tiny ``sys.meta_path`` finder in place (nothing
heavy is imported at start-up). When ``sglang.srt.disaggregation.prefill`` is imported,
the finder lets SGLang's own loader run the module, then reads the configuration (a bad
file stops the process there, with the file, key and value) and wraps the hook targets
directly (:func:`stallguard_sglang.plugin.install` with ``via="patch"``).

``STALLGUARD_SGLANG_ACTIVATION`` chooses: ``auto`` (default: this fallback only when the
installed SGLang has no ``sglang.srt.plugins``, so the entry point and the fallback never
both run), ``pth`` (always use the fallback) or ``plugin`` (never).
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

# Start-up cost: this module runs at interpreter start-up when the adapter is enabled, so
# it imports only what the interpreter has already loaded (no typing, no importlib.abc:
# that one pulls in importlib.resources, tempfile, shutil... about 15 ms).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import ModuleType
    from typing import Any

__all__ = ["ACTIVATIONS", "ENV_ACTIVATION", "TRIGGER_MODULE", "from_pth", "install_import_hook"]

ENV_ACTIVATION = "STALLGUARD_SGLANG_ACTIVATION"
#: The values :data:`ENV_ACTIVATION` accepts (empty or unset: ``auto``).
ACTIVATIONS = ("auto", "pth", "plugin")
#: The module whose import applies the hooks (it defines the queue methods).
TRIGGER_MODULE = "sglang.srt.disaggregation.prefill"


def _activate_now() -> None:
    from .plugin import activate

    activate(via="patch")  # a bad configuration: SystemExit, naming the file


class _Loader:
    """Delegates to SGLang's real loader, then activates the adapter (an
    ``importlib.abc.Loader`` by protocol: create_module / exec_module)."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _activate_now()


class _Finder:
    """A ``sys.meta_path`` finder (by protocol: find_spec) that fires once, for
    :data:`TRIGGER_MODULE`."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TRIGGER_MODULE:
            return None
        sys.meta_path.remove(self)  # fire once
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader)  # type: ignore[assignment]  # a Loader by protocol
        return spec


def install_import_hook() -> bool:
    """Arrange for the adapter to activate when SGLang's prefill module is imported.

    Returns:
        True if the import hook was installed (or the adapter activated at once because
        the module was already imported); False if the plugin entry point will do it.

    Raises:
        ValueError: if :data:`ENV_ACTIVATION` holds none of :data:`ACTIVATIONS` (the
            message names the variable and the value).
    """
    if _plugin_activates(_activation()):
        return False
    if TRIGGER_MODULE in sys.modules:
        _activate_now()
        return True
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return True


def _activation() -> str:
    """:data:`ENV_ACTIVATION`, one of :data:`ACTIVATIONS` (default ``auto``)."""
    raw = os.environ.get(ENV_ACTIVATION, "auto")
    choice = raw.strip().lower() or "auto"
    if choice not in ACTIVATIONS:
        raise ValueError(
            f"environment variable {ENV_ACTIVATION}={raw!r}: expected one of "
            f"{', '.join(ACTIVATIONS)}"
        )
    return choice


def _plugin_activates(choice: str) -> bool:
    """Whether the plugin entry point activates the adapter, for the activation
    *choice*: always for ``plugin``; for ``auto``, if SGLang has the plugin framework."""
    if choice == "plugin":
        return True
    if choice == "auto":
        from .package import has_plugin_framework

        return has_plugin_framework()
    return False


def from_pth() -> bool:
    """What ``stallguard_sglang_activate.pth`` runs: :func:`install_import_hook`, except
    that nothing escapes: an error (a bad :data:`ENV_ACTIVATION`, or anything else) is
    one warning line on stderr and the adapter stands aside in this interpreter.

    Returns:
        True if the import hook was installed.
    """
    try:
        return install_import_hook()
    except Exception as e:
        _warn(f"{e}" if isinstance(e, ValueError) else f"{type(e).__name__}: {e}")
        return False


def _warn(problem: str) -> None:
    try:
        sys.stderr.write(
            f"stallguard-sglang: warning: {problem}; not activated from the .pth file "
            "in this interpreter\n"
        )
    except Exception:
        pass
