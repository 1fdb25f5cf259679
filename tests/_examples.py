"""Running an example as a newcomer would: a separate interpreter, from the repo root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run_example(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``examples/<script>`` with *args*; never raises on a non-zero exit.

    The child gets this environment minus ``OTEL_*`` variables (an exporter configured
    for the test run must not change what an example prints), with the checkout first on
    ``PYTHONPATH``.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
        check=False,
    )
