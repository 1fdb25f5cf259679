"""Process-wide state that watchdogs and the instrumentation package share.

Both sides import this module and neither imports the other: a watchdog asks here for
the instrumentation hooks to call and registers itself here; ``stallguard.instrumentation``
installs the function that resolves the hooks and the per-watchdog installer for
metrics. (Before this module, ``_watchdog`` imported ``instrumentation``, which imported
``Watchdog`` back.)
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from ._core import WatchdogCore
    from ._details import Expiry
    from ._watchdog import Watchdog

__all__ = ["active_hooks", "invalidate", "live_watchdogs", "register_watchdog", "resolved"]

Hook = Callable[["Expiry[Any]"], object]

lock = threading.RLock()
# The hooks every watchdog calls for each expiry, or None until resolved again.
_active: tuple[Hook, ...] | None = None
# Set by stallguard.instrumentation on import: resolves the configured hooks (lock held).
resolver: Callable[[], tuple[Hook, ...]] | None = None
# Called with each new watchdog (enable_metrics() installs its listeners with it).
on_register: Callable[[Watchdog[Any]], None] | None = None
# Weak references to Watchdog instances only: Watchdog is an interpreted class even when
# its base (WatchdogCore) is compiled, and CPython's deallocator of an interpreted class
# clears its weak references (a compiled class's does not: mypyc#1102, docs/performance.md).
_watchdogs: weakref.WeakSet[Watchdog[Any]] = weakref.WeakSet()
# Set by stallguard.instrumentation: whether resolving the hooks now costs no import that
# a process whose requests never expire would not pay (then a new watchdog resolves them,
# so that its first expiry does not).
cheap_to_resolve: Callable[[], bool] | None = None


def active_hooks() -> tuple[Hook, ...]:
    """What watchdogs call for each expiry (one module global read when cached)."""
    global _active
    active = _active
    if active is not None:
        return active
    with lock:
        if _active is None:
            _active = () if resolver is None else resolver()
        return _active


def resolved() -> bool:
    """Whether the hooks are resolved (a check resolves them before its clock reading)."""
    return _active is not None


def invalidate() -> None:
    """Forget the cached hooks: the next expiry resolves them again."""
    global _active
    with lock:
        _active = None


def register_watchdog(core: WatchdogCore) -> None:
    """Called by every :class:`~stallguard.Watchdog` at the end of its construction."""
    watchdog = cast("Watchdog[Any]", core)  # (only Watchdog instances are ever made)
    with lock:  # atomic with enable_metrics()' switch: no watchdog missed or done twice
        _watchdogs.add(watchdog)
        if on_register is not None:
            on_register(watchdog)
        if _active is None and cheap_to_resolve is not None and cheap_to_resolve():
            active_hooks()


def live_watchdogs() -> list[Watchdog[Any]]:
    """Every watchdog still alive in this process, in no particular order."""
    with lock:
        return list(_watchdogs)
