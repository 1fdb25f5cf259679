"""Delivery: who is handed an expiry or a leave notification, and handing it over.

Everything here runs outside the watchdog's lock (it takes the lock only to count, to
withdraw, and to set aside what an interrupted delivery did not finish). The watchdog
decides what expired (:mod:`stallguard._watchdog`); these functions hand it to the
enforcement hooks, the listeners and the instrumentation hooks, in that order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar, cast

import attrs

from . import _registry
from ._details import CONCLUDED, Expiry
from ._fifo import CONCLUDED as _CONCLUDED_MARK
from ._fifo import EXPIRED, Note
from ._validate import check_annotations, listener_args, tracked

if TYPE_CHECKING:
    from ._core import WatchdogCore
    from ._watchdog import Watchdog

__all__ = ["Listener", "add_listener", "annotate", "remove_listener"]

K = TypeVar("K", bound=Hashable)

log = logging.getLogger("stallguard")

#: a leave notification: (state label, seconds in the state)
Left = tuple[str, float]


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
ENFORCE: Any = object()


class Plan:
    """Who is handed an expiry (or a leave notification), in order: ``hooks``, and each
    one's owner: :data:`ENFORCE` for an enforcement hook, the :class:`Listener` it
    belongs to, or None (``describe``, the instrumentation hooks). Positions, not
    identities, say which hooks enforce: the same callable may also listen, and
    withdraws nothing there. A delivery that a ``BaseException`` interrupts goes on, at
    the next check, with the rest of its plan (:meth:`after`), less the listeners
    removed meanwhile (:meth:`without`)."""

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

    def after(self, done: int) -> Plan:
        """The plan past its hook number *done* (-1: the whole plan)."""
        return Plan(self.hooks[done + 1 :], self.owners[done + 1 :])

    def without(self, listeners: tuple[Listener, ...]) -> Plan:
        """The plan less the hooks of every listener that is not in *listeners*."""
        owners = self.owners
        keep = [n for n, o in enumerate(owners) if not isinstance(o, Listener) or o in listeners]
        if len(keep) == len(owners):
            return self
        return Plan(tuple(self.hooks[n] for n in keep), tuple(owners[n] for n in keep))


NOBODY = Plan((), ())


def describe_hook(describe: Callable[[Any], Mapping[str, Any]]) -> Callable[[Expiry[Any]], None]:
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


# ---------------------------------------------------------------------- Watchdog methods
# (the class binds them: ``Watchdog.add_listener = add_listener``; not tracking)


def add_listener(
    self: Watchdog[K],
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
    listener_args(on_expire=on_expire, on_leave=on_leave, on_earlier_deadline=on_earlier_deadline)
    listener = Listener(self, on_expire, on_leave, on_earlier_deadline)
    with self._lock:
        set_listeners(self, (*self._listeners, listener))
    return listener


def remove_listener(self: Watchdog[Any], listener: Listener) -> bool:
    """Stop calling *listener*. Returns False if it was not listening."""
    with self._lock:
        kept = tuple(x for x in self._listeners if x is not listener)
        if len(kept) == len(self._listeners):
            return False
        set_listeners(self, kept)
        return True


def annotate(
    self: Watchdog[K],
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
    links = check_annotations(attributes, trace_links)
    with self._lock:
        rec = tracked(self, key)
        if rec is None:
            return False
        note = rec.note
        if note is None:
            note = rec.note = Note()
        if attributes:
            note.attributes.update(attributes)
        if trace_parent is not None:
            note.parent = trace_parent
        if links is not None:
            note.links = links
        return True


# ---------------------------------------------------------------------- plans


def set_listeners(wd: WatchdogCore, listeners: tuple[Listener, ...]) -> None:
    """Make *listeners* the watchdog's (lock held): its leave plan, its wake-up
    listeners, and (last: the expiry plan is remade when it changes) the tuple."""
    leaving = [(x, x.on_leave) for x in listeners if x.on_leave is not None]
    wd._leave_plan = Plan(tuple(fn for _, fn in leaving), tuple(x for x, _ in leaving))
    wd._leave_listeners = wd._leave_plan.hooks
    wd._wake_listeners = tuple(x.on_earlier_deadline for x in listeners if x.on_earlier_deadline)
    wd._listeners = listeners


def expire_plan(wd: WatchdogCore) -> Plan:
    """Who sees this check's expiries: ``describe``, the enforcement hooks (enforce
    mode), the listeners, the instrumentation hooks (cached)."""
    active = _registry.active_hooks()
    plan = wd._plan
    listeners = wd._listeners
    if plan.listeners is listeners and plan.active is active:
        return plan
    handles = tuple(x for x in listeners if x.on_expire is not None)
    enforce = wd._enforce_hooks if wd._mode == "enforce" else ()
    describe = wd._describe_hooks
    plan = wd._plan = Plan(
        describe + enforce + tuple(x.on_expire for x in handles) + active,
        (None,) * len(describe) + (ENFORCE,) * len(enforce) + handles + (None,) * len(active),
        listeners,
        active,
    )
    return plan


# ---------------------------------------------------------------------- delivery


def dispatch(
    wd: WatchdogCore,
    expiries: list[Expiry[Any]],
    left: list[Left],
    carry: list[tuple[Expiry[Any] | Left, Plan]],
) -> list[Expiry[Any]]:
    """Deliver one check's *expiries* and leave notifications (*left*), after what an
    interrupted check had *carry*-ed over; returns what ``check()`` returns."""
    if carry:
        work, leaves, returned = _resume(wd, expiries, left, carry)
    else:
        work = []
        if expiries:
            plan = expire_plan(wd)
            if plan.hooks:
                work = [(e, plan) for e in expiries]
        leaves = []
        if left:
            leave_plan = wd._leave_plan
            leaves = [(x, leave_plan) for x in left]
        if not work and not leaves:
            return expiries
        returned = expiries
    withdrawn = deliver(wd, work, leaves, returned)
    if withdrawn:
        return [e for e in returned if id(e) not in withdrawn]
    return returned


def _resume(
    wd: WatchdogCore,
    expiries: list[Expiry[Any]],
    left: list[Left],
    carry: list[tuple[Expiry[Any] | Left, Plan]],
) -> tuple[list[tuple[Expiry[Any], Plan]], list[tuple[Left, Plan]], list[Expiry[Any]]]:
    """What to deliver after an interrupted check: what it *carry*-ed over first (less
    the listeners removed since), then this check's; and what check() returns."""
    listeners = wd._listeners
    work: list[tuple[Expiry[Any], Plan]] = [
        (e, plan.without(listeners))  # type: ignore[misc]
        for e, plan in carry
        if e.__class__ is not tuple
    ]
    leaves: list[tuple[Left, Plan]] = [
        (x, plan.without(listeners)) for x, plan in carry if x.__class__ is tuple
    ]
    returned = [e for e, _ in work]
    returned += expiries
    if expiries:
        plan = expire_plan(wd)
        if not plan.hooks:
            plan = NOBODY
        work += [(e, plan) for e in expiries]
    leave_plan = wd._leave_plan
    leaves += [(x, leave_plan) for x in left]
    return work, leaves, returned


def deliver(
    wd: WatchdogCore,
    work: list[tuple[Expiry[Any], Plan]],
    leaves: list[tuple[Left, Plan]],
    returned: list[Expiry[Any]],
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
                    hook_failed(wd, hook, expiry)
                    continue
                if result is CONCLUDED and owners[j] is ENFORCE:
                    withdraw(wd, expiry)
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
                    hook_failed(wd, listener, None)
    except BaseException:
        carry_on(wd, work, leaves, returned, withdrawn, (phase, i, j, k, m))
        raise
    return withdrawn


def carry_on(
    wd: WatchdogCore,
    work: list[tuple[Expiry[Any], Plan]],
    leaves: list[tuple[Left, Plan]],
    returned: list[Expiry[Any]],
    withdrawn: set[int] | None,
    where: tuple[int, int, int, int, int],
) -> None:
    """Set aside what an interrupted delivery did not finish (see :func:`deliver`):
    *where* is ``(phase, i, j, k, m)``: it stopped at expiry *i*'s hook *j* (phase 0)
    or at leave notification *k*'s listener *m* (phase 1). The next check() delivers it
    and returns the expiries, even if nothing new is due by then."""
    phase, i, j, k, m = where

    def kept(expiry: Expiry[Any]) -> bool:
        return withdrawn is None or id(expiry) not in withdrawn

    if phase == 0 and work:
        rest = [(e, NOBODY) for e, _ in work[:i] if kept(e)]
        expiry, plan = work[i]
        if kept(expiry):
            rest.append((expiry, plan.after(j)))
        rest += work[i + 1 :]
        rest_left = list(leaves)
    else:  # every expiry is delivered (or has nobody to be delivered to)
        rest = [(e, NOBODY) for e in returned if kept(e)]
        rest_left = list(leaves)
        if phase == 1:
            rest_left = []
            if k < len(leaves):
                left, plan = leaves[k]
                rest_left = [(left, plan.after(m)), *leaves[k + 1 :]]
    with wd._lock:
        wd._carry[:0] = [*rest, *rest_left]
        wd._next_due = -float("inf")  # the next check() delivers them


def withdraw(wd: WatchdogCore, expiry: Expiry[Any]) -> None:
    """An enforcement hook found *expiry*'s request concluded: not an expiry after all
    (see :data:`~stallguard.CONCLUDED`)."""
    with wd._lock:
        wd._expired -= 1
        wd._withdrawn += 1
        key = expiry.key
        if wd._gone.get(key) is EXPIRED:
            wd._gone[key] = _CONCLUDED_MARK  # (keeps its place in the memory)
        stats = wd._stats
        if stats is not None:
            stats.unfired(expiry.state, expiry.reason)


def hook_failed(wd: WatchdogCore, hook: object, expiry: Expiry[Any] | None) -> None:
    """Count and log a hook, listener or ``describe`` that raised an ``Exception``."""
    with wd._lock:
        wd._hook_errors += 1
    if expiry is None:
        log.exception("stallguard: listener %r failed (spec %s)", hook, wd._spec.name)
    else:
        log.exception(
            "stallguard: expiry hook %r failed for key %r (spec %s)",
            hook,
            expiry.key,
            expiry.spec,
        )


def notify_leave(wd: WatchdogCore, left: Left) -> None:
    """Tell the leave listeners (observe, forget). A ``BaseException`` propagates;
    the listeners it kept from hearing of *left* hear of it at the next check()."""
    plan = wd._leave_plan
    m = -1
    try:
        for m, listener in enumerate(plan.hooks):  # noqa: B007 (read in except)
            try:
                listener(*left)
            except Exception:
                hook_failed(wd, listener, None)
    except BaseException:
        with wd._lock:
            wd._carry.append((left, plan.after(m)))
            wd._next_due = -float("inf")
        raise


def notify_wake(wd: WatchdogCore) -> None:
    """Wake the runners. A wake-up cannot wait for a later check: a ``BaseException``
    propagates only once every listener was called."""
    interrupted: BaseException | None = None
    for listener in wd._wake_listeners:
        try:
            listener()
        except Exception:
            hook_failed(wd, listener, None)
        except BaseException as exc:
            if interrupted is None:
                interrupted = exc
    if interrupted is not None:
        raise interrupted
