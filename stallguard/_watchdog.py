"""The watchdog: per-state deadline tracking at hot-loop cost.

Design (docs/watchdog.md, "How it works", says more):

* A tracked request is one record (``_Rec``): its key, its state's slot, when it entered
  the state, the last renewal of its progress window, and a generation that counts its
  state entries.
* Every deadline clock (each state's deadline, each progress window, the lifetime) is a
  **lazy FIFO**: a ``deque`` of ``(start, record, stamp)`` appended in time order. Every
  entry on one clock shares one duration, so entries fall due in the order they were
  appended and only the head can be due. Leaving a state does not touch the FIFO: it
  bumps the record's generation, which makes the old entry stale; stale entries are dropped
  when they reach the head (or by a compaction that keeps each FIFO within twice its
  live entries plus a constant). A state change is therefore two attribute writes and
  one ``deque.append``; a request that lives milliseconds against deadlines of tens of
  seconds is never visited again.
* **Time only moves forward.** Every clock reading that is appended is taken under the
  lock, where the order of the FIFOs is decided, validated (a finite number, else
  :class:`~stallguard.ClockError`), and raised to the latest reading the watchdog has
  seen (``_latest``). So each FIFO is in time order by construction (an ``at=`` is raised
  to the FIFO's tail), and a progress window only ever extends.
* A state without a state deadline has no state FIFO (nothing would ever drain it):
  its requests are found through their records, and a record that left it is freed at
  once.
* ``_next_due`` is a lower bound on the earliest due time of any FIFO head (stale or
  not). It only moves down when something is appended, and is recomputed exactly after
  an expiry pass, so ``check()`` with nothing due is one clock read and one comparison.
* No thread, task or timer exists per request; expiries are decided in ``check()``,
  where the owner of the requests can act on them. Hooks and listeners never run while
  the watchdog holds its lock. A ``BaseException`` raised by one of them interrupts the
  delivery; what is left of it is carried (``_carry``) to the next ``check()``.
* A watchdog keeps at most 29 instance attributes: CPython 3.11 keeps an instance's
  attributes in its class's shared-key table up to that many, and every attribute load
  is slower past it (tests/test_watchdog.py checks the count).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import operator
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar, cast

import attrs

from . import _registry
from ._details import CONCLUDED, Expiry, Mode, Snapshot, StateSummary, TrackedRequest
from ._errors import ClockError, ConfigError, StallguardError, UnknownStateError
from ._options import WatchdogOptions
from ._spec import Spec, State, state_label
from ._stats import Statistics, StatsRecorder
from ._validate import _show

if TYPE_CHECKING:
    from ._advice import Advice

__all__ = ["Listener", "Watchdog"]

log = logging.getLogger("stallguard")

K = TypeVar("K", bound=Hashable)
P = ParamSpec("P")
R = TypeVar("R")

_MISSING: Any = object()
_INF = math.inf
#: where ``Watchdog._latest`` starts: below every finite reading, and not -inf (so that
#: ``latest <= reading < inf``, the fast path's test, refuses -inf, NaN and +inf)
_EARLIEST = -sys.float_info.max
_EXPIRED = True  # tombstone value: the key was force-failed (enforce mode)
_CONCLUDED = False  # tombstone value: terminal state, forget(), or reported-then-ended
_DEAD = -1  # a record's generation once it is untracked: every FIFO entry for it is stale
_SLACK = 1024  # stale FIFO entries tolerated beyond twice the live ones
_by_due = operator.itemgetter(0)

# Building the Expiry is most of an expiry's cost. attrs' frozen __init__ sets each field
# through object.__setattr__ (~1.1 µs for 11 fields on CPython 3.11); _collect sets the
# slots through their descriptors instead (~0.75 µs), which builds the identical object.
# That is only valid while Expiry has exactly these slotted fields and nothing else runs
# at construction: checked here, at import.
_EXPIRY_FIELDS = (
    "key",
    "spec",
    "state",
    "entered_at",
    "elapsed",
    "deadline",
    "reason",
    "mode",
    "attributes",
    "trace_parent",
    "trace_links",
)
if (
    tuple(f.name for f in attrs.fields(Expiry)) != _EXPIRY_FIELDS
    or any(f.validator is not None or f.converter is not None for f in attrs.fields(Expiry))
    or "__slots__" not in Expiry.__dict__
    or hasattr(Expiry, "__attrs_pre_init__")
    or hasattr(Expiry, "__attrs_post_init__")
):  # pragma: no cover
    raise ImportError(
        "stallguard._watchdog._collect builds Expiry by setting its slots "
        f"{_EXPIRY_FIELDS} directly, but Expiry changed (fields now "
        f"{tuple(f.name for f in attrs.fields(Expiry))}); update _collect"
    )
_new_expiry = Expiry.__new__
(
    _set_key,
    _set_spec,
    _set_state,
    _set_entered_at,
    _set_elapsed,
    _set_deadline,
    _set_reason,
    _set_mode,
    _set_attributes,
    _set_trace_parent,
    _set_trace_links,
) = (getattr(Expiry, name).__set__ for name in _EXPIRY_FIELDS)


class _Note:
    """Telemetry attached with annotate()."""

    __slots__ = ("attributes", "links", "parent")

    def __init__(self) -> None:
        self.attributes: dict[str, Any] = {}
        self.parent: Any = None
        self.links: tuple[Any, ...] = ()


class _Rec:
    """One tracked request. ``gen`` counts its state entries (``_DEAD`` once untracked):
    a FIFO entry made in another generation is stale."""

    __slots__ = ("beat", "gen", "key", "note", "since", "slot")

    def __init__(self, key: Any, slot: _Slot, since: float) -> None:
        self.key = key
        self.slot = slot
        self.since = since
        self.gen = 0
        self.beat = since
        self.note: _Note | None = None


def _state_entry(entry: tuple[float, _Rec, int]) -> bool:
    """A state clock's entry holds while its request is in the state it was made for."""
    return entry[1].gen == entry[2]


def _stall_entry(entry: tuple[float, _Rec, int]) -> bool:
    """A progress window's entry holds until the state ends or a renewal replaces it."""
    rec = entry[1]
    return rec.gen == entry[2] and rec.beat == entry[0]


def _life_entry(entry: tuple[float, _Rec, int]) -> bool:
    """A lifetime entry holds while the request is tracked."""
    return entry[1].gen != _DEAD


class _Clock:
    """A lazy FIFO of ``(start, record, generation)``: one deadline clock."""

    __slots__ = ("limit", "q", "reason", "seconds", "valid")

    def __init__(
        self, seconds: float, reason: str, valid: Callable[[tuple[float, _Rec, int]], bool]
    ) -> None:
        self.q: deque[tuple[float, _Rec, int]] = deque()
        self.seconds = seconds
        self.reason = reason
        #: whether an entry still holds (else it is stale)
        self.valid = valid
        #: compact when the FIFO grows past this (amortised O(1) per append)
        self.limit = _SLACK

    def head(self) -> tuple[float, _Rec, int] | None:
        """The first live entry, dropping stale ones on the way."""
        q = self.q
        valid = self.valid
        while q:
            entry = q[0]
            if valid(entry):
                return entry
            q.popleft()
        return None

    def compact(self) -> None:
        self.q = deque(filter(self.valid, self.q))
        self.limit = 2 * len(self.q) + _SLACK

    def tail(self) -> float:
        q = self.q
        return q[-1][0] if q else -_INF


class _Slot:
    """Per-state bookkeeping."""

    __slots__ = (
        "deadline",
        "hist",
        "label",
        "parked",
        "seconds",
        "stall",
        "stalls",
        "state",
        "terminal",
        "timer",
    )

    def __init__(self, state: State, deadline: Any) -> None:
        self.state = state
        self.label = state_label(state)
        self.terminal = deadline is None
        self.deadline = deadline
        self.seconds: float | None = None if deadline is None else deadline.seconds
        self.stall: float | None = None if deadline is None else deadline.stall
        #: the state deadline's FIFO (None: terminal, or no state deadline)
        self.timer: _Clock | None = (
            None if self.seconds is None else _Clock(self.seconds, "state", _state_entry)
        )
        self.stalls: _Clock | None = (
            None if self.stall is None else _Clock(self.stall, "stall", _stall_entry)
        )
        #: report mode: records whose state deadline was reported -> state start
        self.parked: dict[_Rec, float] = {}
        #: the state's time-in-state histogram (None: statistics off, or terminal)
        self.hist: Any = None


@attrs.frozen(eq=False)
class Listener:
    """A handle returned by :meth:`Watchdog.add_listener`; :meth:`remove` unhooks it."""

    watchdog: Watchdog[Any] = attrs.field(repr=False)
    on_expire: Callable[[Expiry[Any]], object] | None = None
    on_leave: Callable[[str, float], object] | None = None
    on_earlier_deadline: Callable[[], object] | None = None

    def remove(self) -> bool:
        """Stop calling this listener. Returns False if it was already removed."""
        return self.watchdog.remove_listener(self)


#: the owner mark of an enforcement hook (the constructor's ``on_expire``) in a plan:
#: the only hooks whose :data:`~stallguard.CONCLUDED` withdraws an expiry
_ENFORCE: Any = object()


class _Plan:
    """Who is handed an expiry (or a leave notification), in order: ``hooks``, and each
    one's owner: ``_ENFORCE`` for an enforcement hook, the :class:`Listener` it belongs
    to, or None (``describe``, the instrumentation hooks). Positions, not identities,
    say which hooks enforce: the same callable may also listen, and withdraws nothing
    there. A delivery that a ``BaseException`` interrupts goes on, at the next check,
    with the rest of its plan (:meth:`after`), less the listeners removed meanwhile
    (:meth:`without`)."""

    __slots__ = ("active", "hooks", "listeners", "owners")

    def __init__(
        self,
        hooks: tuple[Callable[..., object], ...],
        owners: tuple[object, ...],
        listeners: object = None,
        active: object = None,
    ) -> None:
        self.hooks = hooks
        self.owners = owners
        #: what a cached plan was made from: it holds while both are still current
        self.listeners = listeners
        self.active = active

    def after(self, done: int) -> _Plan:
        """The plan past its hook number *done* (-1: the whole plan)."""
        return _Plan(self.hooks[done + 1 :], self.owners[done + 1 :])

    def without(self, listeners: tuple[Listener, ...]) -> _Plan:
        """The plan less the hooks of every listener that is not in *listeners*."""
        owners = self.owners
        keep = [n for n, o in enumerate(owners) if not isinstance(o, Listener) or o in listeners]
        if len(keep) == len(owners):
            return self
        return _Plan(tuple(self.hooks[n] for n in keep), tuple(owners[n] for n in keep))


_NOBODY = _Plan((), ())
_NONE: Any = ()  # an empty sequence that costs no allocation


def _describe_hook(describe: Callable[[Any], Mapping[str, Any]]) -> Callable[[Expiry[Any]], None]:
    """The first hook of every expiry of a watchdog with ``describe=``: adds what
    *describe* says of the key to the expiry's attributes (a fresh dict of that expiry's
    own, not yet seen by any other hook), without overriding annotated ones."""

    def describe_key(expiry: Expiry[Any]) -> None:
        described = describe(expiry.key)
        if not isinstance(described, Mapping):
            raise TypeError(f"describe() must return a mapping, got {described!r}")
        items = list(described.items())  # all of it, or (if that raises) none of it
        for name, _ in items:
            if not isinstance(name, str):
                raise TypeError(f"attribute names must be strings, got {name!r}")
        attributes = cast("dict[str, Any]", expiry.attributes)  # the watchdog's own dict
        for name, value in items:
            attributes.setdefault(name, value)

    describe_key.__qualname__ = f"describe ({getattr(describe, '__qualname__', describe)!s})"
    return describe_key


def _hooks(on_expire: object) -> tuple[Callable[[Expiry[Any]], object], ...]:
    if on_expire is None:
        return ()
    if callable(on_expire):
        return (on_expire,)
    if isinstance(on_expire, Iterable) and not isinstance(on_expire, (str, bytes)):
        hooks = tuple(on_expire)
        for hook in hooks:
            if not callable(hook):
                raise ConfigError(f"on_expire must hold callables, got {hook!r}")
        return hooks
    raise ConfigError(f"on_expire must be a callable or a sequence of callables, got {on_expire!r}")


def _check_time(name: str, value: Any) -> float:
    """*value* as a time on the watchdog's clock: a finite real number."""
    if value.__class__ is not float and (
        value.__class__ is bool or not isinstance(value, (int, float))
    ):
        raise TypeError(
            f"{name} must be a time in seconds on the watchdog's clock, got {value!r} "
            f"({type(value).__name__})"
        )
    try:
        if math.isfinite(value):
            return float(value)
    except OverflowError:  # an int too large for a float
        pass
    raise ValueError(f"{name} must be a finite time on the watchdog's clock, got {value!r}")


def _check_at(at: Any, now: float) -> float:
    """*at* as a start time: a finite number not later than *now*."""
    if at.__class__ is float and -_INF < at < _INF and at <= now:
        return at  # the common case, first (observe and heartbeat call this each time)
    at = _check_time("at", at)
    if not at <= now:
        raise ValueError(f"at={at!r} is later than the watchdog clock's now ({now!r})")
    return at  # type: ignore[no-any-return]


def _unhashable(key: object) -> TypeError:
    return TypeError(f"a request key must be hashable, got {key!r} ({type(key).__name__})")


class Watchdog(Generic[K]):
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
        if not isinstance(spec, Spec):
            raise ConfigError(f"spec must be a stallguard.Spec, got {spec!r}")
        if options is None:
            options = WatchdogOptions()
        elif not isinstance(options, WatchdogOptions):
            raise ConfigError(f"options must be a stallguard.WatchdogOptions, got {options!r}")
        given = {
            name: value
            for name, value in (
                ("clock", clock),
                ("mode", mode),
                ("unknown_state", unknown_state),
                ("memory", memory),
                ("statistics", statistics),
            )
            if value is not None
        }
        if given:
            options = options.evolve(**given)
        self._spec = spec
        self._options = options
        self._mode: Mode = options.mode
        self._clock = options.clock
        self._enforce_hooks = _hooks(on_expire)
        if describe is not None and not callable(describe):
            raise ConfigError(f"describe must be a callable, got {describe!r}")
        #: runs first for every expiry (see _describe_hook)
        self._describe_hooks: tuple[Callable[[Expiry[K]], object], ...] = (
            () if describe is None else (_describe_hook(describe),)
        )
        self._memory = options.memory

        self._slots: dict[State, _Slot] = {}
        for state, deadline in spec.deadlines.items():
            self._slots[state] = _Slot(state, deadline)
        for state in spec.terminal:
            self._slots[state] = _Slot(state, None)
        live = [s for s in self._slots.values() if not s.terminal]
        self._live: tuple[_Slot, ...] = tuple(live)
        self._life: _Clock | None = (
            None if spec.lifetime is None else _Clock(spec.lifetime, "lifetime", _life_entry)
        )
        # The clocks that can fire, in tie-break order: state deadlines, progress
        # windows, lifetime (the most specific reason first).
        clocks = [s.timer for s in live if s.timer is not None]
        clocks += [s.stalls for s in live if s.stalls is not None]
        if self._life is not None:
            clocks.append(self._life)
        self._clocks: tuple[_Clock, ...] = tuple(c for c in clocks if c is not None)

        self._where: dict[K, _Rec] = {}
        self._gone: OrderedDict[K, bool] = OrderedDict()
        self._next_due = _INF
        #: the latest clock reading taken under the lock: a later one is never earlier
        self._latest = _EARLIEST
        self._lock = threading.Lock()
        self._expired = 0
        self._hook_errors = 0
        self._late = 0
        self._unknown = 0
        self._runner_errors = 0
        self._withdrawn = 0
        #: time-in-state statistics (docs/advice.md); None when switched off
        self._stats: StatsRecorder | None = StatsRecorder(spec) if options.statistics else None
        if self._stats is not None:
            for slot in live:
                slot.hist = self._stats.hist(slot.state)
        # what an interrupted delivery had not finished, for the next check(): expiries
        # with the rest of their plan (those fully delivered with none: each is still
        # returned), and leave notifications ((label, seconds)) with the rest of theirs
        self._carry: list[tuple[Expiry[K] | tuple[str, float], _Plan]] = []
        self._listeners: tuple[Listener, ...] = ()
        #: who sees an expiry (cached until the listeners or instrumentation hooks change)
        self._plan = _Plan((), ())
        self._leave_plan = _Plan((), ())
        self._leave_listeners: tuple[Callable[[str, float], object], ...] = ()
        self._wake_listeners: tuple[Callable[[], object], ...] = ()
        _registry.register_watchdog(self)

    # ------------------------------------------------------------------ read-only

    @property
    def spec(self) -> Spec:
        """The :class:`~stallguard.Spec` (read-only)."""
        return self._spec

    @property
    def mode(self) -> Mode:
        """``"enforce"`` or ``"report"`` (read-only: make a new watchdog to switch)."""
        return self._mode

    @property
    def options(self) -> WatchdogOptions:
        """The validated :class:`~stallguard.WatchdogOptions` (read-only)."""
        return self._options

    @property
    def clock(self) -> Callable[[], float]:
        """The clock the watchdog reads."""
        return self._clock

    # ------------------------------------------------------------------ listeners

    def add_listener(
        self,
        *,
        on_expire: Callable[[Expiry[K]], object] | None = None,
        on_leave: Callable[[str, float], object] | None = None,
        on_earlier_deadline: Callable[[], object] | None = None,
    ) -> Listener:
        """Listen to this watchdog; any number of listeners may listen at once.

        Args:
            on_expire: called with every :class:`~stallguard.Expiry`, in both modes,
                after the watchdog's own ``on_expire`` (enforce mode) and before the
                process-wide instrumentation hooks.
            on_leave: called as ``on_leave(state_label, seconds_in_state)`` when a
                tracked request leaves a state (state change, terminal state, forget,
                enforced expiry); for duration histograms.
            on_earlier_deadline: called without arguments when a deadline earlier than
                any pending one appears (possibly on another thread); runners use it to
                wake up early.

        None of them is called while the watchdog holds its lock, so they may call back
        into it. An exception they raise is logged and counted in
        :attr:`~stallguard.Snapshot.hook_errors`, never propagated.

        Returns:
            A :class:`Listener` handle; ``handle.remove()`` stops it.

        Raises:
            ConfigError: if an argument is not callable, or none is given.
        """
        for name, fn in (
            ("on_expire", on_expire),
            ("on_leave", on_leave),
            ("on_earlier_deadline", on_earlier_deadline),
        ):
            if fn is not None and not callable(fn):
                raise ConfigError(f"add_listener({name}=...) must be callable, got {fn!r}")
        if on_expire is None and on_leave is None and on_earlier_deadline is None:
            raise ConfigError(
                "add_listener() needs at least one of on_expire, on_leave, on_earlier_deadline"
            )
        listener = Listener(self, on_expire, on_leave, on_earlier_deadline)
        with self._lock:
            self._set_listeners((*self._listeners, listener))
        return listener

    @property
    def listeners(self) -> tuple[Listener, ...]:
        """The listeners added with :meth:`add_listener` and not removed yet."""
        return self._listeners

    def remove_listener(self, listener: Listener) -> bool:
        """Stop calling *listener*. Returns False if it was not listening."""
        with self._lock:
            kept = tuple(x for x in self._listeners if x is not listener)
            if len(kept) == len(self._listeners):
                return False
            self._set_listeners(kept)
            return True

    def _set_listeners(self, listeners: tuple[Listener, ...]) -> None:
        leaving = [(x, x.on_leave) for x in listeners if x.on_leave is not None]
        self._leave_plan = _Plan(tuple(fn for _, fn in leaving), tuple(x for x, _ in leaving))
        self._leave_listeners = self._leave_plan.hooks
        self._wake_listeners = tuple(
            x.on_earlier_deadline for x in listeners if x.on_earlier_deadline
        )
        self._listeners = listeners  # last: the expiry plan is remade when it changes

    def _expire_plan(self) -> _Plan:
        """Who sees this check's expiries: ``describe``, the enforcement hooks (enforce
        mode), the listeners, the instrumentation hooks (cached)."""
        active = _registry.active_hooks()
        plan = self._plan
        listeners = self._listeners
        if plan.listeners is listeners and plan.active is active:
            return plan
        handles = tuple(x for x in listeners if x.on_expire is not None)
        enforce = self._enforce_hooks if self._mode == "enforce" else ()
        describe = self._describe_hooks
        plan = self._plan = _Plan(
            describe + enforce + tuple(x.on_expire for x in handles) + active,
            (None,) * len(describe) + (_ENFORCE,) * len(enforce) + handles + (None,) * len(active),
            listeners,
            active,
        )
        return plan

    # ------------------------------------------------------------------ state changes

    def observe(self, key: K, state: State, *, at: float | None = None) -> None:
        """Record that request *key* is in *state* now (or since *at*).

        The first sight of a key starts tracking it. A different state restarts the
        state clock; observing the same state again does not (Erlang ``gen_statem``'s
        ``state_timeout`` rule). A terminal state untracks the key and remembers it as
        concluded, **also when it is the first sight of the key**: a stale live state
        arriving after a request finished never re-tracks it. An observe for a key that
        has concluded (expired, terminal, or forgotten, and still within ``memory``) is
        dropped and counted as a late event: it never re-arms the request.

        Args:
            at: when the request entered *state*, on the watchdog's clock; default: now.
                For changes captured (with a clock reading) where they happen and
                applied later, e.g. by the loop that runs :meth:`check`. A finite
                number, never later than now. To keep every deadline clock in time
                order, an *at* earlier than the start of the latest entry on that clock
                is raised to it, and a state never starts before the one it ends: a
                deadline may start a little later than *at*, never earlier.

        Raises:
            UnknownStateError: if *state* is not declared in the spec (or is not
                hashable) and ``unknown_state="raise"``.
            ValueError: if *at* is later than the clock's now, NaN or infinite (also
                when *state* is the key's current state, which changes nothing).
            TypeError: if *at* is not a number, or *key* is not hashable.
            ClockError: if the clock returns something that is not a finite time.
        """
        try:
            slot = self._slots.get(state)
        except TypeError:  # unhashable
            slot = None
        try:
            rec = self._where.get(key)
        except TypeError:
            raise _unhashable(key) from None
        if slot is None:
            self._unknown_state(key, state)
            return
        if rec is not None and rec.slot is slot:  # same state again: nothing to do
            if at is not None:
                self._same_state_at(at)
            return
        left: tuple[str, float] | None = None
        woke = False
        with self._lock:
            # Read under the lock, where the FIFOs' order is decided (see _read).
            now = self._clock()
            if now.__class__ is float and self._latest <= now < _INF:
                self._latest = now
            else:
                now = self._read(now)
            if at is not None:
                now = _check_at(at, now)
            if rec is None or rec.gen == _DEAD:
                # (a record still alive under the lock is still the key's: only untrack
                # removes one, and it marks it dead first)
                rec = self._where.get(key)
            if rec is None:
                if slot.terminal:
                    how = self._gone.get(key)
                    if how is None:
                        self._bury(key, _CONCLUDED)
                    elif how is _EXPIRED:  # the request was failed: its end comes late
                        self._late += 1
                    return
                if key in self._gone:
                    self._late += 1
                    return
                rec = self._where[key] = _Rec(key, slot, now)
                life = self._life
                if life is not None:
                    born = now
                    if at is not None and life.q and life.q[-1][0] > now:
                        born = life.q[-1][0]
                    life.q.append((born, rec, 0))
                    if len(life.q) > life.limit:
                        life.compact()
                    due = born + life.seconds
                    if due < self._next_due:
                        self._next_due = due
                        woke = True
            else:
                old = rec.slot
                if old is slot:
                    return
                if at is not None and rec.since > now:
                    now = rec.since  # a state never starts before the one it ends
                if old.parked:
                    old.parked.pop(rec, None)
                if self._leave_listeners:
                    left = (old.label, now - rec.since)
                hist = old.hist
                if hist is not None:  # time in state (statistics=True)
                    hist.add(now - rec.since)
                if slot.terminal:
                    stats = self._stats
                    if stats is not None and stats._reported:  # how a reported one ended
                        stats.ended(key, slot.state)
                    self._untrack(rec, _CONCLUDED)
                    rec = None
                else:
                    rec.slot = slot
            if rec is not None:
                gen = rec.gen + 1
                rec.gen = gen
                start = now
                timer = slot.timer
                if timer is not None:
                    q = timer.q
                    if at is not None and q and q[-1][0] > now:
                        start = q[-1][0]
                    q.append((start, rec, gen))
                    if len(q) > timer.limit:
                        timer.compact()
                    due = start + timer.seconds
                    if due < self._next_due:
                        self._next_due = due
                        woke = True
                rec.since = start
                stalls = slot.stalls
                if stalls is not None:
                    if at is not None:
                        start = max(now, stalls.tail())
                    rec.beat = start
                    stalls.q.append((start, rec, gen))
                    if len(stalls.q) > stalls.limit:
                        stalls.compact()
                    due = start + stalls.seconds
                    if due < self._next_due:
                        self._next_due = due
                        woke = True
        try:
            if left is not None:
                self._notify_leave(left)
        finally:  # (a BaseException from a leave listener wakes the runners all the same)
            if woke and self._wake_listeners:
                self._notify_wake()

    def heartbeat(self, key: K, *, at: float | None = None) -> bool:
        """Record progress for *key*: renews the progress (``stall``) window of its
        current state. Lifetime and state deadlines are not renewed.

        Args:
            at: when the progress was made, on the watchdog's clock; default: now. As
                for :meth:`observe`: finite, never later than now, and raised to the
                latest renewal's time if earlier (a window never starts before a later
                one).

        Returns:
            True if *key* is tracked, False if it is not (a late heartbeat is harmless).

        Raises:
            ValueError: if *at* is later than the clock's now, NaN or infinite.
            TypeError: if *at* is not a number, or *key* is not hashable.
            ClockError: if the clock returns something that is not a finite time.
        """
        woke = False
        with self._lock:
            now = self._clock()  # under the lock, as in observe()
            if now.__class__ is float and self._latest <= now < _INF:
                self._latest = now
            else:
                now = self._read(now)
            if at is not None:
                now = _check_at(at, now)
            try:
                rec = self._where.get(key)
            except TypeError:
                raise _unhashable(key) from None
            if rec is None:
                return False
            stalls = rec.slot.stalls
            if stalls is not None:
                if at is not None:
                    now = max(now, stalls.tail())  # the FIFO stays in time order
                if now <= rec.beat:  # a window only ever extends (one entry per start)
                    return True
                rec.beat = now
                q = stalls.q
                q.append((now, rec, rec.gen))
                if len(q) > stalls.limit:
                    stalls.compact()
                due = now + stalls.seconds
                if due < self._next_due:
                    self._next_due = due
                    woke = True
        if woke and self._wake_listeners:
            self._notify_wake()
        return True

    def forget(self, key: K, *, remember: bool = True) -> bool:
        """Stop tracking *key* (the abort path). Idempotent.

        Args:
            remember: keep the key among the concluded ones, so that a late ``observe``
                does not re-track it. Pass False to allow the key to be reused at once.

        Returns:
            True if *key* was tracked.

        Raises:
            TypeError: if *key* is not hashable.
            ClockError: if the clock returns something that is not a finite time.
        """
        left: tuple[str, float] | None = None
        with self._lock:
            try:
                rec = self._where.get(key)
            except TypeError:
                raise _unhashable(key) from None
            if rec is None:
                if not remember:
                    self._gone.pop(key, None)
                elif key not in self._gone:
                    self._bury(key, _CONCLUDED)
                return False
            now = self._clock()  # (read before anything changes: it may be refused)
            if now.__class__ is float and self._latest <= now < _INF:
                self._latest = now
            else:
                now = self._read(now)
            slot = rec.slot
            if slot.parked:
                slot.parked.pop(rec, None)
            seconds = now - rec.since
            if self._leave_listeners:
                left = (slot.label, seconds)
            stats = self._stats
            if stats is not None:
                stats.left(slot.state, seconds)
                stats.ended(key, None)
            # (not remembered: never buried, so no older key's memory is pushed out)
            self._untrack(rec, _CONCLUDED if remember else None)
        if left is not None:
            self._notify_leave(left)
        return True

    def annotate(
        self,
        key: K,
        *,
        attributes: Mapping[str, Any] | None = None,
        trace_parent: Any = None,
        trace_links: Iterable[Any] | None = None,
    ) -> bool:
        """Attach telemetry to a tracked request, handed to hooks in its
        :class:`~stallguard.Expiry`: span *attributes*, a parent span context
        (*trace_parent*: an OpenTelemetry ``Context`` or ``SpanContext``) and span
        contexts to link. Attributes merge with earlier ones.

        Returns:
            True if *key* is tracked; annotations on untracked keys are dropped (they
            would otherwise leak).

        Raises:
            TypeError: if *attributes* is not a mapping with string keys, *trace_links*
                is not iterable, or *key* is not hashable.
        """
        if attributes is not None:
            if not isinstance(attributes, Mapping):
                raise TypeError(f"attributes must be a mapping, got {attributes!r}")
            for name in attributes:
                if not isinstance(name, str):
                    raise TypeError(f"attribute names must be strings, got {name!r}")
        links: tuple[Any, ...] | None = None
        if trace_links is not None:
            if isinstance(trace_links, (str, bytes)) or not isinstance(trace_links, Iterable):
                raise TypeError(f"trace_links must be an iterable, got {trace_links!r}")
            links = tuple(trace_links)
        with self._lock:
            try:
                rec = self._where.get(key)
            except TypeError:
                raise _unhashable(key) from None
            if rec is None:
                return False
            note = rec.note
            if note is None:
                note = rec.note = _Note()
            if attributes:
                note.attributes.update(attributes)
            if trace_parent is not None:
                note.parent = trace_parent
            if links is not None:
                note.links = links
            return True

    # ------------------------------------------------------------------ deadlines

    def check(self, now: float | None = None) -> list[Expiry[K]]:
        """Expire every request that is overdue at *now* (default: the clock's now).

        In ``"enforce"`` mode each overdue request is untracked, remembered as expired,
        and handed to ``on_expire``, to the listeners and to the instrumentation hooks,
        exactly once. In ``"report"`` mode it stays tracked and is handed to the
        listeners and the instrumentation hooks once per deadline. A hook that raises an
        ``Exception`` is logged and counted; it never stops the check or loses another
        expiry. A ``BaseException`` (``KeyboardInterrupt``, ``SystemExit``) raised by
        a hook, a listener or ``describe`` propagates at once, and what it interrupted
        (the expiries with the hooks they had not reached, the leave notifications not
        made) is delivered by the next ``check()``, which also returns every expiry of
        the interrupted one: none is lost.

        Cheap when nothing is due: one clock read and one comparison.

        Returns:
            The expiries, earliest deadline first (any carried over from an interrupted
            check come first).

        Raises:
            ValueError: if *now* is NaN or infinite.
            TypeError: if *now* is not a number.
            ClockError: if the clock returns something that is not a finite time (and
                something may be due: with nothing due, the reading is only compared).
        """
        if now is None:
            now = self._clock()
            try:
                if now < self._next_due:  # NaN is never less: it goes on to be refused
                    return []
            except TypeError:  # not even comparable: refused by _expire
                pass
            return self._expire(now, True)
        now = _check_time("now", now)
        if now < self._next_due:
            return []
        return self._expire(now, False)

    def _expire(self, now: Any, reading: bool) -> list[Expiry[K]]:
        """check()'s work once something may be due (kept out of check() so that the
        idle path stays one comparison). *reading*: *now* is the clock's, unchecked."""
        with self._lock:
            if reading:
                if now.__class__ is float and self._latest <= now < _INF:
                    self._latest = now
                else:
                    now = self._read(now)
            carry = self._carry
            if carry:
                self._carry = []
            expiries, left = self._collect(now)
        carried: list[tuple[Expiry[K], _Plan]] = _NONE
        carried_left: list[tuple[tuple[str, float], _Plan]] = _NONE
        if carry:  # (rarely): expiries, and leave notifications ((label, seconds) tuples)
            carried = [x for x in carry if x[0].__class__ is not tuple]  # type: ignore[misc]
            carried_left = [x for x in carry if x[0].__class__ is tuple]  # type: ignore[misc]
        returned = expiries
        work: list[tuple[Expiry[K], _Plan]] | None = None
        if carried:
            listeners = self._listeners
            work = [(e, plan.without(listeners)) for e, plan in carried]
            returned = [e for e, _ in carried]
            returned += expiries
        if expiries:
            plan = self._expire_plan()
            if plan.hooks:
                if work is None:
                    work = [(e, plan) for e in expiries]
                else:
                    work += [(e, plan) for e in expiries]
            elif work is not None:
                work += [(e, _NOBODY) for e in expiries]
        leaves: list[tuple[tuple[str, float], _Plan]] | None = None
        if left or carried_left:
            listeners = self._listeners
            leaves = [(x, plan.without(listeners)) for x, plan in carried_left]
            plan = self._leave_plan
            leaves += [(x, plan) for x in left]
        if work is None and leaves is None:
            return returned
        withdrawn = self._deliver(work or [], leaves or [], returned)
        if withdrawn:
            return [e for e in returned if id(e) not in withdrawn]
        return returned

    def next_deadline(self) -> float | None:
        """The earliest time (on the watchdog's clock) at which a tracked request
        becomes overdue, or None if no deadline is pending."""
        with self._lock:
            due = self._exact_due()
            self._next_due = -_INF if self._carry else due
        return None if due == _INF else due

    def expired(self, key: K) -> bool:
        """True if *key* was force-failed by this watchdog (and is still remembered)."""
        return self._gone.get(key) is _EXPIRED

    def state_of(self, key: K) -> State | None:
        """The state *key* is tracked in, or None if it is not tracked."""
        rec = self._where.get(key)
        return None if rec is None else rec.slot.state

    def __len__(self) -> int:
        """How many requests are tracked (every request in a non-terminal state)."""
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __repr__(self) -> str:
        return (
            f"<stallguard.Watchdog spec={self._spec.name!r} mode={self._mode!r} "
            f"tracked={len(self._where)}>"
        )

    # ------------------------------------------------------------------ poll loops

    def guard(
        self,
        *,
        key: Callable[..., K],
        failed: Any,
        state: Callable[[Any], State] | Mapping[Any, State] | None = None,
        check: bool = True,
    ) -> Callable[[Callable[P, R]], Callable[P, R]]:
        """Decorate a ``poll()``-style function or method that returns a state.

        Each call observes the returned state for ``key(*args, **kwargs)`` (for a method,
        the instance comes first); with *check* it then runs :meth:`check` (one
        comparison when nothing is due). Once the key has been force-failed, the wrapper
        returns *failed* instead of whatever the poll returned, every time it is called
        (while the key is remembered). Terminal results untrack the key.

        Args:
            key: maps the call's arguments to the request key.
            failed: what to return for a force-failed request (SGLang: ``KVPoll.Failed``).
            state: maps the returned value to a spec state: a mapping or a callable
                (SGLang's ``KVPoll`` returns plain ints). Default: the value itself.
            check: run the deadline check on every call.

        The wrapped poll raises :class:`~stallguard.UnknownStateError` for a value that
        maps to no declared state (also an unhashable one).

        Example::

            @watchdog.guard(key=lambda self: self.room, failed=KVPoll.Failed,
                            state={0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput",
                                   3: "Transferring", 4: "Success"})
            def poll(self) -> int: ...
        """
        if not callable(key):
            raise ConfigError(f"guard(key=...) must be a callable, got {key!r}")
        if isinstance(state, Mapping):
            mapping = dict(state)
            for value in mapping.values():
                try:
                    known = value in self._slots
                except TypeError:
                    known = False
                if not known:
                    raise ConfigError(
                        f"guard(state=...) maps to {value!r}, which spec "
                        f"{self._spec.name!r} does not declare"
                    )
            to_state: Callable[[Any], State] | None = mapping.__getitem__
        elif state is None or callable(state):
            to_state = state
        else:
            raise ConfigError(f"guard(state=...) must be a mapping or a callable, got {state!r}")
        where = self._where
        slots = self._slots
        spec_name = self._spec.name
        known_values = (
            tuple(f"{v!r} -> {state_label(st)}" for v, st in mapping.items())
            if isinstance(state, Mapping)
            else tuple(s.label for s in slots.values())
        )
        gone = self._gone
        observe = self.observe
        expire = self._expire
        clock = self._clock

        def decorate(fn: Callable[P, R]) -> Callable[P, R]:
            @functools.wraps(fn)
            def guarded(arg: Any = _MISSING, /, *args: Any, **kwargs: Any) -> Any:
                # A poll is nearly always called with one argument (poll(self)); calling
                # fn and key with it directly, not through (*args, **kwargs), saves
                # ~0.15 µs per call (CPython 3.11).
                if arg is _MISSING or args or kwargs:
                    if arg is not _MISSING:
                        args = (arg, *args)
                    result = fn(*args, **kwargs)
                    k = key(*args, **kwargs)
                else:
                    result = fn(arg)  # type: ignore[call-arg]
                    k = key(arg)
                s: Any
                if to_state is None:
                    s = result
                else:
                    try:
                        s = to_state(result)
                    except (KeyError, TypeError) as exc:  # unmapped, or unhashable
                        raise UnknownStateError(spec_name, k, result, known_values) from exc
                try:
                    slot = slots.get(s)
                except TypeError:
                    raise UnknownStateError(spec_name, k, result, known_values) from None
                try:
                    rec = where.get(k)
                except TypeError:
                    raise _unhashable(k) from None
                if rec is not None and rec.slot is slot:
                    # tracked in this state already: not failed (unless this check does)
                    if not check:
                        return result
                    now = clock()
                    try:
                        if now < self._next_due:
                            return result
                    except TypeError:  # a bad reading: refused by _expire, as in check()
                        pass
                    expire(now, True)
                else:
                    observe(k, s)
                    if check:
                        now = clock()
                        try:
                            due = not now < self._next_due
                        except TypeError:
                            due = True
                        if due:
                            expire(now, True)
                if gone.get(k) is _EXPIRED:
                    return failed
                return result

            return cast("Callable[P, R]", guarded)

        return decorate

    # ------------------------------------------------------------------ operators

    def snapshot(self, *, requests: bool = True, now: float | None = None) -> Snapshot[K]:
        """A consistent view: per-state counts and oldest age, and (with *requests*)
        every tracked request with its state and time in state. O(tracked).

        Raises:
            ClockError: if *now* is None and the clock returns something that is not a
                finite time.
        """
        if now is not None:
            now = _check_time("now", now)
        with self._lock:
            if now is None:
                now = self._read(self._clock())
            counts: dict[_Slot, int] = dict.fromkeys(self._live, 0)
            for rec in self._where.values():
                counts[rec.slot] += 1
            # a state without a state deadline has no FIFO: its oldest from the records
            free = {s: _INF for s in self._live if s.timer is None and counts[s]}
            if free:
                for rec in self._where.values():
                    since = rec.since
                    if rec.slot in free and since < free[rec.slot]:
                        free[rec.slot] = since
            states: dict[str, StateSummary] = {}
            for slot in self._live:
                oldest = free.get(slot) if slot.timer is None else self._oldest(slot)
                states[slot.label] = StateSummary(
                    state=slot.state,
                    deadline=slot.deadline,
                    count=counts[slot],
                    oldest_age=None if oldest is None else now - oldest,
                )
            tracked: list[TrackedRequest[K]] = []
            if requests:
                for key, rec in self._where.items():
                    seconds = rec.slot.seconds
                    tracked.append(
                        TrackedRequest(
                            key=key,
                            state=rec.slot.state,
                            entered_at=rec.since,
                            age=now - rec.since,
                            remaining=None if seconds is None else rec.since + seconds - now,
                        )
                    )
                tracked.sort(key=lambda r: r.entered_at)
            return Snapshot(
                spec=self._spec.name,
                mode=self._mode,
                at=now,
                states=states,
                requests=tuple(tracked),
                tracked=len(self._where),
                expired=self._expired,
                hook_errors=self._hook_errors,
                late_events=self._late,
                runner_errors=self._runner_errors,
                withdrawn=self._withdrawn,
            )

    def statistics(self) -> Statistics:
        """A frozen, consistent copy of the time-in-state statistics: per state, the
        seconds spent there by every request that left it (however short its stay), and
        the requests its deadline fired (or, in report mode, would have fired) on. See
        docs/advice.md.

        Raises:
            StallguardError: if the watchdog was made with ``statistics=False``.
        """
        with self._lock:
            if self._stats is None:
                raise StallguardError(
                    f"watchdog {self._spec.name!r} records no statistics (statistics=False)"
                )
            return self._stats.freeze(self._mode)

    def advice(self, **kwargs: Any) -> Advice:
        """Suggested deadlines from :meth:`statistics`, flagging tracked requests older
        than a suggestion: :func:`stallguard.advise` with this watchdog's snapshot;
        *kwargs* are :func:`~stallguard.advise`'s."""
        from ._advice import advise  # the advice rule is not needed to watch requests

        return advise(self.statistics(), snapshot=self.snapshot(requests=True), **kwargs)

    # ------------------------------------------------------------------ internals

    def _remembered(self) -> int:
        """How many concluded keys are remembered (for tests of the memory bound)."""
        return len(self._gone)

    def _footprint(self) -> dict[str, int]:
        """Sizes of every internal structure (tests: nothing is left behind)."""
        with self._lock:
            sizes = {"tracked": len(self._where), "remembered": len(self._gone)}
            for slot in self._live:
                for clock in (slot.timer, slot.stalls):
                    if clock is not None:
                        sizes[f"{slot.label}.{clock.reason}"] = sum(map(clock.valid, clock.q))
                sizes[f"{slot.label}.parked"] = len(slot.parked)
            if self._life is not None:
                sizes["lifetime"] = sum(map(self._life.valid, self._life.q))
            sizes["carried"] = len(self._carry)
            #: every FIFO entry, stale ones included
            sizes["entries"] = sum(len(c.q) for c in self._clocks)
            return sizes

    def _in_time_order(self) -> bool:
        """Whether every FIFO is in time order, stale entries included (tests: "only the
        head can be due" rests on it)."""
        with self._lock:
            for clock in self._clocks:
                starts = (entry[0] for entry in clock.q)
                if any(a > b for a, b in itertools.pairwise(starts)):
                    return False
            return True

    def _overdue(self, now: float) -> list[tuple[Any, str]]:
        """Every (key, reason) with a live FIFO entry due at *now*, wherever it is in its
        FIFO (tests: after a check at *now*, there is none)."""
        with self._lock:
            return [
                (entry[1].key, clock.reason)
                for clock in self._clocks
                for entry in clock.q
                if clock.valid(entry) and entry[0] + clock.seconds <= now
            ]

    def _read(self, reading: Any) -> float:
        """The clock's *reading* as the watchdog's now (lock held): a finite number
        (else :class:`~stallguard.ClockError`, before anything changed), and never
        earlier than the latest reading: time only moves forward, so appending it keeps
        every FIFO in time order. (The hot paths inline the common case: a float, not
        earlier than the latest, finite.)"""
        t = reading
        if t.__class__ is not float:
            if t.__class__ is bool or not isinstance(t, (int, float)):
                raise ClockError(
                    self._spec.name, self._clock, reading, f"{_show(t)} ({type(t).__name__})"
                )
            try:
                t = float(t)
            except OverflowError:
                raise ClockError(
                    self._spec.name,
                    self._clock,
                    reading,
                    f"{_show(reading)}, which is too large for a float",
                ) from None
        if not -_INF < t < _INF:
            raise ClockError(
                self._spec.name, self._clock, reading, f"{t!r} ({type(reading).__name__})"
            )
        latest = self._latest
        if t < latest:  # the clock stepped back: time stands still until it catches up
            return latest
        self._latest = t
        return t

    def _same_state_at(self, at: Any) -> None:
        """Refuse a bad *at* in an observe that changes nothing, as any other *at*."""
        if at.__class__ is float and -_INF < at <= self._latest:
            return  # finite, and not later than a reading already seen
        with self._lock:
            now = self._read(self._clock())
        _check_at(at, now)

    @staticmethod
    def _oldest(slot: _Slot) -> float | None:
        head = slot.timer.head()  # type: ignore[union-attr]
        oldest = None if head is None else head[0]
        if slot.parked:
            parked = min(slot.parked.values())
            oldest = parked if oldest is None else min(oldest, parked)
        return oldest

    def _unknown_state(self, key: K, state: object) -> None:
        if self._options.unknown_state == "raise":
            raise UnknownStateError(
                self._spec.name, key, state, tuple(s.label for s in self._slots.values())
            )
        with self._lock:
            self._unknown += 1

    def _runner_failed(self) -> None:
        """Count a runner loop that an error ended (called by the runner)."""
        with self._lock:
            self._runner_errors += 1

    def _untrack(self, rec: _Rec, how: bool | None) -> None:
        """Drop every trace of *rec* but its key's tombstone (*how*; None: none) (lock
        held). Its FIFO entries go stale."""
        rec.gen = _DEAD
        rec.note = None
        del self._where[rec.key]
        if how is not None:
            self._bury(rec.key, how)

    def _bury(self, key: K, how: bool) -> None:
        gone = self._gone
        gone[key] = how
        if len(gone) > self._memory:
            gone.popitem(last=False)

    def _exact_due(self) -> float:
        due = _INF
        for clock in self._clocks:
            head = clock.head()
            if head is not None:
                at = head[0] + clock.seconds
                if at < due:
                    due = at
        return due

    def _collect(self, now: float) -> tuple[list[Expiry[K]], list[tuple[str, float]]]:
        """Find and retire everything due at *now* (lock held). Enforce: one expiry per
        request, for its earliest overdue deadline. Report: every overdue (request,
        deadline) pair, each once."""
        found: list[tuple[float, _Rec, _Clock, float]] = []
        add = found.append
        # The same pass finds the next due time: each FIFO stops at its first live entry
        # that is not due (a request expired below may make it stale: then the bound is
        # early, never late, which is all check() needs).
        next_due = _INF
        for clock in self._clocks:
            q = clock.q
            seconds = clock.seconds
            valid = clock.valid
            state_clock = valid is _state_entry  # the common case, tested inline
            while q:
                entry = q[0]
                start, rec, mark = entry
                if (rec.gen != mark) if state_clock else not valid(entry):
                    q.popleft()  # stale: the request left this state or window
                    continue
                due = start + seconds
                if due > now:
                    if due < next_due:
                        next_due = due
                    break
                q.popleft()
                add((due, rec, clock, start))
        expiries: list[Expiry[K]] = []
        left: list[tuple[str, float]] = []
        if found:
            if len(found) > 1:
                found.sort(key=_by_due)  # stable: clock order among equal due times
            enforce = self._mode == "enforce"
            listening = bool(self._leave_listeners)
            stats = self._stats
            spec = self._spec.name
            mode = self._mode
            append = expiries.append
            for _due, rec, clock, start in found:
                if rec.gen == _DEAD:  # enforce: already expired by an earlier deadline
                    continue
                slot = rec.slot
                expiry = _new_expiry(Expiry)  # see _EXPIRY_FIELDS
                _set_key(expiry, rec.key)
                _set_spec(expiry, spec)
                _set_state(expiry, slot.state)
                _set_entered_at(expiry, start)
                _set_elapsed(expiry, now - start)
                _set_deadline(expiry, clock.seconds)
                _set_reason(expiry, clock.reason)
                _set_mode(expiry, mode)
                note = rec.note
                if note is None:
                    _set_attributes(expiry, {})
                    _set_trace_parent(expiry, None)
                    _set_trace_links(expiry, ())
                else:
                    _set_attributes(expiry, dict(note.attributes))
                    _set_trace_parent(expiry, note.parent)
                    _set_trace_links(expiry, note.links)
                append(expiry)
                if stats is not None:
                    stats.fired(rec.key, slot.state, enforce)
                if enforce:
                    if slot.parked:
                        slot.parked.pop(rec, None)
                    if stats is not None:
                        stats.left(slot.state, now - rec.since)
                    if listening:
                        left.append((slot.label, now - rec.since))
                    self._untrack(rec, _EXPIRED)
                elif clock is slot.timer:
                    slot.parked[rec] = start
        self._expired += len(expiries)
        self._next_due = next_due
        return expiries, left

    def _deliver(
        self,
        work: list[tuple[Expiry[K], _Plan]],
        leaves: list[tuple[tuple[str, float], _Plan]],
        returned: list[Expiry[K]],
    ) -> set[int] | None:
        """Hand each expiry to its plan's hooks, then each leave notification to its
        listeners, outside the lock. An ``Exception`` is logged and counted. A
        ``BaseException`` propagates at once, after what it interrupted is set aside for
        the next check(): every expiry of *returned* (but the withdrawn ones), each with
        the hooks it has not reached yet, and every leave notification not made yet. An
        enforcement hook that returns :data:`~stallguard.CONCLUDED` withdraws its expiry
        (no later hook sees it). Returns the ids of the withdrawn expiries, if any."""
        withdrawn: set[int] | None = None
        phase = i = k = 0  # how far it got (read if interrupted)
        j = m = -1
        try:
            for i, (expiry, plan) in enumerate(work):  # noqa: B007 (read in except)
                j = -1
                owners = plan.owners
                for j, hook in enumerate(plan.hooks):
                    try:
                        result = hook(expiry)
                    except Exception:
                        self._hook_failed(hook, expiry)
                        continue
                    if result is CONCLUDED and owners[j] is _ENFORCE:
                        self._withdraw(expiry)
                        if withdrawn is None:
                            withdrawn = set()
                        withdrawn.add(id(expiry))
                        break
            phase = 1
            for k, (left, plan) in enumerate(leaves):  # noqa: B007
                m = -1
                for m, listener in enumerate(plan.hooks):  # noqa: B007
                    try:
                        listener(*left)
                    except Exception:
                        self._hook_failed(listener, None)
        except BaseException:
            self._carry_on(work, leaves, returned, withdrawn, phase, i, j, k, m)
            raise
        return withdrawn

    def _carry_on(
        self,
        work: list[tuple[Expiry[K], _Plan]],
        leaves: list[tuple[tuple[str, float], _Plan]],
        returned: list[Expiry[K]],
        withdrawn: set[int] | None,
        phase: int,
        i: int,
        j: int,
        k: int,
        m: int,
    ) -> None:
        """Set aside what an interrupted delivery did not finish (see _deliver): it
        stopped at expiry *i*'s hook *j* (phase 0) or at leave notification *k*'s
        listener *m* (phase 1). The next check() delivers it and returns the expiries,
        even if nothing new is due by then."""

        def kept(expiry: Expiry[K]) -> bool:
            return withdrawn is None or id(expiry) not in withdrawn

        if phase == 0 and work:
            rest = [(e, _NOBODY) for e, _ in work[:i] if kept(e)]
            expiry, plan = work[i]
            if kept(expiry):
                rest.append((expiry, plan.after(j)))
            rest += work[i + 1 :]
            rest_left = list(leaves)
        else:  # every expiry is delivered (or has nobody to be delivered to)
            rest = [(e, _NOBODY) for e in returned if kept(e)]
            rest_left = list(leaves)
            if phase == 1:
                rest_left = []
                if k < len(leaves):
                    left, plan = leaves[k]
                    rest_left = [(left, plan.after(m)), *leaves[k + 1 :]]
        with self._lock:
            self._carry[:0] = [*rest, *rest_left]
            self._next_due = -_INF  # the next check() delivers them

    def _withdraw(self, expiry: Expiry[K]) -> None:
        """An enforcement hook found *expiry*'s request concluded: not an expiry after
        all (see :data:`~stallguard.CONCLUDED`)."""
        with self._lock:
            self._expired -= 1
            self._withdrawn += 1
            key = expiry.key
            if self._gone.get(key) is _EXPIRED:
                self._gone[key] = _CONCLUDED  # (keeps its place in the memory)
            stats = self._stats
            if stats is not None:
                stats.unfired(expiry.state)

    def _hook_failed(self, hook: object, expiry: Expiry[K] | None) -> None:
        with self._lock:
            self._hook_errors += 1
        if expiry is None:
            log.exception("stallguard: listener %r failed (spec %s)", hook, self._spec.name)
        else:
            log.exception(
                "stallguard: expiry hook %r failed for key %r (spec %s)",
                hook,
                expiry.key,
                expiry.spec,
            )

    def _notify_leave(self, left: tuple[str, float]) -> None:
        """Tell the leave listeners (observe, forget). A ``BaseException`` propagates;
        the listeners it kept from hearing of *left* hear of it at the next check()."""
        plan = self._leave_plan
        m = -1
        try:
            for m, listener in enumerate(plan.hooks):  # noqa: B007 (read in except)
                try:
                    listener(*left)
                except Exception:
                    self._hook_failed(listener, None)
        except BaseException:
            with self._lock:
                self._carry.append((left, plan.after(m)))
                self._next_due = -_INF
            raise

    def _notify_wake(self) -> None:
        """Wake the runners. A wake-up cannot wait for a later check: a
        ``BaseException`` propagates only once every listener was called."""
        interrupted: BaseException | None = None
        for listener in self._wake_listeners:
            try:
                listener()
            except Exception:
                self._hook_failed(listener, None)
            except BaseException as exc:
                if interrupted is None:
                    interrupted = exc
        if interrupted is not None:
            raise interrupted
