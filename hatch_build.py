"""The optional compiled core: mypyc builds ``stallguard/_fifo.py`` and
``stallguard/_core.py`` into extension modules that sit beside the sources, which stay
in the package as the fallback (``stallguard._accel`` chooses; docs/performance.md,
"The compiled core", and docs/dependencies.md, "Release build", say more).

Two ways in, one build (:func:`compile_core`):

* **hatchling's build hook** (``[tool.hatch.build.targets.wheel.hooks.custom]`` in
  pyproject.toml): a wheel is built compiled only when ``STALLGUARD_COMPILE=1`` (the
  release build, cibuildwheel, sets it); otherwise, and always for the sdist and an
  editable install, the wheel is the pure-Python one (``py3-none-any``) and mypy is
  not needed.
* **the command line** (``tools/dev.py test`` runs it through :mod:`devlib.compiled`):
  ``python hatch_build.py --out DIR`` writes a copy of the package with the compiled
  modules into ``DIR/stallguard``, for running the test suite against the compiled
  build.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

#: the modules compiled (the hot path); everything else stays interpreted
COMPILED = ("_fifo", "_core")
#: the mypyc group: its shared library is ``stallguard/core__mypyc.<abi>.so`` (inside
#: the package, not a top-level module of site-packages)
GROUP = "stallguard.core"
#: the build's requirements (mypyc ships with mypy; setuptools drives the compiler); the
#: hook adds the project's runtime dependencies: mypyc type-checks everything the two
#: modules import, and a dependency it cannot find fails the build
REQUIRES = ["mypy==2.4.1", "setuptools>=70"]
#: optional imports of the package (lazily imported, not dependencies): typed as Any
#: when absent from the build environment
OPTIONAL = ("prometheus_client", "transitions")

HERE = Path(__file__).resolve().parent


def compile_core(package: Path, out: Path, *, quiet: bool = True) -> list[Path]:
    """Compile :data:`COMPILED` of *package* (a ``stallguard`` directory) with mypyc;
    the extension modules are written under *out* (``out/stallguard/...``). Returns
    their paths. Raises whatever mypyc or the C compiler raise."""
    from mypyc.build import mypycify
    from setuptools import Distribution

    package = package.resolve()
    out = out.resolve()
    with tempfile.TemporaryDirectory(prefix="stallguard-mypyc-") as tmp:
        # mypyc names a module by its path from the working directory
        cwd = os.getcwd()
        os.chdir(package.parent)
        try:
            paths = [f"{package.name}/{name}.py" for name in COMPILED]
            config = Path(tmp) / "mypy.ini"
            config.write_text(
                "[mypy]\n"
                + "".join(f"[mypy-{m}.*]\nignore_missing_imports = True\n" for m in OPTIONAL)
            )
            paths = ["--config-file", str(config), *paths]
            # (a package copied under another name, e.g. the benchmarks' side-by-side
            # copy, gets its own library: <name>/core__mypyc)
            group = GROUP if package.name == "stallguard" else f"{package.name}.core"
            extensions = mypycify(
                paths, opt_level="3", group_name=group, target_dir=str(Path(tmp) / "c")
            )
            dist = Distribution({"name": "stallguard", "ext_modules": extensions})
            dist.script_name = "hatch_build.py"
            cmd: Any = dist.get_command_obj("build_ext")
            cmd.build_lib = str(out)
            cmd.build_temp = str(Path(tmp) / "o")
            cmd.inplace = False
            dist.verbose = 0 if quiet else 1
            dist.run_command("build_ext")
            built = [Path(p) for p in cmd.get_outputs()]
        finally:
            os.chdir(cwd)
    return built


def build_tree(out: Path, package: Path = HERE / "stallguard") -> list[Path]:
    """A copy of *package* in ``out/stallguard`` with the compiled modules beside its
    sources (what a compiled wheel installs). *out* is replaced."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(package, out / "stallguard", ignore=shutil.ignore_patterns("__pycache__"))
    return compile_core(out / "stallguard", out)


def _wheel_hook() -> type:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface

    class CompiledCore(BuildHookInterface):  # type: ignore[type-arg]
        """Adds the compiled modules to the wheel when ``STALLGUARD_COMPILE=1``."""

        PLUGIN_NAME = "custom"

        def _wanted(self, version: str) -> bool:
            return (
                self.target_name == "wheel"
                and version != "editable"
                and os.environ.get("STALLGUARD_COMPILE", "") == "1"
            )

        def dependencies(self) -> list[str]:
            if os.environ.get("STALLGUARD_COMPILE", "") != "1":
                return []
            return [*REQUIRES, *self.metadata.core.dependencies]

        def initialize(self, version: str, build_data: dict[str, Any]) -> None:
            if not self._wanted(version):
                return
            self._tmp = tempfile.TemporaryDirectory(prefix="stallguard-wheel-")
            out = Path(self._tmp.name)
            for path in compile_core(Path(self.root) / "stallguard", out):
                rel = path.relative_to(out).as_posix()
                build_data["force_include"][str(path)] = rel
            build_data["pure_python"] = False
            build_data["infer_tag"] = True

        def finalize(self, version: str, build_data: dict[str, Any], artifact: str) -> None:
            tmp = getattr(self, "_tmp", None)
            if tmp is not None:
                tmp.cleanup()

    return CompiledCore


if "hatchling" in sys.modules or __name__ != "__main__":
    try:
        CompiledCore = _wheel_hook()
    except ImportError:  # imported without hatchling (tools/devlib): the builder only
        pass


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "--out":
        print("usage: python hatch_build.py --out DIR", file=sys.stderr)
        return 2
    built = build_tree(Path(argv[1]))
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for path in built:
        print(path)
    return 0 if built and all(str(p).endswith(suffix) for p in built) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
