"""Which core runs: the compiled accelerator or the pure-Python sources.

The compiled build (mypyc; ``hatch_build.py``) turns the hot-path modules, ``_fifo``
and ``_core``, into extension modules that sit beside their sources in the package,
with their shared library ``core__mypyc``. Python's import system prefers an extension
module to a source file of the same name, so when they are there, and load, they run.
This module decides once, when ``stallguard`` is imported and before anything imports
the two modules, and ``stallguard.__compiled__`` says what it decided:

* ``STALLGUARD_PURE=1`` (any value but ``""`` and ``"0"``): the sources run, even
  beside a compiled build (the test suite runs both ways; a bug report can rule the
  accelerator out);
* no compiled build in the package (the pure wheel, a source checkout): the sources;
* a compiled build that does not load (its shared library refused by this interpreter)
  or is incomplete: the sources, loaded explicitly by path, and :data:`WHY` says why;
* otherwise the compiled modules.

Both builds behave the same (the suite runs against both: docs/performance.md, "The
compiled core"); only the speed of a state change and a check differs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from importlib.machinery import EXTENSION_SUFFIXES
from typing import TYPE_CHECKING, TypeVar

__all__ = ["COMPILED", "MODULES", "PURE_ENV", "WHY", "mypyc_attr"]

T = TypeVar("T")

if TYPE_CHECKING:  # what mypyc reads (a compiled module's decorator is resolved here)
    from mypy_extensions import mypyc_attr as mypyc_attr
else:

    def mypyc_attr(*_flags: str, **_options: object) -> Callable[[T], T]:
        """mypyc's class flags: read by mypyc when it compiles a module, nothing when
        the module runs (mypy_extensions is not a dependency)."""
        return lambda cls: cls


#: the compiled modules, in the order they are loaded (``_core`` imports ``_fifo``)
MODULES = ("_fifo", "_core")
#: their shared library (mypyc's group; ``hatch_build.GROUP``)
LIBRARY = "core__mypyc"
#: set to ``1`` to run the sources even beside a compiled build
PURE_ENV = "STALLGUARD_PURE"

_PACKAGE = __name__.rpartition(".")[0]
_HERE = os.path.dirname(os.path.abspath(__file__))


def _extensions() -> set[str]:
    """The names of the package's modules that are extension modules here."""
    found: set[str] = set()
    try:
        entries = os.listdir(_HERE)
    except OSError:  # not a directory (a zip import): no extension module can load there
        return found
    for entry in entries:
        for suffix in EXTENSION_SUFFIXES:
            if entry.endswith(suffix):
                found.add(entry[: -len(suffix)])
                break
    return found


def _load_sources() -> None:
    """Import :data:`MODULES` from their ``.py`` files, whatever sits beside them."""
    from importlib.util import module_from_spec, spec_from_file_location

    package = sys.modules[_PACKAGE]
    for name in MODULES:
        full = f"{_PACKAGE}.{name}"
        spec = spec_from_file_location(full, os.path.join(_HERE, f"{name}.py"))
        assert spec is not None and spec.loader is not None
        module = module_from_spec(spec)
        sys.modules[full] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[full]
            raise
        setattr(package, name, module)


def _choose() -> tuple[bool, str]:
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        _load_sources()
        return False, f"{PURE_ENV} is set"
    present = _extensions()
    wanted = {*MODULES, LIBRARY}
    if not present & wanted:
        return False, "this installation has no compiled core (pure-Python wheel or sources)"
    if not wanted <= present:
        _load_sources()
        missing = ", ".join(sorted(wanted - present))
        return False, f"the compiled core is incomplete (no {missing}): running the sources"
    try:
        __import__(f"{_PACKAGE}.{LIBRARY}")
    except ImportError as exc:
        _load_sources()
        return False, f"the compiled core does not load ({exc}): running the sources"
    return True, "compiled with mypyc"


#: True when the compiled core runs (``stallguard.__compiled__``)
COMPILED: bool
#: why the sources run, or ``"compiled with mypyc"``
WHY: str
COMPILED, WHY = _choose()
