"""OpenTelemetry metrics (needs only ``opentelemetry-api``), off until enabled.

Why opt-in, unlike the span hook: the state duration histogram is recorded on every
state change, the one path of a watchdog that runs for every request. A watchdog has
no ``on_leave`` listener until :func:`enable_metrics` adds one, so a process that does
not want metrics pays one truth test per state change and nothing else.
"""

from __future__ import annotations

import math
import numbers
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._errors import ConfigError
from . import _hooks
from ._otel import ERROR_TYPES, INSTRUMENTATION_SCOPE, _scope_version

if TYPE_CHECKING:
    from .._details import Expiry
    from .._watchdog import Watchdog

__all__ = [
    "DEFAULT_STATE_DURATION_BUCKETS",
    "METRIC_EXPIRIES",
    "METRIC_OLDEST_AGE",
    "METRIC_REQUESTS",
    "METRIC_REQUEST_COUNT",
    "METRIC_RUNNER_ERRORS",
    "METRIC_STATE_DURATION",
    "disable_metrics",
    "enable_metrics",
]

#: Counter of expiries; attributes ``stallguard.spec``, ``stallguard.state``,
#: ``stallguard.reason``, ``stallguard.mode``, and for an enforced expiry
#: ``error.type`` (:data:`~stallguard.instrumentation.ERROR_TYPES` of the reason).
METRIC_EXPIRIES = "stallguard.expiries"
#: Histogram of seconds spent in a state, recorded when a request leaves it (state
#: change, terminal state, ``forget()``, enforced expiry); attributes ``stallguard.spec``,
#: ``stallguard.state``.
METRIC_STATE_DURATION = "stallguard.state.duration"
#: Observable up-down counter of tracked requests (an additive count, named ``*.count``
#: as OpenTelemetry's naming conventions ask of up-down counters of things); attributes
#: ``stallguard.spec``, ``stallguard.state``.
METRIC_REQUEST_COUNT = "stallguard.request.count"
#: Deprecated: the same count as :data:`METRIC_REQUEST_COUNT` under its 0.1.0 name, as an
#: observable gauge. Still reported in 0.1.x so that dashboards keep working while they
#: move to the new name; removed in 0.2.
METRIC_REQUESTS = "stallguard.requests"
#: Observable gauge of the age, in seconds, of the longest-waiting request in a state
#: (0 when the state is empty); attributes ``stallguard.spec``, ``stallguard.state``.
METRIC_OLDEST_AGE = "stallguard.state.oldest_age"
#: Counter of runner loops (``WatchdogThread``, ``run_watchdog``) that an error ended;
#: attribute ``stallguard.spec``. Anything above 0 means overdue requests of that spec
#: are no longer failed in the background (docs/runners.md).
METRIC_RUNNER_ERRORS = "stallguard.runner.errors"

#: Histogram bucket boundaries (seconds) for :data:`METRIC_STATE_DURATION`: fine below a
#: second (healthy transfers), then dense from 10 s to 30 min, where KV transfer and
#: bootstrap deadlines are chosen.
DEFAULT_STATE_DURATION_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    45.0,
    60.0,
    90.0,
    120.0,
    180.0,
    240.0,
    300.0,
    450.0,
    600.0,
    900.0,
    1200.0,
    1800.0,
)

_lock = threading.Lock()
_current: _Metrics | None = None


class _Metrics:
    """The instruments of one enable_metrics() call."""

    def __init__(self, meter_provider: Any, buckets: tuple[float, ...] | None) -> None:
        from opentelemetry import metrics

        meter = metrics.get_meter(
            INSTRUMENTATION_SCOPE,
            _scope_version(),  # type: ignore[arg-type]  # None is accepted at runtime
            meter_provider=meter_provider,
        )
        self.provider = meter_provider
        # watchdog -> the on_leave recorder installed on it (to remove only our own). The
        # function, not its Listener: a Listener holds its watchdog, and a value that
        # holds its key keeps it alive for as long as the dictionary (every watchdog made
        # while metrics were on was never freed).
        self.recorders: weakref.WeakKeyDictionary[Watchdog[Any], Callable[[str, float], None]]
        self.recorders = weakref.WeakKeyDictionary()
        self.expiries = meter.create_counter(
            METRIC_EXPIRIES,
            unit="{expiry}",
            description="Requests that overstayed a stallguard deadline (forced or reported)",
        )
        self.runner_errors = meter.create_counter(
            METRIC_RUNNER_ERRORS,
            unit="{error}",
            description="stallguard runner loops ended by an error (the runner is gone)",
        )
        self.duration: Any = None
        if buckets is not None:
            description = "Seconds a request spent in a state, recorded when it left the state"
            try:
                self.duration = meter.create_histogram(
                    METRIC_STATE_DURATION,
                    unit="s",
                    description=description,
                    explicit_bucket_boundaries_advisory=list(buckets),
                )
            except TypeError:  # pragma: no cover - opentelemetry-api < 1.23: no advisory
                self.duration = meter.create_histogram(
                    METRIC_STATE_DURATION, unit="s", description=description
                )
        meter.create_observable_up_down_counter(
            METRIC_REQUEST_COUNT,
            callbacks=[self._observe_requests],
            unit="{request}",
            description="Requests tracked by stallguard watchdogs, per state",
        )
        meter.create_observable_gauge(  # deprecated name, until 0.2
            METRIC_REQUESTS,
            callbacks=[self._observe_requests],
            unit="{request}",
            description=f"Deprecated (removed in stallguard 0.2): use {METRIC_REQUEST_COUNT}",
        )
        meter.create_observable_gauge(
            METRIC_OLDEST_AGE,
            callbacks=[self._observe_oldest_age],
            unit="s",
            description="Age of the longest-waiting request in each state (0 when empty)",
        )
        # (spec, state, reason, mode) -> attributes, built once and shared between
        # records: never mutated, so handing the same dict to the SDK each time is safe.
        self._expiry_attributes: dict[tuple[str, str, str, str], dict[str, str]] = {}

    # -- the expiry counter: an instrumentation hook
    def count_expiry(self, expiry: Expiry[Any]) -> None:
        key = (expiry.spec, expiry.state_label, expiry.reason, expiry.mode)
        attributes = self._expiry_attributes.get(key)
        if attributes is None:
            new = {
                "stallguard.spec": key[0],
                "stallguard.state": key[1],
                "stallguard.reason": key[2],
                "stallguard.mode": key[3],
            }
            if expiry.mode == "enforce":  # a failure: OpenTelemetry's error.type
                new["error.type"] = ERROR_TYPES[expiry.reason]
            attributes = self._expiry_attributes.setdefault(key, new)
        self.expiries.add(1, attributes)

    # -- the state duration histogram: each watchdog's on_leave
    def recorder(self, spec: str) -> Callable[[str, float], None]:
        record = self.duration.record
        by_state: dict[str, dict[str, str]] = {}

        def on_leave(state: str, seconds: float) -> None:
            attributes = by_state.get(state)
            if attributes is None:
                attributes = by_state.setdefault(
                    state, {"stallguard.spec": spec, "stallguard.state": state}
                )
            record(seconds, attributes)

        return on_leave

    def install(self, watchdog: Watchdog[Any]) -> None:
        """Give *watchdog* a duration recorder (a listener: it shares the watchdog with
        any other listener)."""
        if watchdog in self.recorders:
            return
        on_leave = self.recorder(watchdog.spec.name)
        watchdog.add_listener(on_leave=on_leave)
        self.recorders[watchdog] = on_leave

    def uninstall(self, watchdog: Watchdog[Any]) -> None:
        on_leave = self.recorders.pop(watchdog, None)
        for listener in watchdog.listeners:
            if on_leave is not None and listener.on_leave is on_leave:
                listener.remove()

    # -- the observable gauges
    def _per_state(self) -> dict[tuple[str, str], tuple[int, float]]:
        """(spec, state) -> (requests, oldest age), summed / maxed over the live
        watchdogs of a spec (a process often runs one watchdog per engine or rank)."""
        merged: dict[tuple[str, str], tuple[int, float]] = {}
        # Report only while metrics are enabled on this callback's provider. (Enabling
        # twice on one SDK provider returns the first call's instruments, callbacks
        # included, so the check is on the provider, not on this object.)
        current = _current
        if current is None or current.provider is not self.provider:
            return merged
        for watchdog in _hooks.live_watchdogs():
            snapshot = watchdog.snapshot(requests=False)
            for label, summary in snapshot.states.items():
                key = (snapshot.spec, label)
                count, oldest = merged.get(key, (0, 0.0))
                age = summary.oldest_age or 0.0
                merged[key] = (count + summary.count, max(oldest, age))
        return merged

    def _observe_requests(self, _options: Any) -> Iterable[Any]:
        from opentelemetry.metrics import Observation

        return [
            Observation(count, {"stallguard.spec": spec, "stallguard.state": state})
            for (spec, state), (count, _age) in self._per_state().items()
        ]

    def _observe_oldest_age(self, _options: Any) -> Iterable[Any]:
        from opentelemetry.metrics import Observation

        return [
            Observation(age, {"stallguard.spec": spec, "stallguard.state": state})
            for (spec, state), (_count, age) in self._per_state().items()
        ]


def _count_runner_error(spec: str) -> None:
    """Count a runner loop that an error ended (called by the runners)."""
    current = _current
    if current is not None:
        current.runner_errors.add(1, {"stallguard.spec": spec})


def _valid_buckets(buckets: object) -> tuple[float, ...]:
    if isinstance(buckets, (str, bytes, Mapping)) or not isinstance(buckets, Iterable):
        raise _bad_buckets(buckets, f"a {type(buckets).__name__} is not a sequence of numbers")
    values = tuple(buckets)
    if not values:
        raise _bad_buckets(buckets, "it is empty")
    out: list[float] = []
    for b in values:
        seconds = _bucket_seconds(buckets, b)
        if out and seconds <= out[-1]:
            raise _bad_buckets(buckets, f"{b!r} does not increase on {out[-1]!r}")
        out.append(seconds)
    return tuple(out)


def _bucket_seconds(buckets: object, b: object) -> float:
    """The bound *b* of *buckets* as a finite, non-negative float."""
    if isinstance(b, bool) or not isinstance(b, numbers.Real):
        raise _bad_buckets(buckets, f"{b!r} is not a number")
    try:
        seconds = float(b)
    except OverflowError:
        raise _bad_buckets(buckets, f"{b!r} is too large for a float") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise _bad_buckets(buckets, f"{b!r} is not a finite, non-negative number")
    return seconds


def _bad_buckets(buckets: object, problem: str) -> ConfigError:
    return ConfigError(
        "enable_metrics(state_duration_buckets=...) must be a non-empty sequence of "
        f"increasing, finite, non-negative numbers of seconds, got {buckets!r}: {problem}"
    )


def enable_metrics(
    meter_provider: Any = None,
    *,
    state_durations: bool = True,
    state_duration_buckets: Sequence[float] = DEFAULT_STATE_DURATION_BUCKETS,
) -> None:
    """Turn on stallguard's OpenTelemetry metrics, for every watchdog of the process,
    the live ones and those created later.

    * :data:`METRIC_EXPIRIES` (``stallguard.expiries``): a counter of expiries by
      spec, state, reason and mode (and ``error.type`` for enforced ones), installed
      as an expiry hook next to the ones set with :func:`set_on_expire_hooks` (which
      does not remove it).
    * :data:`METRIC_STATE_DURATION` (``stallguard.state.duration``): a histogram of the
      seconds spent in each state, recorded when a request leaves the state, by spec
      and state. Choose a deadline from its upper percentiles. It is recorded by an
      ``on_leave`` listener on each watchdog (:meth:`~stallguard.Watchdog.add_listener`),
      beside any other listener.
    * :data:`METRIC_RUNNER_ERRORS` (``stallguard.runner.errors``): a counter of runner
      loops ended by an error, by spec (docs/runners.md).
    * :data:`METRIC_REQUEST_COUNT` (an observable up-down counter) and
      :data:`METRIC_OLDEST_AGE` (an observable gauge): the tracked requests and the
      oldest request's age, per spec and state, summed (count) or maxed (age) over the
      live watchdogs of a spec, read when the metric reader collects. The count is also
      reported under its deprecated 0.1.0 name :data:`METRIC_REQUESTS` (a gauge) until
      0.2.

    Calling it again replaces the instruments (e.g. with another provider).

    Args:
        meter_provider: the ``MeterProvider`` to use; None (the default) uses the
            global one (a proxy that starts recording once an SDK is installed).
        state_durations: record the duration histogram. It is the one metric paid
            per state change (see docs/instrumentation.md for the cost with an SDK);
            False keeps the counter and the gauges, whose cost is per expiry and per
            collection, and adds no ``on_leave`` listener.
        state_duration_buckets: bucket boundaries in seconds for the duration
            histogram, passed as the instrument's advisory boundaries (an SDK ``View``
            configured by the application takes precedence).

    Raises:
        ConfigError: naming the argument and its value: a *meter_provider* without
            ``get_meter()``, a non-bool *state_durations*, or buckets that are not a
            non-empty, strictly increasing sequence of finite, non-negative numbers
            (``nan``, ``inf``, a string, an int too large for a float are refused).
    """
    global _current
    _check_metrics_args(meter_provider, state_durations)
    buckets = _valid_buckets(state_duration_buckets)
    new = _Metrics(meter_provider, buckets if state_durations else None)
    install = new.install if state_durations else None
    with _lock:
        old, _current = _current, new
        watchdogs = _hooks._set_metrics(new.count_expiry, install)
        for watchdog in watchdogs:
            if old is not None:
                old.uninstall(watchdog)
            if install is not None:
                install(watchdog)


def _check_metrics_args(meter_provider: object, state_durations: object) -> None:
    """Refuse a *meter_provider* without ``get_meter()``, or a non-bool
    *state_durations*."""
    if meter_provider is not None and not callable(getattr(meter_provider, "get_meter", None)):
        raise ConfigError(
            f"enable_metrics(meter_provider=...) must be an OpenTelemetry MeterProvider "
            f"or None, got {meter_provider!r}"
        )
    if not isinstance(state_durations, bool):
        raise ConfigError(
            f"enable_metrics(state_durations=...) must be True or False, got {state_durations!r}"
        )


def disable_metrics() -> None:
    """Turn stallguard's metrics off: remove the expiry counter and the duration
    recorders installed by :func:`enable_metrics`, and make the gauges report nothing.
    Idempotent."""
    global _current
    with _lock:
        old, _current = _current, None
        watchdogs = _hooks._set_metrics(None, None)
        if old is not None:
            for watchdog in watchdogs:
                old.uninstall(watchdog)
