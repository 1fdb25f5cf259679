"""Runs every Python block of README.md and docs/*.md as a test (Sybil).

A page declares the set-up its examples need in hidden blocks
(``<!-- invisible-code-block: python ... -->``), and marks a block that cannot run on
its own with ``<!-- skip: next "fragment: why" -->`` (reported as a skip, with the
reason). The blocks of one page share a namespace, in page order. Any new page in docs/
is covered without registering it here. After each page, the process-wide state that
examples may change (instrumentation hooks, metrics, the working directory) is restored.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from hypothesis import settings
from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parent

# The compiled core's run (`tools/dev.py test` runs the core tests a second time against
# a compiled build: STALLGUARD_TEST_COMPILED is the directory holding the build's copy of
# the package). pytest has just put this directory first on sys.path, where the sources
# would be imported; the build goes before it. tests/test_compiled.py fails if the
# sources run all the same.
_COMPILED = os.environ.get("STALLGUARD_TEST_COMPILED", "")
if _COMPILED:
    if "stallguard" in sys.modules:
        raise RuntimeError(
            f"STALLGUARD_TEST_COMPILED={_COMPILED}: stallguard was imported before the "
            f"root conftest.py ran, from {sys.modules['stallguard'].__file__}"
        )
    if not os.path.isfile(os.path.join(_COMPILED, "stallguard", "__init__.py")):
        raise RuntimeError(f"STALLGUARD_TEST_COMPILED={_COMPILED}: no stallguard package there")
    sys.path.insert(0, os.path.abspath(_COMPILED))

# stallguard-vllm is installed (editable) only in .venv-vllm, but its pure-Python parts
# (config, advise, phases) are tested in .venv too, by tests/ as well as by
# adapters/vllm/tests/: importable from the checkout for any selection of tests, not
# only once adapters/vllm/tests/conftest.py happens to have been collected
if importlib.util.find_spec("stallguard_vllm") is None:
    sys.path.insert(0, str(ROOT / "adapters" / "vllm" / "src"))

# Hypothesis profiles of the whole suite (tests/, adapters/*/tests/). No property test
# here is about how long one example takes, and hypothesis's default 200 ms per-example
# deadline fails them on a loaded machine (a DeadlineExceeded that says nothing about the
# code), so the default profile, "suite", has none. "long" is for local hunting
# (docs/testing.md). HYPOTHESIS_PROFILE picks one; --hypothesis-profile overrides both.
settings.register_profile("suite", deadline=None)
settings.register_profile("long", max_examples=5_000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))


def _setup(namespace: dict) -> None:
    namespace["__sybil_cwd"] = os.getcwd()


def _teardown(namespace: dict) -> None:
    os.chdir(namespace["__sybil_cwd"])
    from stallguard import instrumentation

    instrumentation.set_on_expire_hooks(None)
    instrumentation.disable_metrics()


_collect = Sybil(
    parsers=[PythonCodeBlockParser(), SkipParser()],
    patterns=["*.md"],
    setup=_setup,
    teardown=_teardown,
).pytest()


def is_doc_page(path: Path) -> bool:
    """README.md and the pages of docs/ (not docs/api/, which only holds directives)."""
    path = path.resolve()
    return path == ROOT / "README.md" or (path.parent == ROOT / "docs" and path.suffix == ".md")


def pytest_collect_file(file_path: Path, parent):  # type: ignore[no-untyped-def]
    if is_doc_page(file_path):
        return _collect(file_path, parent)
    return None
