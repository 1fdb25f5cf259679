"""Worker processes, each its own OS process: for the prefill-side faults two prefills
and two decodes per engine; for the decode-side faults a bootstrap server process, two
prefills and two decode servers.

Importing SGLang costs 6-13 s per interpreter, and the demo starts a dozen processes, so
the workers are forked from a multiprocessing *fork server* that imported SGLang once
(``set_forkserver_preload``). The fork server is started by the driver after the engine
environment is set and never imports a transfer engine, so every worker creates its own
NIXL agent / Mooncake engine after the fork. Each worker then applies its own launch
environment (for the prefill of the "with stallguard" arm: ``STALLGUARD_SGLANG_CONFIG``)
before it does anything else, like a freshly launched server process would.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from stallguard.testing import free_port as free_port  # (the drivers call _procs.free_port)

from ._rpc import Endpoint, WorkerError

PRELOAD = [
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.disaggregation.decode",
    "sglang.srt.disaggregation.nixl.conn",
    "sglang.srt.disaggregation.mooncake.conn",
    "sglang.srt.managers.scheduler",
    "sglang.srt.plugins",
]

_CTX = None


def context():
    """The fork-server multiprocessing context (started lazily, SGLang preloaded)."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


def worker_main(role: str, conn, spec: dict) -> None:
    """Entry point of every worker (runs in the forked child)."""
    os.environ.update(spec.get("env", {}))
    log = open(spec["log"], "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    logging.basicConfig(
        level=logging.WARNING,
        stream=log,
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    code = 0
    try:
        if role == "prefill":
            from . import _prefill

            _prefill.run(conn, spec)
        elif role == "decode":
            from . import _decode

            _decode.run(conn, spec)
        elif role == "bootstrap":
            from . import _ppeer

            _ppeer.run_bootstrap(conn, spec)
        elif role == "ppeer":
            from . import _ppeer

            _ppeer.run(conn, spec)
        elif role == "tprefill":
            from . import _thaw

            _thaw.run_prefill(conn, spec)
        elif role == "tdecode":
            from . import _thaw

            _thaw.run_decode(conn, spec)
        elif role == "dserver":
            from . import _dserver

            _dserver.run(conn, spec)
        else:
            raise ValueError(f"unknown worker role {role!r}")
    except BaseException:
        code = 1
        text = traceback.format_exc()
        log.write(text)
        try:
            conn.send(("error", text))
        except Exception:
            pass
    finally:
        log.flush()
        # The NIXL manager's bootstrap thread is not a daemon thread: a plain return would
        # leave the process running forever.
        os._exit(code)


class Worker:
    """Driver-side handle of a worker process."""

    def __init__(self, name: str, role: str, spec: dict):
        ctx = context()
        parent, child = ctx.Pipe()
        self.name = name
        self.role = role
        self.spec = spec
        self.proc = ctx.Process(target=worker_main, args=(role, child, spec), name=name)
        self.proc.start()
        child.close()
        self.rpc = Endpoint(name, parent)
        self.info = None
        self.stopped = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 60.0):
        if not self.rpc.conn.poll(timeout):
            raise WorkerError(
                f"{self.name}: not ready within {timeout:.0f}s (log: {self.spec['log']})"
            )
        tag, info = self.rpc.conn.recv()
        if tag != "ready":
            raise WorkerError(f"{self.name} failed to start:\n{info}")
        self.info = info
        return info

    def alive(self) -> bool:
        return self.proc.is_alive()

    def state(self) -> str:
        """Kernel scheduling state: 'T' when stopped, 'Z'/'' when gone."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return ""

    def wait_state(self, want: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.state() == want:
                return True
            time.sleep(0.002)
        return False

    def signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the worker to exit; SIGCONT then SIGKILL if it does not."""
        self.signal(signal.SIGCONT)
        if self.proc.is_alive():
            try:
                self.rpc.call("shutdown", timeout=2.0)
            except Exception:
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.signal(signal.SIGKILL)
            self.proc.join(timeout)
        self.rpc.conn.close()


def log_path(out: Path, name: str) -> str:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return str(logs / f"{name}.log")
