"""The docs site builds with every warning an error, and every Python block of the
docs is either run (conftest.py, Sybil) or marked as a fragment."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def load_root_conftest():
    spec = importlib.util.spec_from_file_location("_root_conftest", ROOT / "conftest.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_sphinx_build_is_strict_and_clean(tmp_path):
    """`sphinx-build -W -n` (what `python3 tools/dev.py docs` runs): a broken link, a
    missing anchor, or a docstring cross-reference to a stallguard name that does not
    exist fails it. The API pages have every public name."""
    out = tmp_path / "html"
    build = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-E", "-b", "html",
         str(ROOT / "docs"), str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    for page in (ROOT / "docs").glob("*.md"):
        assert (out / f"{page.stem}.html").is_file(), page  # every chapter is on the site
    api = {p.stem: p.read_text() for p in (out / "api").glob("*.html")}
    import stallguard
    import stallguard.adapters
    import stallguard.instrumentation
    import stallguard.testing

    for module, page in [
        (stallguard, "stallguard"),
        (stallguard.adapters, "adapters"),
        (stallguard.testing, "testing"),
        (stallguard.instrumentation, "instrumentation"),
    ]:
        for name in module.__all__:
            assert f'id="{module.__name__}.{name}"' in api[page], (page, name)
    assert 'id="stallguard.transitions.attach"' in api["transitions"]
    # stallguard-vllm's pages: its connector module imports vLLM, which this
    # interpreter lacks; the build imports it against stand-ins (docs/conf.py), so here
    # (and forgets the modules it imported so, for the tests that run after this one)
    from sphinx.ext.autodoc.mock import mock

    before = set(sys.modules)
    with mock(["vllm", "torch"]):
        import stallguard_vllm
        import stallguard_vllm.advise
        import stallguard_vllm.connector
    try:
        for module, page in [
            (stallguard_vllm, "stallguard_vllm"),
            (stallguard_vllm.advise, "stallguard_vllm_advise"),
            (stallguard_vllm.connector, "stallguard_vllm_connector"),
        ]:
            assert module.__all__
            for name in module.__all__:
                assert f'id="{module.__name__}.{name}"' in api[page], (page, name)
    finally:
        for name in set(sys.modules) - before:
            if name.startswith("stallguard_vllm."):
                del sys.modules[name]
                vars(stallguard_vllm).pop(name.rsplit(".", 1)[1], None)


def test_every_page_is_collected_by_sybil():
    conftest = load_root_conftest()
    for page in PAGES:
        assert conftest.is_doc_page(page), page
    # a page added later (e.g. by another branch) is covered without registering it
    assert conftest.is_doc_page(ROOT / "docs" / "vllm.md")
    assert not conftest.is_doc_page(ROOT / "docs" / "api" / "stallguard.md")
    assert not conftest.is_doc_page(ROOT / "benchmarks" / "README.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_blocks_are_fenced_as_python(page):
    """Sybil runs ```python blocks; a block fenced as py, python3 or pycon would escape
    it silently, so such fences are not allowed."""
    fences = re.findall(r"^[ \t]*```[ \t]*([\w{}-]*)", page.read_text(), re.M)
    assert not {f.lower() for f in fences} & {"py", "python3", "pycon", "ipython", "py3"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_skipped_blocks_say_why(page):
    """A fragment is marked with a reason, which the test report shows."""
    for line in re.findall(r"<!--\s*skip:.*-->", page.read_text()):
        assert re.match(r'<!--\s*skip: next "fragment: .+" -->', line), line
