"""The README's user example runs as written: extracted verbatim (the first ``python``
block after "For users"), run in a fresh interpreter from an empty directory, so it can
only use what an installed stallguard provides (no test set-up, no repository on the
path beyond the installed package)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _user_example() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    users = text.index("## For users")
    assert text.index("```python", users) < text.index("## For developers")
    [block] = re.findall(
        r"```python\n(.*?)```", text[users : text.index("## For developers")], re.S
    )
    return block


def test_readme_starts_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert lines[:3] == ["# stallguard", "", "```sh"]
    assert lines[3].startswith("python3 tools/dev.py demo")
    assert lines[4].startswith("python3 tools/dev.py test")
    assert lines[5] == "```"


def _run_example(python: str | Path, cwd: Path, env: dict[str, str]) -> None:
    """The README's block under *python*, from *cwd*: it prints what the README says."""
    proc = subprocess.run(
        [str(python), "-c", _user_example()],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    # what the README says it prints: the expiry, then the failed request
    assert re.fullmatch(
        r"stallguard: in Transferring for 0\.\d+s, past its 0\.5s deadline \(spec 'kv_sender'\)",
        lines[0],
    ), proc.stdout
    assert lines[1] == "failed: ['req-1']"
    assert "stallguard forced failure: spec=kv_sender key='req-1'" in proc.stderr


def test_readme_example_runs_verbatim(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # the installed stallguard (.venv has it editable); in a worktree run, the checkout
    env["PYTHONPATH"] = str(ROOT)
    _run_example(sys.executable, tmp_path, env)


def _locked_versions() -> str:
    """name==version of every distribution in .venv's lock (hashes dropped: pip takes
    none in a constraints file), so the wheels-only venv gets the tested versions."""
    lock = (ROOT / "tools" / "lock" / "venv.txt").read_text(encoding="utf-8")
    return "\n".join(re.findall(r"^([A-Za-z0-9_.\-]+==[^\s\\]+)", lock, re.M)) + "\n"


@pytest.mark.slow
def test_readme_example_runs_in_a_wheels_only_venv(tmp_path: Path) -> None:
    """What a user gets from `pip install stallguard`: the core's wheel, built as a release
    builds it, installed with its runtime dependencies (wheels only, the locked versions)
    into a new venv that has nothing of this repository; the README's example, verbatim,
    from an empty directory."""
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(wheels)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = wheels.glob("stallguard-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(_locked_versions())
    install = subprocess.run(
        [
            sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
            "--only-binary", ":all:", "-c", str(constraints), str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = tmp_path / "empty"
    where.mkdir()
    found = subprocess.run(
        [str(python), "-c", "import stallguard, sys; print(stallguard.__file__, sys.path)"],
        cwd=where, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert found.returncode == 0, found.stderr
    # the installed wheel, not the checkout (and no .pth of the dev venvs)
    assert found.stdout.startswith(str(venv)), found.stdout
    assert str(ROOT) not in found.stdout, found.stdout
    _run_example(python, where, env)
