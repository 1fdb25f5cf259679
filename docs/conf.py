"""Sphinx configuration of the docs site: the Markdown chapters in this directory (read by
MyST) and an API reference generated from the docstrings (autodoc, Google-style sections
via napoleon), whose Sphinx cross-references are rendered as links.

Build: ``python3 tools/dev.py docs`` (or ``.venv/bin/sphinx-build -W -n -b html docs
docs/_build/html``). ``-W -n`` makes every warning an error and checks every
cross-reference: a broken link between pages, a missing heading anchor, or a
``:class:`~stallguard.X``` that names nothing fails the build (tests/test_docs_site.py
runs it in the test suite).
"""

from __future__ import annotations

import ast
import builtins
import collections.abc
import importlib
import importlib.util
import inspect
import pkgutil
import re
import sys
import typing
from pathlib import Path
from typing import Any

from sphinx.errors import PycodeError
from sphinx.ext.autodoc.mock import mock
from sphinx.pycode import ModuleAnalyzer

project = "stallguard"
author = "the stallguard developers"
copyright = "the stallguard developers; Apache-2.0"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]

# stallguard-vllm's API pages: the package is pure Python (installed editable only in
# .venv-vllm, so from the checkout here), and its connector module imports vLLM, which
# the docs' environment does not have: autodoc imports it against stand-ins for vLLM's
# and torch's modules (its own code and docstrings are what the page shows)
if importlib.util.find_spec("stallguard_vllm") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "adapters" / "vllm" / "src"))
autodoc_mock_imports = ["vllm", "torch"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "img", "_static"]

html_theme = "furo"
html_title = "stallguard"
# wide tables and long code lines wrap inside the page (docs/_static/wrap.css)
html_static_path = ["_static"]
html_css_files = ["wrap.css"]

# Markdown: `[Metrics](#metrics)`-style links to headings, as GitHub renders them.
myst_heading_anchors = 4

# Docstrings are Google style (Args:, Returns:, Raises:).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": True}

# Every cross-reference must resolve, except to things this site does not document:
# the standard library, attrs, anyio, OpenTelemetry, transitions, SGLang (no
# intersphinx: the build runs offline). So a dotted target outside stallguard, or a
# builtin / typing / collections.abc name, may stay unresolved; anything else that
# names nothing (`:class:`~stallguard.Nope``, `:data:`METRIC_NOPE``) fails the build.
_EXTERNAL = sorted(
    {n for n in dir(builtins) if not n.startswith("_")}
    | set(typing.__all__)
    | set(collections.abc.__all__)
    | set(sys.stdlib_module_names)
    | {"TypeVar", "ParamSpec", "TypeAlias", "Self", "NoneType", "Ellipsis", "..."}
)
_VLLM_TYPES = [
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVConnectorOutput",
    "KVConnectorPromMetrics",
    "KVConnectorStats",
    "PromMetric",
    "PromMetricT",
    "Request",
    "SchedulerOutput",
    "VllmConfig",
]
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(?!stallguard)\w+\..*"),
    (r"py:.*", "|".join(re.escape(n) for n in _EXTERNAL)),
    # vLLM's classes in stallguard_vllm.connector's signatures (imported there only for
    # type checking, so autodoc sees their bare names)
    (r"py:class", "|".join(_VLLM_TYPES)),
    # the generic classes' type variables (Watchdog[K], Expiry[K], ...), not API names
    (r"py:.*", r"(stallguard(\.\w+)*\._\w+\.)?[A-Z]"),
]

# A package's API is its __all__, whatever module defines each name (the packages
# re-export from private modules); "imported-members" keeps the constants, whose values
# (str, ...) would otherwise count as imported from builtins. Undocumented members too:
# every public name has docs, a docstring or, for a constant, a `#:` comment where it
# is defined, which _reexported_doc_comment finds.
autodoc_default_options["imported-members"] = True
autodoc_default_options["undoc-members"] = True


def _attr_doc(modname: str, attr: str) -> list[str] | None:
    """The ``#:`` comment of *attr* in module *modname*, if any."""
    try:
        with mock(autodoc_mock_imports):  # (the analyzer imports the module; it caches)
            return ModuleAnalyzer.for_module(modname).find_attr_docs().get(("", attr))
    except PycodeError:
        return None


def _reexported_doc_comment(
    app: Any, what: str, name: str, obj: object, options: object, lines: list[str]
) -> None:
    """A constant re-exported by a package (``stallguard.instrumentation.METRIC_EXPIRIES``)
    has its ``#:`` comment in the module that defines it, but autodoc reads only the
    package's own source (and falls back to the docstring of the value's type, e.g.
    ``str``'s). Take the comment from the package's submodules."""
    if what != "data":
        return
    modname, _, attr = name.rpartition(".")
    if _attr_doc(modname, attr):
        return  # documented where autodoc looks
    package = importlib.import_module(modname)
    for info in pkgutil.iter_modules(getattr(package, "__path__", [])):
        found = _attr_doc(f"{modname}.{info.name}", attr)
        if found:
            lines[:] = [*found, ""]
            return


def _import(modname: str) -> Any:
    """*modname*, imported the way autodoc imports it (autodoc_mock_imports)."""
    with mock(autodoc_mock_imports):
        return importlib.import_module(modname)


def _constants(modname: str) -> list[str]:
    """The names of *modname*'s ``__all__`` that are neither classes, functions nor
    modules: autodoc's automodule leaves such re-exported values out, so the API pages
    get an ``autodata`` directive for each (see _add_constants)."""
    module = _import(modname)
    return [
        n
        for n in getattr(module, "__all__", [])
        if not _attr_doc(modname, n)  # defined and documented here: automodule has it
        and not (
            inspect.isclass(v := getattr(module, n)) or inspect.isroutine(v) or inspect.ismodule(v)
        )  # values, type aliases (Mode, AsyncWait) and objects such as the default hooks
    ]


def _add_constants(app: Any, docname: str, source: list[str]) -> None:
    if not docname.startswith("api/"):
        return
    m = re.search(r"^\.\. automodule:: (\S+)$", source[0], re.M)
    if m is None:
        return
    modname = m.group(1)
    names = _constants(modname)
    if names:
        module = _import(modname)

        def directive(name: str) -> str:
            value = getattr(module, name)
            plain = isinstance(value, (str, int, float)) and len(repr(value)) < 60
            return f".. autodata:: {modname}.{name}" + ("" if plain else "\n   :no-value:")

        block = "\n".join(
            [
                "```{eval-rst}",
                ".. rubric:: Constants and objects",
                "",
                *map(directive, names),
                "```",
            ]
        )
        source[0] += "\n" + block + "\n"


# The chapters, in reading order; any other docs/*.md page follows, alphabetically, so a
# new page is on the site without registering it (index.md's toctree says CHAPTERS).
CHAPTER_ORDER = [
    "demo",
    "sglang",
    "sglang-internals",
    "specs",
    "watchdog",
    "guard",
    "runners",
    "transitions",
    "config",
    "instrumentation",
    "testing",
    "performance",
    "dependencies",
]


def chapters() -> list[str]:
    pages = {p.stem for p in Path(__file__).parent.glob("*.md")} - {"index"}
    return [c for c in CHAPTER_ORDER if c in pages] + sorted(pages - set(CHAPTER_ORDER))


def _fill_chapters(app: object, docname: str, source: list[str]) -> None:
    if docname == "index":
        source[0] = source[0].replace("\nCHAPTERS\n", "\n" + "\n".join(chapters()) + "\n")


def _public_bases(app: Any, name: str, obj: object, options: object, bases: list[Any]) -> None:
    """Watchdog's base ``_core.WatchdogCore`` (the part the optional compiled core builds)
    is private: Watchdog binds the core's public members in its own body, so they are
    documented as its own; the base is left out of its "Bases"."""
    bases[:] = [b for b in bases if getattr(b, "__module__", "") != "stallguard._core"]


def _typed_stubs() -> dict[str, tuple[str, str]]:
    """The signatures Watchdog gives type checkers (its ``if TYPE_CHECKING:`` block) for
    the core's methods whose arguments the library validates itself (typed ``Any`` in
    ``_core``, so that the compiled core does not check them): name -> (args, return)."""
    tree = ast.parse((Path(__file__).parent.parent / "stallguard" / "_watchdog.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Watchdog"]
    stubs = {}
    for node in ast.walk(cls):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef):
                    fn.args.args = fn.args.args[1:]  # (self)
                    returns = ast.unparse(fn.returns) if fn.returns else "None"
                    stubs[fn.name] = (f"({ast.unparse(fn.args)})", returns)
    return stubs


def _typed_signature(
    app: Any, what: str, name: str, obj: object, options: object, signature: Any, ret: Any
) -> tuple[str, str] | None:
    """Watchdog's methods from its core, shown with the types Watchdog declares for them."""
    owner, _, method = name.rpartition(".")
    if what == "method" and owner == "stallguard.Watchdog":
        stub = _typed_stubs().get(method)
        if stub is not None:
            return stub
    return None


def setup(app: Any) -> None:
    app.connect("autodoc-process-signature", _typed_signature)
    app.connect("autodoc-process-bases", _public_bases)
    app.connect("source-read", _fill_chapters)
    app.connect("source-read", _add_constants)
    app.connect("autodoc-process-docstring", _reexported_doc_comment)


# A class's "Attributes:" section becomes fields of the class, not a second description
# of each attribute next to autodoc's own.
napoleon_use_ivar = True
