"""tools/dev.py (tools/devlib): the locks are current and exact, every venv's install
plan is the one pinned in tests/dev_plan.txt, and setup shows its progress.

Nothing here installs or resolves anything (that is `python3 tools/dev.py lock`, which
needs the package indexes, and `env`/`docs`): these tests read the committed locks, run
the builder dry (`plan`) and dev.py's output handling on a stand-in command.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from _tools import load_tool

ROOT = Path(__file__).resolve().parents[1]


dev = load_tool("dev")


@pytest.mark.parametrize("venv", dev.VENVS, ids=lambda v: v.name)
def test_lock_matches_its_inputs(venv):
    """Editing a package list, a constraints file or a pyproject's dependencies without
    re-running `python3 tools/dev.py lock` fails here (and `env` refuses to install)."""
    pins = dev.check_lock(venv)
    assert pins


@pytest.mark.parametrize("venv", dev.VENVS, ids=lambda v: v.name)
def test_every_locked_distribution_has_an_exact_version_and_a_hash(venv):
    text = venv.lock.read_text()
    entries = re.findall(r"^(\S+)==(\S+)((?: \\\n    --hash=sha256:[0-9a-f]{64})+)$", text, re.M)
    pins = [line for line in text.splitlines() if "==" in line and not line.startswith("#")]
    assert len(entries) == len(pins) > 0  # every pin has its sha256s below it
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
    monkeypatch.setattr(dev.common, "HEARTBEAT_S", 0.2)
    dev.run([sys.executable, "-c", "import time; time.sleep(1.6)"])
    out = capsys.readouterr().out
    assert re.search(r"\[dev\]   \.\.\. still running \(\d+s\): python\S* -c import time", out)


@pytest.mark.parametrize("opt_out", [False, True])
def test_the_demo_runs_the_real_servers_last_unless_opted_out(monkeypatch, opt_out):
    """`demo` runs the harness demo (its arguments passed on, minus --no-real-servers),
    the vLLM section, then the real-server fault matrix and advice run; the worst exit
    status wins. Stand-in commands: nothing is run."""
    calls = []
    monkeypatch.setattr(dev.runners, "env_command", lambda: 0)
    monkeypatch.setattr(
        dev.runners.subprocess,
        "call",
        lambda cmd, cwd: calls.append(cmd[2:]) or 3 * (len(calls) == 3),
    )
    args = ["--quick", "--no-real-servers"] if opt_out else ["--quick"]
    rc = dev.demo_command(args)
    expected = [["examples.pd_wedge", "--quick"], ["examples.vllm_wedge"]]
    if not opt_out:
        expected += [["examples.real_servers", "faults"], ["examples.real_servers", "advice"]]
    assert calls == expected
    assert rc == (0 if opt_out else 3)


# --------------------------------------------------------------------------- devlib

PLAN = ROOT / "tests" / "dev_plan.txt"


def plan_lines(specs) -> list[str]:
    """The dry build of *specs*, keys and file hashes dropped (they hash this checkout's
    paths and interpreter), the step names and commands kept."""
    lines = dev.plan(specs)
    return [re.sub(r" (key|sha)=[0-9a-f]{16}", "", line) for line in lines]


def test_every_venvs_install_plan_is_the_pinned_one():
    """What `env` and `docs` would run, command by command (`python3 tools/dev.py plan`,
    nothing run). tests/dev_plan.txt was first written from the dev.py before the
    split into tools/devlib, whose recorded steps, keys and commands were the same; a
    change to a venv's steps shows here as a diff. Regenerate it with
    `python3 tools/dev.py plan | sed -E 's/ (key|sha)=[0-9a-f]{16}//' > tests/dev_plan.txt`."""
    assert plan_lines(dev.ALL) == PLAN.read_text().splitlines()


def test_the_plan_runs_nothing_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(dev.common.subprocess, "Popen", None)  # any real run fails
    monkeypatch.setattr(dev.checks.subprocess, "run", None)
    before = sorted(p.name for p in ROOT.iterdir())
    lines = plan_lines(dev.ALL)
    assert sum(line.startswith("  run ") for line in lines) > 10
    assert sorted(p.name for p in ROOT.iterdir()) == before
    assert dev.common.RECORD is None  # back to running commands


def test_each_venv_is_built_by_the_one_builder_with_its_own_steps():
    """The plan's steps per venv: the locked ones install their lock in one step, the
    overlays write .venv's site-packages into a .pth and use .venv's pip, .venv-vllm
    installs its pinned groups one step each, .venv-docs uses its own pip."""
    lines = plan_lines(dev.ALL)
    steps = [line.split(" ", 1)[1] for line in lines if line.startswith("step ")]
    assert steps[:3] == ["packages", "libibverbs1 (system package: only when missing)",
                         "prometheus (system package: only when missing)"]  # fmt: skip
    for name in ("sglang0517", "realsrv", *(g.name for g in dev.VLLM_VENV.groups)):
        assert name in steps
    runs = [line for line in lines if line.startswith("  run ")]
    docs = [r for r in runs if ".venv-docs" in r]
    assert docs and all(
        r.startswith("  run <ROOT>/.venv-docs/bin/python -m pip install") for r in docs
    )
    assert any("-r <ROOT>/tools/lock/venv-docs.txt" in r for r in docs)
    overlay = [r for r in runs if "--python <ROOT>/.venv-sglang0517/bin/python" in r]
    assert overlay and overlay[0].startswith("  run <ROOT>/.venv/bin/python -m pip")
    vllm = [r for r in runs if "--python <ROOT>/.venv-vllm/bin/python" in r]
    assert len(vllm) == len(dev.VLLM_VENV.groups) + 2  # the groups, then two editables
    assert all("-c <ROOT>/tools/constraints-vllm.txt --no-deps" in r for r in vllm)


def test_the_docs_venv_holds_sphinx_and_no_engine():
    _inputs, pins = dev.read_lock(dev.DOCS)
    for name in ("sphinx", "myst-parser", "furo", "attrs", "anyio", "opentelemetry-api"):
        assert name in pins, name
    for name in ("torch", "sglang", "vllm", "nixl", "pytest", "hypothesis", "numpy"):
        assert name not in pins, name
    reqs = {dev.requirement_name(r) for r in dev.project_requirements(dev.DOCS)}
    assert {"sphinx", "myst-parser", "furo", "transitions"} <= reqs
    assert "pytest" not in reqs  # only the `docs` dependency group


def test_radon_and_the_locker_are_locked_in_the_dev_venv():
    _inputs, pins = dev.read_lock(dev.MAIN)
    assert pins["radon"] == "6.0.1"
    assert pins["uv"] == dev.locking.UV_VERSION


PIP_CONFIG = """\
:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/wheels'
"""


def test_uv_gets_the_machines_pip_sources():
    """uv reads no pip.conf: the find-links directory (the local torch CPU wheel), the
    extra indexes and the global constraints are handed over, each once."""
    assert dev.pip_sources(PIP_CONFIG) == [
        "--extra-index-url", "file:///opt/pypi/simple",
        "--extra-index-url", "file:///opt/pypi-more/simple",
        "--find-links", "/opt/wheels",
        "--constraint", "/etc/xdg/pip/constraints.txt",
    ]  # fmt: skip
    assert dev.pip_sources("") == []


from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# a value has no whitespace (pip splits a list option's value on it, as str.split does)
_value = st.text(
    st.characters(blacklist_categories=("Zs", "Zl", "Zp", "Cc", "Cs"), blacklist_characters="'"),
    min_size=1,
).filter(lambda v: v.split() == [v])


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["global", ":env:", "install", "site"]),
            st.sampled_from(
                ["find-links", "index-url", "extra-index-url", "constraint", "timeout"]
            ),
            st.lists(_value, min_size=1, max_size=3),
        ),
        max_size=6,
    ),
    st.text(max_size=40),
)
def test_pip_sources_keeps_every_source_once_and_nothing_else(entries, junk):
    """Any `pip config list` output, with a junk line: every source value comes out
    once after its flag, unknown keys and junk are ignored."""
    text = "\n".join(f"{scope}.{key}='{' '.join(vals)}'" for scope, key, vals in entries)
    args = dev.pip_sources(text + "\n" + junk.replace("'", ""))
    pairs = list(zip(args[::2], args[1::2], strict=True))
    flags = {"find-links": "--find-links", "index-url": "--index-url",
             "extra-index-url": "--extra-index-url", "constraint": "--constraint"}  # fmt: skip
    expected = {(flags[k], v) for _s, k, vals in entries if k in flags for v in vals}
    assert set(pairs) >= expected
    assert len(pairs) == len(set(pairs))
    assert all(flag in flags.values() for flag, _v in pairs)


def test_a_lock_written_from_uvs_output_reads_back(tmp_path, monkeypatch):
    """uv's output (several hashes per version) -> the lock's text -> the pins `env`
    checks; two passes disagreeing on a version is an error naming the package."""
    uv_out = (
        "attrs==26.1.0 \\\n    --hash=sha256:" + "a" * 64 + " \\\n    --hash=sha256:" + "b" * 64
        + "\nTorch==2.13.0+cpu \\\n    --hash=sha256:" + "c" * 64 + "\n"
    )  # fmt: skip
    found = dev.locking.parse_compiled(uv_out)
    assert found == {
        "attrs": ("attrs", "26.1.0", ("a" * 64, "b" * 64)),
        "torch": ("Torch", "2.13.0+cpu", ("c" * 64,)),
    }
    spec = dev.VenvSpec("lockcheck", tmp_path, dev.MAIN.constraints, ())
    object.__setattr__(spec, "lock", ROOT / "tools" / "lock" / "venv.txt")  # a path in ROOT
    text = dev.locking.lock_text(spec, found)
    lock = tmp_path / "lock.txt"
    lock.write_text(text)
    object.__setattr__(spec, "lock", lock)
    inputs, pins = dev.read_lock(spec)
    assert pins == {"attrs": "26.1.0", "torch": "2.13.0+cpu"}
    assert inputs == dev.lock_inputs(spec)
    with pytest.raises(dev.StepError, match="uv reported no sha256 for x==1"):
        dev.locking.parse_compiled("x==1\n")


@pytest.mark.parametrize(
    ("argv", "rc", "said"),
    [
        (["env", "x"], 2, "env takes no arguments"),
        (["docs", "--now"], 2, "docs takes no arguments"),
        (["lint", "x"], 2, "lint takes no arguments"),
        (["nope"], 2, "unknown command 'nope'"),
        (["plan", ".venv-nope"], 1, "no venv named ['.venv-nope']"),
        (["lock", "nope"], 1, "no venv named ['nope']"),
    ],
)
def test_bad_command_lines_are_refused_by_name(argv, rc, said, capsys):
    assert dev.main(argv) == rc
    out = capsys.readouterr()
    assert said in out.out + out.err


def test_plan_of_one_venv_prints_only_its_steps(capsys):
    assert dev.main(["plan", "venv-realsrv"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "venv .venv-realsrv (<ROOT>/.venv-realsrv)"
    assert out[1].startswith("step realsrv key=")
    assert all(".venv-realsrv" in line or not line.startswith("  run") for line in out)


def test_steps_skip_what_is_stamped_and_defer_what_may_fail(tmp_path, capsys):
    """A step whose key is stamped is skipped; a new key runs it again; a deferred
    failure is listed and not stamped (the next run retries), a plain one stops."""
    stamps = dev.Stamps(tmp_path)
    steps = dev.build.Steps()
    calls = []

    def ok(name):
        return lambda: calls.append(name) or f"{name} done"

    def broken():
        raise dev.StepError("no wheel")

    steps("a", "k1", ok("a"), stamps)
    steps("a", "k1", ok("a"), stamps)  # stamped: skipped
    steps("a", "k2", ok("a2"), stamps)  # its inputs changed
    steps("b", "k1", broken, stamps, defer_failure=True)
    with pytest.raises(dev.StepError, match="no wheel"):
        steps("c", "k1", broken, stamps)
    assert calls == ["a", "a2"]
    assert (steps.ran, steps.skipped) == (2, 1)
    assert steps.deferred == ["b: no wheel"]
    assert dev.Stamps(tmp_path).data == {"a": "k2"}  # on disk; b and c not stamped
    assert "[dev] b: FAILED after" in capsys.readouterr().out


def test_docs_builds_only_the_docs_venv_and_runs_sphinx_there(monkeypatch):
    """`docs` no longer builds torch, SGLang and vLLM to run Sphinx. Stand-ins: nothing
    is built or run."""
    built, ran = [], []
    monkeypatch.setattr(dev.build, "build_all", lambda specs: built.append(specs) or 0)
    monkeypatch.setattr(dev.runners.subprocess, "call", lambda cmd, cwd: ran.append(cmd) or 0)
    assert dev.main(["docs"]) == 0
    assert built == [(dev.DOCS,)]
    (cmd,) = ran
    assert cmd[:3] == [str(ROOT / ".venv-docs" / "bin" / "python"), "-m", "sphinx"]
    assert "-W" in cmd and "-n" in cmd


# --------------------------------------------------------------- test workers (xdist)
def test_the_suite_runs_on_two_workers_by_default_each_file_on_one_worker():
    assert dev.runners.worker_args([], {}) == ["-n", "2", "--dist", "loadfile"]
    assert dev.runners.worker_args([], {"STALLGUARD_TEST_WORKERS": "0"}) == []
    assert dev.runners.worker_args([], {"STALLGUARD_TEST_WORKERS": "3"})[:2] == ["-n", "3"]
    # arguments that choose workers themselves win
    for args in (["-n", "4"], ["-n4"], ["--numprocesses=1"], ["-p", "no:xdist"]):
        assert dev.runners.worker_args(args, {}) == [], args


@given(st.text(max_size=12))
def test_a_bad_worker_count_is_named_with_its_value(raw):
    try:
        got = dev.runners.worker_args([], {"STALLGUARD_TEST_WORKERS": raw})
    except dev.StepError as exc:
        assert str(exc).startswith(f"STALLGUARD_TEST_WORKERS={raw!r}: must be a whole number")
    else:
        n = int(raw)
        assert 0 <= n <= 64 and got == ([] if n == 0 else ["-n", str(n), "--dist", "loadfile"])


def test_the_alone_tests_run_after_the_others_by_themselves():
    two = dev.runners.test_phases(["-x"], {})
    assert two == [
        ["--durations=30", "-n", "2", "--dist", "loadfile", "-m", "not alone", "-x"],
        ["--durations=10", "-m", "alone", "-x"],
    ]
    # a marker expression of the caller's: one run with it (pytest keeps the last -m)
    assert dev.runners.test_phases(["-m", "sglang"], {})[0][-2:] == ["-m", "sglang"]
    assert len(dev.runners.test_phases(["-m", "sglang"], {})) == 1
    # no workers: one run of everything, as before
    assert dev.runners.test_phases([], {"STALLGUARD_TEST_WORKERS": "0"}) == [["--durations=30"]]


def test_the_whole_suite_runs_the_core_tests_again_against_the_compiled_core():
    """`test` with no arguments ends with the core tests against a compiled build
    (devlib.compiled); a selection of the caller's does not, unless asked."""
    compiled = dev.compiled
    assert compiled.wanted([], {}) and not compiled.wanted(["tests/test_spec.py"], {})
    assert compiled.wanted(["-x"], {"STALLGUARD_TEST_COMPILED_PHASE": "1"})
    assert not compiled.wanted([], {"STALLGUARD_TEST_COMPILED_PHASE": "0"})
    args, env = compiled.phase(["-n", "2", "--dist", "loadfile"])
    assert env["STALLGUARD_TEST_COMPILED"] == str(compiled.BUILD)
    assert env["PYTHONSAFEPATH"] == "1" and "STALLGUARD_PURE" not in env
    assert args[args.index("-m") + 1] == compiled.MARKERS
    assert "tests/test_compiled.py" in args  # the control: fails if the sources ran
    assert all((dev.ROOT / t).is_file() for t in compiled.CORE_TESTS)
    # every file of the package keys the build (a stale build is never tested)
    assert dev.ROOT / "stallguard" / "_core.py" in compiled.inputs()
    assert dev.ROOT / "hatch_build.py" in compiled.inputs()
