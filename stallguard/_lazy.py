"""A package's lazy face: public names imported from their private modules at first
use (part of :mod:`stallguard.adapters`). An engine adapter's package is imported where
the engine is not (a plugin scan, a ``.pth`` file, a CLI), so its ``__init__`` must
import nothing heavy."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable, Mapping

__all__ = ["lazy_attribute", "lazy_names"]

_INDEX: dict[tuple[str, int], dict[str, str]] = {}


def lazy_names(exports: Mapping[str, Iterable[str]], *eager: str) -> list[str]:
    """The public names of a package: those of *exports* and the *eager* ones it
    defines itself, sorted (its ``__all__`` and ``__dir__``)."""
    return sorted({*eager, *(name for names in exports.values() for name in names)})


def lazy_attribute(
    package: str, exports: Mapping[str, Iterable[str]], name: str, *, distribution: str
) -> object:
    """What a package's module ``__getattr__`` returns for *name*: the object of that
    name in the module *exports* lists it under (module names relative to *package*:
    ``{"._config": ("Config", "load_config")}``), imported now and cached in the
    package's namespace (later lookups are plain attribute reads); ``__version__`` is
    *distribution*'s installed version (``0+unknown`` in a checkout never installed).

    A package using it keeps its static types with ``if TYPE_CHECKING:`` imports of the
    same names (``from ._config import Config as Config``)::

        def __getattr__(name: str) -> object:
            from stallguard.adapters import lazy_attribute

            return lazy_attribute(__name__, _EXPORTS, name, distribution="my-adapter")

    Raises:
        AttributeError: for a name the package does not export.
    """
    module = _index(package, exports).get(name)
    if module is None:
        return _unexported(package, name, distribution)
    value = getattr(importlib.import_module(module, package), name)
    setattr(sys.modules[package], name, value)
    return value


def _index(package: str, exports: Mapping[str, Iterable[str]]) -> dict[str, str]:
    """Name -> module of *exports*, built once per package and exports."""
    index = _INDEX.get((package, id(exports)))
    if index is None:
        index = {n: module for module, names in exports.items() for n in names}
        _INDEX[(package, id(exports))] = index
    return index


def _unexported(package: str, name: str, distribution: str) -> str:
    """``__version__``, or the AttributeError for a name *package* does not export."""
    if name == "__version__":
        from ._versions import installed_version

        return installed_version(distribution) or "0+unknown"
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
