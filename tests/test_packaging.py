"""What a user installs: license, metadata, extras, dependency bounds, README links.

The build test (slow) builds both distributions exactly as a release would
(`python -m build`, sdist then wheel from it) and checks them with `twine check
--strict`; the others read pyproject.toml and run the core without `transitions`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
# Every distribution the repository publishes: the core and each adapter (a future
# adapters/vllm is picked up without changing this file).
PROJECTS = [ROOT, *sorted(p.parent for p in ROOT.glob("adapters/*/pyproject.toml"))]
LICENSE = (ROOT / "LICENSE").read_bytes()


def pyproject(project: Path) -> dict:
    return tomllib.loads((project / "pyproject.toml").read_text())


def source_url() -> str:
    return pyproject(ROOT)["project"]["urls"]["Source"]


@pytest.mark.parametrize("project", PROJECTS, ids=lambda p: p.name)
def test_every_distribution_ships_the_apache_license(project):
    meta = pyproject(project)["project"]
    assert meta["license"] == "Apache-2.0"
    assert meta["license-files"] == ["LICENSE"]
    # a distribution cannot reach outside its own directory: adapters carry a copy
    assert (project / "LICENSE").read_bytes() == LICENSE
    assert LICENSE.lstrip().startswith(b"Apache License\n")
    assert b"Version 2.0, January 2004" in LICENSE
    assert b"END OF TERMS AND CONDITIONS" in LICENSE


@pytest.mark.parametrize("project", PROJECTS, ids=lambda p: p.name)
def test_readme_links_work_on_a_package_index(project):
    """A package index renders the README without the repository around it: every
    link must be absolute (into the project's declared Source URL, or elsewhere)."""
    readme = (project / pyproject(project)["project"]["readme"]).read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert links, "no links found: the pattern is wrong"
    relative = [link for link in links if not re.match(r"https?://", link)]
    assert relative == []
    repo = source_url()
    ours = [link for link in links if "github.com/stallguard/" in link]
    assert ours and all(link.startswith(repo) for link in ours)
    for link in ours:  # each link into the repository names a file that exists
        m = re.match(re.escape(repo) + r"/(?:blob|tree)/main/(.+?)(?:#.*)?$", link)
        if m:
            assert (ROOT / m.group(1)).exists(), link


def test_urls_are_consistent_across_distributions():
    repo = source_url()
    for project in PROJECTS:
        urls = pyproject(project)["project"]["urls"]
        assert urls["Homepage"] == repo
        assert all(u.startswith(repo) for u in urls.values()), urls


def test_transitions_is_an_extra_and_test_tools_are_a_dependency_group():
    data = pyproject(ROOT)
    deps = data["project"]["dependencies"]
    assert not any(d.startswith("transitions") for d in deps)
    assert data["project"]["optional-dependencies"] == {"transitions": ["transitions>=0.9"]}
    groups = data["dependency-groups"]
    assert {"pytest>=8", "hypothesis>=6.100"} <= set(groups["test"])
    assert "docs" in groups


def test_adapters_bound_stallguard_to_its_minor_release():
    for project in PROJECTS[1:]:
        deps = pyproject(project)["project"]["dependencies"]
        assert "stallguard>=0.1,<0.2" in deps, deps


def run_without_transitions(code: str) -> subprocess.CompletedProcess[str]:
    """Run *code* in a fresh interpreter where `import transitions` fails as if the
    package were not installed (None in sys.modules is what the import system treats
    as "not importable")."""
    prelude = "import sys; sys.modules['transitions'] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120
    )


def test_the_core_works_without_transitions():
    out = run_without_transitions(
        "import pkgutil, importlib, stallguard, stallguard.instrumentation\n"
        "from stallguard.testing import FakeClock\n"
        "mods = [m.name for m in pkgutil.walk_packages(stallguard.__path__, 'stallguard.')]\n"
        "for m in mods:\n"
        "    if m != 'stallguard.transitions':\n"
        "        importlib.import_module(m)\n"
        "clock = FakeClock()\n"
        "spec = stallguard.Spec(name='s', deadlines={'A': 5}, terminal=['Done'])\n"
        "wd = stallguard.Watchdog(spec, clock=clock)\n"
        "wd.observe(1, 'A'); clock.advance(6)\n"
        "import json\n"
        "print(json.dumps({'expired': [e.key for e in wd.check()], 'modules': len(mods),\n"
        "                  'transitions': sys.modules['transitions'] is not None}))\n"
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["expired"] == [1]
    assert result["modules"] >= 5  # the walk found the package's modules
    assert result["transitions"] is False  # nothing imported it behind our back


def test_stallguard_transitions_names_the_extra_when_it_is_missing():
    out = run_without_transitions("import stallguard.transitions")
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: stallguard.transitions needs the transitions library")
    assert "pip install 'stallguard[transitions]'" in last


@pytest.mark.slow
def test_build_both_distributions_with_license_and_twine_check(tmp_path):
    """`python -m build` (sdist, then the wheel built from it) for every distribution:
    LICENSE is inside both artifacts, and `twine check --strict` accepts them. Uses the
    locked hatchling of the dev environment (--no-isolation): offline and pinned."""
    for project in PROJECTS:
        out = tmp_path / project.name
        build = subprocess.run(
            [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(project)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
        (sdist,) = out.glob("*.tar.gz")
        (wheel,) = out.glob("*.whl")
        with tarfile.open(sdist) as tar:
            top = tar.getnames()[0].split("/")[0]
            assert tar.extractfile(f"{top}/LICENSE").read() == LICENSE
            # only this distribution's own files (not the adapters' or benchmarks')
            assert not [n for n in tar.getnames() if "/adapters/" in n or "/benchmarks/" in n]
        with zipfile.ZipFile(wheel) as whl:
            (licensed,) = [n for n in whl.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
            assert whl.read(licensed) == LICENSE
            (metadata,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
            text = whl.read(metadata).decode()
            assert "License-Expression: Apache-2.0" in text
            assert "License-File: LICENSE" in text
            assert "Project-URL: Source, " + source_url() in text
        twine = subprocess.run(
            [sys.executable, "-m", "twine", "check", "--strict", str(sdist), str(wheel)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert twine.returncode == 0, twine.stdout + twine.stderr
        assert twine.stdout.count("PASSED") == 2, twine.stdout
