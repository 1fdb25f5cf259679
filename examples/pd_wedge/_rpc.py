"""A tiny message protocol between the driver and its worker processes (one pipe each).

Driver -> worker: ``(msg_id, command, kwargs)``; ``msg_id`` None means "no reply".
Worker -> driver: ``(msg_id, ok, result_or_error_text)``, one per message with an id.

Workers never block on the pipe: their loop drains it between two units of work,
and a frozen (SIGSTOPped) worker simply stops answering, which the driver bounds
with a timeout on every call. The driver never blocks on it either: its messages go
through an outbox that a thread of its own writes to the pipe, in order. A frozen
worker stops reading, and at a loaded machine's longer fault windows (x8) the requests
sent to it meanwhile outgrow the pipe's 64 KiB buffer: a blocking send would stall the
whole run (its SIGCONT included) there.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any


class WorkerError(RuntimeError):
    """A worker answered a call with an exception, or did not answer in time."""


class Endpoint:
    """Driver side of one worker's pipe."""

    def __init__(self, name: str, conn: Connection):
        self.name = name
        self.conn = conn
        self._ids = itertools.count(1)
        self._outbox: collections.deque[tuple[int | None, str, dict[str, Any]]] = (
            collections.deque()
        )
        self._ready = threading.Condition()
        self._gone = False
        threading.Thread(target=self._write, name=f"rpc-{name}", daemon=True).start()

    def _write(self) -> None:
        while True:
            with self._ready:
                while not self._outbox:
                    self._ready.wait()
                message = self._outbox[0]
            try:
                self.conn.send(message)  # blocks while a frozen worker's pipe is full
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                self._gone = True  # a killed worker: what is left is lost, as it would be
                with self._ready:
                    self._outbox.clear()
                return
            with self._ready:
                self._outbox.popleft()

    def _put(self, message: tuple[int | None, str, dict[str, Any]]) -> None:
        with self._ready:
            self._outbox.append(message)
            self._ready.notify()

    def send(self, command: str, **kwargs: Any) -> bool:
        """Fire and forget, never blocking (the outbox absorbs what a frozen worker does
        not read yet). False once the worker is known to be gone (a killed decode: the
        message is lost, as a request to a dead host is)."""
        if self._gone:
            return False
        self._put((None, command, kwargs))
        return True

    def call(self, command: str, timeout: float = 20.0, **kwargs: Any) -> Any:
        msg_id = next(self._ids)
        if self._gone:
            raise WorkerError(f"{self.name}: pipe closed before {command!r}")
        self._put((msg_id, command, kwargs))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.conn.poll(left):
                raise WorkerError(f"{self.name}: no answer to {command!r} within {timeout:.0f}s")
            try:
                got_id, ok, result = self.conn.recv()
            except (EOFError, OSError) as exc:
                raise WorkerError(f"{self.name}: pipe closed during {command!r}") from exc
            if got_id != msg_id:  # a late answer to an earlier, timed-out call
                continue
            if not ok:
                raise WorkerError(f"{self.name}: {command!r} failed:\n{result}")
            return result


def drain(
    conn: Connection,
    handlers: dict[str, Callable[..., Any]],
    wait: float = 0.0,
    limit: int = 64,
) -> bool:
    """Handle the messages waiting on ``conn`` (worker side), at most ``limit`` of them
    (like SGLang's ``SGLANG_SCHEDULER_MAX_RECV_PER_POLL``: a burst of requests cannot
    hold up a scheduler loop pass).

    Returns False when the driver has gone away (the worker should exit).
    """
    try:
        ready = conn.poll(wait)
    except (EOFError, OSError):
        return False
    while ready and limit > 0:
        limit -= 1
        try:
            msg_id, command, kwargs = conn.recv()
        except (EOFError, OSError):
            return False
        try:
            result, ok = handlers[command](**kwargs), True
        except Exception:
            result, ok = traceback.format_exc(), False
        if msg_id is not None:
            conn.send((msg_id, ok, result))
        try:
            ready = conn.poll(0)
        except (EOFError, OSError):
            return False
    return True
