"""Issue 23's done-when check: a third engine adapter (``stallguard_toy``, a stub engine
with two phases) written only inside this folder, against ``stallguard`` and
``stallguard.adapters`` only; and the rule that no adapter imports a private core
module, checked on the two real adapters' sources and on this one."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from stallguard import ConfigError
from stallguard.testing import FakeClock

from . import stallguard_toy
from .stallguard_toy import ToyGuard, load_config
from .toy_engine import ToyEngine

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

ADAPTER_SOURCES = [
    ROOT / "adapters" / "sglang" / "src",
    ROOT / "adapters" / "vllm" / "src",
    HERE / "stallguard_toy",
]


def core_imports(path: Path) -> list[str]:
    """Every ``stallguard...`` module *path* imports (absolute imports)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return [m for m in found if m == "stallguard" or m.startswith("stallguard.")]


def test_no_adapter_imports_a_private_core_module() -> None:
    files = [f for src in ADAPTER_SOURCES for f in sorted(src.rglob("*.py"))]
    assert len(files) > 20  # the walk found both adapters' modules
    used = {m for f in files for m in core_imports(f)}
    assert "stallguard.adapters" in used  # the check looks at real imports
    private = {
        f"{f.relative_to(ROOT)}: {m}"
        for f in files
        for m in core_imports(f)
        if any(part.startswith("_") for part in m.split(".")[1:])
    }
    assert not private, sorted(private)
    # and no attribute path into one either (stallguard._advice.read_prometheus(...))
    text = {f: f.read_text() for f in files}
    assert not [f for f, t in text.items() if "stallguard._" in t.replace("stallguard_", "")]


def test_the_toy_adapter_lives_in_its_folder_and_uses_only_the_public_core() -> None:
    mods = {m for f in (HERE / "stallguard_toy").rglob("*.py") for m in core_imports(f)}
    assert mods == {"stallguard", "stallguard.adapters"}


def test_the_lazy_face_is_typed_the_same_as_it_resolves() -> None:
    """For each adapter package: the TYPE_CHECKING imports (the static types) name
    exactly the lazily exported names, each from the module the lazy table says."""
    for init in [
        ROOT / "adapters" / "sglang" / "src" / "stallguard_sglang" / "__init__.py",
        ROOT / "adapters" / "vllm" / "src" / "stallguard_vllm" / "__init__.py",
        HERE / "stallguard_toy" / "__init__.py",
    ]:
        tree = ast.parse(init.read_text())
        typed = {}
        exports = {}
        for node in tree.body:
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
                for sub in node.body:
                    if isinstance(sub, ast.ImportFrom) and sub.level == 1:
                        for alias in sub.names:
                            assert alias.asname == alias.name, (init, alias.name)
                            typed[alias.name] = "." + (sub.module or "")
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_EXPORTS":
                for module, names in ast.literal_eval(node.value).items():
                    exports.update({name: module for name in names})
        assert exports and typed == exports, (init, set(typed) ^ set(exports))


def test_lazy_names_resolve_and_cache() -> None:
    assert "ToyGuard" in dir(stallguard_toy)
    assert stallguard_toy.Config.__name__ == "Config"
    assert "Config" in vars(stallguard_toy)  # cached: the next lookup is a plain read
    assert stallguard_toy.__version__ == "0+unknown"  # not installed as a distribution
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        stallguard_toy.Nope  # noqa: B018


def test_a_phase_that_hangs_is_failed_once_and_others_finish() -> None:
    engine = ToyEngine()
    clock = FakeClock()
    config = load_config({"STALLGUARD_TOY": "1", "STALLGUARD_TOY_DEADLINE_GENERATING": "50"})
    assert config is not None and config.deadlines["Generating"].seconds == 50.0
    guard = ToyGuard(engine, config, clock=clock)
    engine.submit("ok")
    engine.submit("stuck", hang_in="Generating")
    engine.advance()  # both Generating
    clock.advance(10)
    engine.advance()  # "ok" done
    clock.advance(39)
    assert guard.step() == []  # 49 s in Generating: not yet
    clock.advance(2)
    assert guard.step() == ["stuck"]
    assert engine.failed == {"stuck": "stallguard: Generating overstayed"}
    assert engine.phase == {"ok": "Done", "stuck": "Failed"}
    clock.advance(1000)
    assert guard.step() == []  # exactly once


def test_control_without_the_adapter_the_request_hangs_forever() -> None:
    engine = ToyEngine()
    engine.submit("stuck", hang_in="Generating")
    for _ in range(100):
        engine.advance()
    assert engine.phase["stuck"] == "Generating" and not engine.failed


def test_report_mode_fails_nothing() -> None:
    engine = ToyEngine()
    clock = FakeClock()
    config = load_config({"STALLGUARD_TOY": "1", "STALLGUARD_TOY_MODE": "report"})
    assert config is not None
    guard = ToyGuard(engine, config, clock=clock)
    engine.submit("stuck", hang_in="Loading")
    clock.advance(31)
    assert guard.step() == [] and not engine.failed
    assert guard.watchdog.statistics().states["Loading"].fired == 1


def test_time_in_phase_reaches_prometheus() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    engine = ToyEngine()
    clock = FakeClock()
    config = load_config({"STALLGUARD_TOY": "1"})
    assert config is not None
    guard = ToyGuard(engine, config, clock=clock, registry=registry)
    for i, seconds in enumerate([0.003, 0.7, 4.0, 12.0]):
        engine.submit(f"r{i}")
        clock.advance(seconds)
        engine.advance()  # Loading -> Generating after *seconds*
    guard.step()
    guard.step()  # a second export adds nothing
    get = registry.get_sample_value
    labels = {"engine": "toy0", "state": "Loading"}
    assert get("toy_stallguard_state_seconds_count", labels) == 4
    assert math.isclose(get("toy_stallguard_state_seconds_sum", labels), 16.703)
    assert get("toy_stallguard_state_seconds_bucket", {**labels, "le": "1.0"}) == 2
    assert get("toy_stallguard_state_seconds_bucket", {**labels, "le": "10.0"}) == 3


def test_bad_configuration_is_one_named_error(tmp_path: Path) -> None:
    bad = tmp_path / "toy.toml"
    bad.write_text('mode = "enforcing"\n[deadlines]\nLoading = 5\n')
    with pytest.raises(ConfigError, match=r'toy.toml: mode = "enforcing": must be one of'):
        load_config({"STALLGUARD_TOY_CONFIG": str(bad)})
    bad.write_text("[deadlines]\nDone = 5\n")
    with pytest.raises(ConfigError, match="Done is terminal and takes no deadline"):
        load_config({"STALLGUARD_TOY_CONFIG": str(bad)})
    with pytest.raises(ConfigError, match="STALLGUARD_TOY_DEADLINE_LOADNG.*did you mean"):
        load_config({"STALLGUARD_TOY": "1", "STALLGUARD_TOY_DEADLINE_LOADNG": "5"})
    with pytest.raises(ConfigError, match=r'STALLGUARD_TOY_DEADLINE_LOADING = "-1": must be'):
        load_config({"STALLGUARD_TOY": "1", "STALLGUARD_TOY_DEADLINE_LOADING": "-1"})


def test_version_support_is_one_specifier_and_its_check() -> None:
    support = stallguard_toy.SUPPORT
    assert support.specifier == ">=1.2,<2"
    assert support.contains("1.4.0") and support.contains("1.9.0rc1")
    assert not support.contains("2.0.0rc1") and not support.contains("1.2.0rc1")
    assert support.installed() is None and not support.is_supported()
    assert "Toy not installed, supported >=1.2,<2" in support.versions_line("stallguard-toy")
