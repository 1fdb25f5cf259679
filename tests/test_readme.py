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


def test_readme_example_runs_verbatim(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # the installed stallguard (.venv has it editable); in a worktree run, the checkout
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", _user_example()],
        cwd=tmp_path,
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
