"""Activation for SGLang builds without the plugin framework.

The wheel installs ``stallguard_sglang_activate.pth`` into site-packages. Python runs it
at every interpreter start, including the ``multiprocessing`` ``spawn`` children that
SGLang's schedulers run in; it costs two environment lookups and imports this module
only when ``STALLGUARD_SGLANG_CONFIG`` or ``STALLGUARD_SGLANG`` is set.

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

import importlib.abc
import importlib.machinery
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["ENV_ACTIVATION", "TRIGGER_MODULE", "install_import_hook"]

log = logging.getLogger("stallguard.sglang")

ENV_ACTIVATION = "STALLGUARD_SGLANG_ACTIVATION"
#: The module whose import applies the hooks (it defines the queue methods).
TRIGGER_MODULE = "sglang.srt.disaggregation.prefill"


def _activate_now() -> None:
    from .plugin import install, load_config_or_exit

    config = load_config_or_exit()
    if config is not None:
        install(config, via="patch")


class _Loader(importlib.abc.Loader):
    """Delegates to SGLang's real loader, then activates the adapter."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _activate_now()


class _Finder(importlib.abc.MetaPathFinder):
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
        spec.loader = _Loader(spec.loader)
        return spec


def install_import_hook() -> bool:
    """Arrange for the adapter to activate when SGLang's prefill module is imported.

    Returns:
        True if the import hook was installed (or the adapter activated at once because
        the module was already imported); False if the plugin entry point will do it.
    """
    choice = os.environ.get(ENV_ACTIVATION, "auto").strip().lower() or "auto"
    if choice == "plugin":
        return False
    if choice == "auto":
        from .package import has_plugin_framework

        if has_plugin_framework():
            return False
    elif choice != "pth":
        raise SystemExit(
            f"stallguard-sglang: environment variable {ENV_ACTIVATION}={choice!r}: expected "
            "auto, pth or plugin"
        )
    if TRIGGER_MODULE in sys.modules:
        _activate_now()
        return True
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return True
