"""``stallguard.testing.stop_and_wait`` / ``threads_stopped``: the freeze of a peer that
the demo and the adapters' tests inject, on a real child process with several threads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from stallguard.testing import stop_and_wait, threads_stopped

CHILD = """
import threading, time
def spin():
    while True:
        pass
for _ in range(3):
    threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_stop_and_wait_returns_once_every_thread_is_stopped() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        assert len(os.listdir(f"/proc/{child.pid}/task")) >= 4
        assert not threads_stopped(child.pid)  # the control: running threads are seen
        waited = stop_and_wait(child.pid, timeout=10)
        assert waited >= 0 and threads_stopped(child.pid)
        os.kill(child.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while threads_stopped(child.pid):  # resumed: running again
            assert time.monotonic() < deadline, "SIGCONT did not resume the child"
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait()
    with pytest.raises(OSError):
        threads_stopped(child.pid)  # reaped: no /proc entry
