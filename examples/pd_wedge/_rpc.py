"""A tiny message protocol between the driver and its worker processes (one pipe each).

Driver -> worker: ``(msg_id, command, kwargs)``; ``msg_id`` None means "no reply".
Worker -> driver: ``(msg_id, ok, result_or_error_text)``, one per message with an id.

Workers never block on the pipe: their loop drains it between two units of work,
and a frozen (SIGSTOPped) worker simply stops answering, which the driver bounds
with a timeout on every call.
"""

from __future__ import annotations

import itertools
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

    def send(self, command: str, **kwargs: Any) -> bool:
        """Fire and forget (the pipe's buffer absorbs a short burst). False if the worker
        is gone (a killed decode: the message is lost, as a request to a dead host is)."""
        try:
            self.conn.send((None, command, kwargs))
        except (BrokenPipeError, ConnectionResetError, EOFError):
            return False
        return True

    def call(self, command: str, timeout: float = 20.0, **kwargs: Any) -> Any:
        msg_id = next(self._ids)
        self.conn.send((msg_id, command, kwargs))
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
