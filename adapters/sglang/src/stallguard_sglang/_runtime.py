"""Runtime and version support: the adapter's process-wide state.

One :class:`Runtime` per process, set by :func:`stallguard_sglang.plugin.install`: the
configuration, the SGLang version, the clock new watchdogs use, the live queue guards,
the transfer backend of each KV sender class, and the count of errors the hooks caught.
Nothing here imports SGLang.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from ._config import Config
from ._profiles import format_support_table, support_table
from .package import sglang_version

if TYPE_CHECKING:
    from ._guard import QueueGuard

__all__ = ["Runtime", "report_error", "runtime", "set_runtime"]

log = logging.getLogger("stallguard.sglang")

#: SGLang module defining a KV sender class -> its backend profile's name.
_BACKEND_MODULES = {
    "sglang.srt.disaggregation.nixl.conn": "nixl",
    "sglang.srt.disaggregation.mooncake.conn": "mooncake",
    "sglang.srt.disaggregation.ascend.conn": "ascend",
    "sglang.srt.disaggregation.mori.conn": "mori",
    "sglang.srt.disaggregation.fake.conn": "fake",
}


class Runtime:
    """Process-wide adapter state: the configuration, the clock, the queue guards."""

    def __init__(self, config: Config, *, version: str | None = None) -> None:
        self.config = config
        self.version = version if version is not None else sglang_version()
        #: the clock every new watchdog uses (tests swap in a FakeClock).
        self.clock: Callable[[], float] = time.monotonic
        #: KV sender class -> backend name (None: not a sender class the adapter knows)
        self.backends: dict[type, str | None] = {}
        self._table_logged = False
        #: the "stallguard-sglang active ..." line when it could not be logged at
        #: install time (logging not configured yet): logged at the first queue call.
        self.pending_active_line: str | None = None
        #: every queue guard alive in this process (weakly: they die with their queue).
        self.guards: weakref.WeakSet[QueueGuard] = weakref.WeakSet()
        #: exceptions the hooks caught (and logged) instead of breaking the scheduler loop.
        self.errors = 0

    def backend_of(self, sender: object) -> str | None:
        """The profile name of *sender*'s class, from the SGLang module defining it (or
        a base class: subclasses keep their parent's profile)."""
        cls = type(sender)
        try:
            return self.backends[cls]
        except KeyError:
            pass
        backend = None
        for klass in cls.__mro__:
            backend = _BACKEND_MODULES.get(klass.__module__)
            if backend is not None:
                break
        if backend is None:
            log.warning(
                "stallguard-sglang: %s.%s is not a KV sender class it knows; its requests "
                "are not guarded",
                cls.__module__,
                cls.__qualname__,
            )
        self.backends[cls] = backend
        return backend

    def announce(self) -> None:
        """Log the pending "active" line, once (the first queue call of a process whose
        logging was configured after the plugin was installed)."""
        line, self.pending_active_line = self.pending_active_line, None
        if line is not None:
            log.info("%s", line)

    def log_support_table(self, backends: list[str]) -> None:
        """Log the support table once per process (at the first queue call)."""
        self.announce()
        if self._table_logged:
            return
        self._table_logged = True
        rows = support_table(self.config, backends, version=self.version)
        log.info(
            "stallguard-sglang: deadlines (config %s, SGLang %s):\n%s",
            self.config.source,
            self.version,
            format_support_table(rows, version=self.version),
        )


_runtime: Runtime | None = None


def runtime() -> Runtime | None:
    """The adapter's process-wide state, or None if it was never installed."""
    return _runtime


def set_runtime(rt: Runtime | None) -> None:
    """Install (or, with None, remove) the process-wide state."""
    global _runtime
    _runtime = rt


def report_error(where: str) -> None:
    """Log the exception being handled (a hook must never break SGLang's loop) and
    count it in the runtime's ``errors``."""
    rt = _runtime
    if rt is not None:
        rt.errors += 1
    log.exception("stallguard-sglang: error in %s; the request queue is not guarded", where)
