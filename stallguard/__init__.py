"""stallguard: per-state deadlines that force-fail stalled requests, exactly once.

Declare a request's phases and how long each may last in a :class:`Spec`, feed state
changes to a :class:`Watchdog`, and call :meth:`Watchdog.check` from your loop (or let
a runner do it): every request that overstays is failed exactly once, and reported to
logging and OpenTelemetry.

``stallguard.__compiled__`` is True when the tracking core runs compiled (the optional
mypyc accelerator that the platform wheels carry), False when it runs as Python (the
pure-Python wheel, a source checkout, or ``STALLGUARD_PURE=1``); both behave the same.
``stallguard._accel.WHY`` says why.
"""

from __future__ import annotations

from typing import Any

# First: decides whether the compiled core or its sources run, before anything imports it.
from . import _accel  # isort: skip
from ._advice import Advice, StateAdvice, advise, statistics_from_prometheus
from ._config import (
    WatchdogConfig,
    load_config,
    load_spec,
    parse_config_table,
    parse_deadlines,
)
from ._details import CONCLUDED, Expiry, Mode, Reason, Snapshot, StateSummary, TrackedRequest
from ._errors import ClockError, ConfigError, StallguardError, UnknownStateError
from ._options import WatchdogOptions
from ._quarantine import PROOFS, Hold, PeerHolds, Quarantine, QuarantineSnapshot
from ._runners import AsyncWait, ThreadWait, WatchdogThread, run_watchdog, watching
from ._spec import Deadline, Spec, State, state_label
from ._stats import Distribution, StateStatistics, Statistics
from ._watchdog import Listener, Watchdog

#: True when the core runs compiled, False when it runs as Python (see the docstring)
__compiled__: bool = _accel.COMPILED

# Installs the default instrumentation hooks in the registry watchdogs read.
from . import instrumentation as instrumentation  # isort: skip

__all__ = [
    "CONCLUDED",
    "Advice",
    "AsyncWait",
    "ClockError",
    "ConfigError",
    "Deadline",
    "Distribution",
    "Expiry",
    "Hold",
    "Listener",
    "Mode",
    "PROOFS",
    "PeerHolds",
    "Quarantine",
    "QuarantineSnapshot",
    "Reason",
    "Snapshot",
    "Spec",
    "StallguardError",
    "State",
    "StateAdvice",
    "StateStatistics",
    "StateSummary",
    "Statistics",
    "ThreadWait",
    "TrackedRequest",
    "UnknownStateError",
    "Watchdog",
    "WatchdogConfig",
    "WatchdogOptions",
    "WatchdogThread",
    "advise",
    "load_config",
    "load_spec",
    "parse_config_table",
    "parse_deadlines",
    "run_watchdog",
    "state_label",
    "statistics_from_prometheus",
    "watching",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("stallguard")
        except PackageNotFoundError:  # a raw checkout that was never installed
            return "0+unknown"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
