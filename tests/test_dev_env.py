"""tools/dev.py: the locks are current and exact, and setup shows its progress.

Nothing here installs or resolves anything (that is `python3 tools/dev.py lock`, which
needs the package indexes): these tests read the committed locks and run dev.py's
output handling on a stand-in command.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_dev():
    spec = importlib.util.spec_from_file_location("_stallguard_dev_tool", ROOT / "tools" / "dev.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


dev = load_dev()


@pytest.mark.parametrize("venv", dev.VENVS, ids=lambda v: v.name)
def test_lock_matches_its_inputs(venv):
    """Editing a package list, a constraints file or a pyproject's dependencies without
    re-running `python3 tools/dev.py lock` fails here (and `env` refuses to install)."""
    pins = dev.check_lock(venv)
    assert pins


@pytest.mark.parametrize("venv", dev.VENVS, ids=lambda v: v.name)
def test_every_locked_distribution_has_an_exact_version_and_a_hash(venv):
    text = venv.lock.read_text()
    entries = re.findall(r"^(\S+)==(\S+) \\\n    --hash=sha256:([0-9a-f]{64})$", text, re.M)
    pins = [line for line in text.splitlines() if "==" in line and not line.startswith("#")]
    assert len(entries) == len(pins) > 0  # every pin has exactly one sha256 below it
    names = [dev.canonical(n) for n, _v, _h in entries]
    assert len(names) == len(set(names))
    assert not set(names) & {dev.canonical(n) for n in dev.FORBIDDEN}


def test_main_lock_holds_what_the_lists_ask_for():
    _inputs, pins = dev.read_lock(dev.MAIN)
    assert pins["torch"] == "2.13.0+cpu"  # the local CPU wheel, never a CUDA build
    assert pins["sglang"] == "0.5.23"
    for group in dev.MAIN.groups:
        for req in group.packages:
            name = dev.requirement_name(req)
            assert name in pins, name
            if "==" in req:
                assert pins[name].split("+")[0] == req.split("==")[1], req
    for req in dev.project_requirements(dev.MAIN):  # runtime deps, extras, dependency groups
        if "python_version < '3.11'" not in req:
            assert dev.requirement_name(req) in pins, req
    assert "stallguard" not in pins and "stallguard-sglang" not in pins  # editable


def test_lock_inputs_do_not_depend_on_the_checkout_path(tmp_path, monkeypatch):
    """Two clones in different directories compute the same inputs hash."""
    before = dev.lock_inputs(dev.MAIN)
    monkeypatch.chdir(tmp_path)
    assert dev.lock_inputs(dev.MAIN) == before
    assert str(ROOT) not in dev.MAIN.lock.read_text()


def test_a_changed_list_makes_the_lock_stale(monkeypatch):
    changed = dev.VenvSpec(
        dev.MAIN.name,
        dev.MAIN.path,
        dev.MAIN.constraints,
        (*dev.MAIN.groups, dev.Group("extra", ("six",))),
        dev.MAIN.editable,
        dev.MAIN.extras,
    )
    with pytest.raises(dev.StepError, match=r"tools/lock/venv.txt is out of date.*dev.py lock"):
        dev.check_lock(changed)


def test_pip_output_becomes_numbered_progress(capsys):
    """pip's per-package lines are numbered against the lock; noise is dropped."""
    script = (
        "print('Collecting attrs==26.1.0 (from -r lock.txt (line 3))')\n"
        "print('  Using cached attrs-26.1.0-py3-none-any.whl (67 kB)')\n"
        "print('Requirement already satisfied: anyio==4.16.0 in ./x (from -r lock.txt)')\n"
        "print('Processing /opt/pypi/files/babel-2.19.0-py3-none-any.whl (from -r lock.txt)')\n"
        "print('Installing collected packages: attrs, babel')\n"
        "print('Successfully installed attrs-26.1.0 babel-2.19.0')\n"
    )
    dev.run([sys.executable, "-c", script], progress_total=3)
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "[dev]   [1/3] attrs==26.1.0",
        "[dev]   [2/3] present anyio==4.16.0",
        "[dev]   [3/3] babel-2.19.0-py3-none-any.whl",
        "[dev]   unpacking 2 distributions into the venv (big wheels take long)",
        "Successfully installed attrs-26.1.0 babel-2.19.0",
    ]


def test_a_silent_command_gets_a_heartbeat(capsys, monkeypatch):
    monkeypatch.setattr(dev, "HEARTBEAT_S", 0.2)
    dev.run([sys.executable, "-c", "import time; time.sleep(1.6)"])
    out = capsys.readouterr().out
    assert re.search(r"\[dev\]   \.\.\. still running \(\d+s\): python\S* -c import time", out)


@pytest.mark.parametrize("opt_out", [False, True])
def test_the_demo_runs_the_real_servers_last_unless_opted_out(monkeypatch, opt_out):
    """`demo` runs the harness demo (its arguments passed on, minus --no-real-servers),
    the vLLM section, then the real-server fault matrix and advice run; the worst exit
    status wins. Stand-in commands: nothing is run."""
    calls = []
    monkeypatch.setattr(dev, "env_command", lambda: 0)
    monkeypatch.setattr(
        dev.subprocess, "call", lambda cmd, cwd: calls.append(cmd[2:]) or 3 * (len(calls) == 3)
    )
    args = ["--quick", "--no-real-servers"] if opt_out else ["--quick"]
    rc = dev.demo_command(args)
    expected = [["examples.pd_wedge", "--quick"], ["examples.vllm_wedge"]]
    if not opt_out:
        expected += [["examples.real_servers", "faults"], ["examples.real_servers", "advice"]]
    assert calls == expected
    assert rc == (0 if opt_out else 3)
