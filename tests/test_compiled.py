"""The optional compiled core (mypyc: stallguard/_fifo.py and stallguard/_core.py; see
hatch_build.py and docs/performance.md, "The compiled core").

`tools/dev.py test` runs the core tests twice: on the sources, and on a compiled build
(``STALLGUARD_TEST_COMPILED=<build directory>``: the root conftest.py puts the build's
copy of the package first on the path). These tests say which build runs, and fail
when it is not the one the run expects (the control: a run meant for the compiled
build that silently imported the sources would otherwise pass on the sources); and
they check what the compiled build could get wrong: the library's own errors for the
arguments it validates, the weak references to watchdogs (mypyc#1102), the methods
bound from other modules.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import weakref
from importlib.machinery import EXTENSION_SUFFIXES

import pytest

import stallguard
from stallguard import ClockError, ConfigError, Deadline, Spec, UnknownStateError, Watchdog, _accel
from stallguard._core import WatchdogCore

#: the compiled build's directory, in the run against it (see the root conftest.py)
BUILD = os.environ.get("STALLGUARD_TEST_COMPILED", "")

SPEC = Spec(
    "compiled",
    {"queued": Deadline(5.0, stall=2.0), "running": 10.0},
    terminal=["done"],
    lifetime=60.0,
)


def _is_extension(module: object) -> bool:
    path = getattr(module, "__file__", None) or ""
    return any(path.endswith(suffix) for suffix in EXTENSION_SUFFIXES)


def _modules() -> list[object]:
    return [sys.modules[f"stallguard.{name}"] for name in _accel.MODULES]


def test_the_build_that_runs_is_the_one_the_run_expects():
    compiled = all(_is_extension(m) for m in _modules())
    assert stallguard.__compiled__ is compiled, (_accel.WHY, [m.__file__ for m in _modules()])
    if BUILD:
        assert stallguard.__compiled__, _accel.WHY
        assert _accel.WHY == "compiled with mypyc"
        package = os.path.join(os.path.abspath(BUILD), "stallguard")
        assert all(m.__file__.startswith(package + os.sep) for m in _modules())  # type: ignore[attr-defined]
    else:  # the sources' run: a checkout holds no compiled module
        assert not stallguard.__compiled__, _accel.WHY


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """*code* in a fresh interpreter that imports stallguard as this process does."""
    environ = {**os.environ}
    environ["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(stallguard.__file__)), environ.get("PYTHONPATH", "")]
    )
    environ.update(env)  # (a PYTHONPATH given replaces it)
    return subprocess.run(  # (not from the checkout: its sources would come first)
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=environ,
        cwd=tempfile.gettempdir(),
        timeout=240,
    )


def test_stallguard_pure_runs_the_sources_beside_any_build():
    done = _run(
        """
        import stallguard, stallguard._core as c, stallguard._fifo as f
        print(stallguard.__compiled__, c.__file__.endswith(".py"), f.__file__.endswith(".py"))
        print(stallguard._accel.WHY)
        """,
        STALLGUARD_PURE="1",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["False True True", "STALLGUARD_PURE is set"]


@pytest.mark.parametrize(
    ("fakes", "why"),
    [
        (("_core", "_fifo", "core__mypyc"), "the compiled core does not load"),
        (("_core",), "the compiled core is incomplete (no _fifo, core__mypyc)"),
    ],
)
def test_a_compiled_core_that_cannot_run_falls_back_to_the_sources(tmp_path, fakes, why):
    """A copy of the package with extension modules this interpreter refuses (garbage
    in their files) or an incomplete set of them: the sources run, loaded by path,
    ``__compiled__`` is False and ``_accel.WHY`` says why; the watchdog works."""
    package = tmp_path / "stallguard"
    shutil.copytree(
        os.path.dirname(stallguard.__file__),
        package,
        ignore=shutil.ignore_patterns("__pycache__", *(f"*{s}" for s in EXTENSION_SUFFIXES)),
    )
    for name in fakes:
        (package / f"{name}{EXTENSION_SUFFIXES[0]}").write_bytes(b"not a shared object")
    done = _run(
        """
        import stallguard, stallguard._core as c, stallguard._fifo as f
        from stallguard.testing import FakeClock
        print(stallguard.__compiled__, c.__file__.endswith(".py"), f.__file__.endswith(".py"))
        print(stallguard._accel.WHY)
        clock = FakeClock()
        spec = stallguard.Spec("f", {"a": 1.0}, terminal=["z"])
        wd = stallguard.Watchdog(spec, clock=clock, on_expire=[])
        wd.observe(1, "a")
        clock.advance(2)
        print([e.key for e in wd.check()])
        """,
        PYTHONPATH=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "False True True"
    assert lines[1].startswith(why), lines[1]
    assert lines[-1] == "[1]"


def test_thousands_of_watchdogs_are_freed_and_forgotten():
    """The registry, the metrics and stallguard.transitions hold watchdogs by weak
    reference. A compiled class's deallocator does not clear its weak references
    (mypyc#1102: the WeakSet keeps a dead entry, and the process may crash at exit);
    Watchdog is an interpreted subclass, whose deallocator does. In a fresh process,
    with metrics on (a listener per watchdog, held weakly): 3,000 watchdogs made, used
    and dropped leave nothing behind, every weak callback runs, the exit is clean."""
    done = _run(
        """
        import gc, weakref
        import stallguard
        from stallguard import Spec, Watchdog, _registry
        from stallguard.instrumentation import enable_metrics, set_on_expire_hooks
        from stallguard.testing import FakeClock

        set_on_expire_hooks([])
        enable_metrics()
        spec = Spec("w", {"a": 1.0, "b": stallguard.Deadline(2.0, stall=1.0)}, terminal=["z"])
        called = []
        refs = []
        for round_ in range(3):
            for i in range(1000):
                clock = FakeClock()
                wd = Watchdog(spec, clock=clock)
                for key in range(5):
                    wd.observe(key, "a")
                    wd.observe(key, "b")
                clock.advance(3.0)
                wd.check()
                refs.append(weakref.ref(wd, called.append))
                del wd
            gc.collect()
        assert all(r() is None for r in refs)
        assert len(called) == 3000, len(called)
        assert len(_registry._watchdogs) == 0, len(_registry._watchdogs)
        assert _registry.live_watchdogs() == []
        print("ok", stallguard.__compiled__)
        """
    )
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    assert done.stdout.split()[0] == "ok"


def test_the_library_names_its_own_errors():
    """Arguments the library validates itself are refused with its own errors in both
    builds (compiled, mypyc would check a ``float`` or ``bool`` annotation itself: an
    ``at=True`` taken as 1.0, a string refused with mypyc's generic TypeError)."""
    wd: Watchdog[int] = Watchdog(SPEC, clock=lambda: 100.0)
    wd.observe(1, "queued")
    with pytest.raises(TypeError, match=r"at must be a time in seconds.*True \(bool\)"):
        wd.observe(2, "queued", at=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"at must be a time in seconds.*'x' \(str\)"):
        wd.observe(1, "running", at="x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"at must be a time"):
        wd.heartbeat(1, at=b"1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"now must be a time in seconds.*'soon'"):
        wd.check(now="soon")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"at=200.0 is later than"):
        wd.observe(3, "queued", at=200)
    with pytest.raises(UnknownStateError):
        wd.observe(4, 5)  # type: ignore[arg-type]
    assert wd.forget(1, remember=0) is True  # (truthiness, as any Python function)
    assert wd.observe(1, "queued") is None and 1 in wd
    with pytest.raises(ConfigError, match="memory"):
        Watchdog(SPEC, memory="many")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown_state"):
        Watchdog(SPEC, unknown_state=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="spec must be"):
        Watchdog("spec")  # type: ignore[arg-type]
    for reading in ("noon", 5, True, float("nan")):
        bad: Watchdog[int] = Watchdog(SPEC, clock=lambda r=reading: r)  # type: ignore[misc]
        if isinstance(reading, int) and not isinstance(reading, bool):
            bad.observe(1, "queued")  # an int is a time (as in the sources)
            continue
        with pytest.raises(ClockError):
            bad.observe(1, "queued")


def test_the_public_class_binds_every_public_method_itself():
    """Watchdog is WatchdogCore plus the methods that live in other modules; the core's
    public members are bound in Watchdog's own body too (so the API reference, which
    lists a class's own members, has them), and calling them works in both builds (a
    compiled class cannot have another module's function as a method)."""
    public = {n for n in vars(WatchdogCore) if not n.startswith("_")}
    assert public, vars(WatchdogCore)
    assert public <= set(vars(Watchdog)), public - set(vars(Watchdog))
    wd: Watchdog[int] = Watchdog(SPEC, clock=lambda: 1.0)
    wd.observe(1, "queued")
    assert wd.snapshot().tracked == 1
    assert wd.add_listener(on_expire=lambda e: None).remove()
    assert wd.annotate(1, attributes={"a": 1})
    assert wd.listeners == () and wd.spec is SPEC and wd.mode == "enforce"
    assert wd._remembered() is not None


def test_only_watchdogs_are_weakly_referenced():
    """The interpreted Watchdog supports weak references, and its deallocator clears
    them. Compiled, the core has no ``__weakref__`` slot of its own (with one, as it had
    while it derived from ``typing.Generic``, the weak references to every watchdog
    dangled: mypyc#1102), so a bare core cannot be registered at all: a TypeError, not
    a dangling reference."""
    weakref.ref(Watchdog(SPEC))
    if stallguard.__compiled__:
        assert (WatchdogCore.__weakrefoffset__, WatchdogCore.__dictoffset__) == (0, 0)
        with pytest.raises(TypeError, match="weak reference"):
            WatchdogCore(SPEC)
