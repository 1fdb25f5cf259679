"""The public :class:`~stallguard.Watchdog`: the core (``_core.WatchdogCore``, which
tracks requests and decides expiries, and which the optional compiled accelerator
builds) with the methods that live in other modules bound to it.

This class is always interpreted, also when its base is compiled: a compiled class
cannot have functions of other modules as methods (they would be plain attributes),
and the weak references to a watchdog must be cleared when it is freed: a compiled
class with a weak-reference slot never clears it (mypyc#1102), so the core has none and
this class owns the slot, which CPython clears (the process-wide weak registries of
watchdogs, ``_registry``, ``transitions`` and the metrics, depend on it).
docs/performance.md ("The compiled core") says more.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from . import _adopt, _delivery, _guard, _views
from ._core import WatchdogCore
from ._delivery import Listener
from ._details import Expiry, Mode
from ._options import WatchdogOptions
from ._spec import Spec, State

__all__ = ["Listener", "Watchdog"]

K = TypeVar("K", bound=Hashable)


class Watchdog(WatchdogCore, Generic[K]):
    """Tracks live requests through the states of a :class:`~stallguard.Spec` and fails
    the ones that overstay a deadline, exactly once.

    Args:
        spec: the states and their deadlines.
        on_expire: a callable, or a sequence of callables, that enforces an expiry: it is
            called with each :class:`~stallguard.Expiry` in ``"enforce"`` mode (to fail
            the request the way its owner fails requests). It is not called in
            ``"report"`` mode. Listeners (:meth:`add_listener`) and instrumentation
            hooks (logging, OpenTelemetry; see :mod:`stallguard.instrumentation`) see
            every expiry in both modes.
        options: a :class:`~stallguard.WatchdogOptions`; the keyword arguments below
            override its fields.
        clock: returns the current time in seconds; must never go backwards. Defaults to
            :func:`time.monotonic`. Tests pass a :class:`stallguard.testing.FakeClock`.
            Every reading is validated: one that is not a finite number raises
            :class:`~stallguard.ClockError`, and one earlier than the latest reading
            counts as the latest (time only moves forward inside the watchdog).
        mode: ``"enforce"`` (default) fails overdue requests; ``"report"`` only reports
            them (each request once per deadline), for a safe rollout.
        unknown_state: ``"raise"`` (default) raises :class:`~stallguard.UnknownStateError`
            when a state the spec does not declare is observed; ``"ignore"`` drops it
            and counts it.
        memory: how many concluded keys (expired, terminal or forgotten) are remembered,
            so that a late ``observe`` for them is dropped instead of re-tracking the
            request (default 65,536). The oldest are forgotten first.
        statistics: record time in state for :meth:`statistics` and :meth:`advice`
            (default False; see :class:`~stallguard.WatchdogOptions`).
        describe: a function of a key returning span attributes (a mapping with string
            keys) for its :class:`~stallguard.Expiry`, called only when the key expires,
            outside the lock, before any hook sees the expiry: what an integration
            would otherwise :meth:`annotate` on every request, paid only for the few
            that expire. Attributes set with :meth:`annotate` win over it. If it raises
            an ``Exception`` (or returns something else than such a mapping), that is
            logged and counted like a failing hook and the expiry goes on without its
            attributes; a ``BaseException`` is handled like one raised by a hook.

    Raises:
        ConfigError: naming the argument and the bad value.

    All methods are thread-safe: state changes may come from transfer threads while one
    thread runs :meth:`check`.
    """

    def __init__(
        self,
        spec: Spec,
        *,
        on_expire: Callable[[Expiry[K]], object]
        | Iterable[Callable[[Expiry[K]], object]]
        | None = (),
        options: WatchdogOptions | None = None,
        clock: Callable[[], float] | None = None,
        mode: Mode | None = None,
        unknown_state: str | None = None,
        memory: int | None = None,
        statistics: bool | None = None,
        describe: Callable[[K], Mapping[str, Any]] | None = None,
    ) -> None:
        super().__init__(
            spec,
            on_expire=on_expire,
            options=options,
            clock=clock,
            mode=mode,
            unknown_state=unknown_state,
            memory=memory,
            statistics=statistics,
            describe=describe,
        )

    # The core's public methods, bound here too: the API reference lists this class's
    # own members. For type checkers, their signatures with the argument types the core
    # leaves to the library's own checks (typed ``Any`` there: see WatchdogCore).
    if TYPE_CHECKING:

        def observe(self, key: K, state: State, *, at: float | None = None) -> None: ...
        def heartbeat(self, key: K, *, at: float | None = None) -> bool: ...
        def forget(self, key: K, *, remember: bool = True) -> bool: ...
        def check(self, now: float | None = None) -> list[Expiry[K]]: ...
        def expired(self, key: K) -> bool: ...
        def state_of(self, key: K) -> State | None: ...

    else:
        observe = WatchdogCore.observe
        heartbeat = WatchdogCore.heartbeat
        forget = WatchdogCore.forget
        check = WatchdogCore.check
        expired = WatchdogCore.expired
        state_of = WatchdogCore.state_of

    spec = WatchdogCore.spec
    mode = WatchdogCore.mode
    options = WatchdogCore.options
    clock = WatchdogCore.clock
    next_deadline = WatchdogCore.next_deadline

    # ------------------------------------------------------------------ listeners

    add_listener = _delivery.add_listener
    listeners = WatchdogCore.listeners
    remove_listener = _delivery.remove_listener
    annotate, adopt, record_stays = _delivery.annotate, _adopt.adopt, _adopt.record_stays

    # ------------------------------------------------------------------ poll loops

    guard = _guard.guard

    # ------------------------------------------------------------------ operators

    snapshot = _views.snapshot
    statistics = _views.statistics
    advice = _views.advice

    # ------------------------------------------------------------------ internals

    # (tests)
    _remembered = _views.remembered
    _footprint = _views.footprint
    _in_time_order = _views.in_time_order
    _overdue = _views.overdue
