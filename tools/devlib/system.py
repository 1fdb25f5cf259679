"""The system packages .venv's tests need (Debian's, installed with apt-get as root):
checked every `env` run (cheap), never stamped."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from .common import StepError, run

#: Debian bookworm's prometheus package (apt-cache policy prometheus); the rules test
#: runs whatever apt installs and says which version it ran.
PROMETHEUS_DEB = "2.42"


def have_libibverbs() -> bool:
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    except OSError:
        out = ""
    if "libibverbs.so.1" in out:
        return True
    return any(
        Path(d, "libibverbs.so.1").exists()
        for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")
    )


def have_prometheus() -> bool:
    return shutil.which("prometheus") is not None and shutil.which("promtool") is not None


def step_prometheus() -> str:
    if have_prometheus():
        return "present"
    why = (
        "the shipped Prometheus rules and Grafana dashboard (deploy/) will not be tested "
        "on a real Prometheus: tests/test_prometheus_rules.py skips"
    )
    if os.geteuid() != 0:
        return f"SKIPPED: prometheus missing and not root; {why} (`apt-get install -y prometheus`)"
    if shutil.which("apt-get") is None:
        return f"SKIPPED: prometheus missing and no apt-get; {why}"
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], env=env)
    run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"], env=env)
    if not have_prometheus():
        raise StepError("apt-get installed prometheus but prometheus/promtool are not on PATH")
    return "installed"


def step_libibverbs() -> str:
    if have_libibverbs():
        return "present"
    if os.geteuid() != 0:
        return (
            "SKIPPED: libibverbs1 missing and not root; mooncake.engine will not import "
            "(run `apt-get install -y libibverbs1` as root)"
        )
    if shutil.which("apt-get") is None:
        return "SKIPPED: libibverbs1 missing and no apt-get; mooncake.engine will not import"
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], env=env)
    run(["apt-get", "install", "-y", "-qq", "libibverbs1"], env=env)
    if not have_libibverbs():
        raise StepError("apt-get installed libibverbs1 but libibverbs.so.1 is still not found")
    return "installed"
