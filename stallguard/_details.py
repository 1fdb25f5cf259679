"""Frozen details objects: what hooks and operators are handed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Generic, Literal, TypeVar

import attrs

from ._spec import Deadline, State, state_label

__all__ = [
    "CONCLUDED",
    "Expiry",
    "Mode",
    "Reason",
    "Snapshot",
    "StateSummary",
    "TrackedRequest",
]

K = TypeVar("K")

#: Why a request expired: it overstayed its state's deadline, its whole lifetime, or
#: its progress (heartbeat) window.
Reason = Literal["state", "lifetime", "stall"]
#: ``"enforce"`` fails overdue requests; ``"report"`` only reports them.
Mode = Literal["enforce", "report"]


class _Concluded:
    """The type of :data:`CONCLUDED` (one instance)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "stallguard.CONCLUDED"

    def __reduce__(self) -> str:
        return "CONCLUDED"


#: What an enforcement hook (a watchdog's ``on_expire``) returns when it finds that the
#: request had already ended when its deadline fired (its owner concluded it in the
#: meantime, a race the watchdog cannot see): nothing was failed, so the expiry is
#: withdrawn. No later hook, listener or instrumentation hook sees it, ``check()`` does
#: not return it, the key is remembered as concluded (``expired(key)`` is False) and
#: the statistics do not count it as fired. See docs/watchdog.md.
CONCLUDED: Any = _Concluded()


@attrs.frozen
class Expiry(Generic[K]):
    """One request that overstayed a deadline, as handed to every hook and returned by
    :meth:`stallguard.Watchdog.check`.

    Attributes:
        key: the request's key, as passed to :meth:`~stallguard.Watchdog.observe`.
        spec: the name of the :class:`~stallguard.Spec`.
        state: the state the request was in when the deadline fired.
        entered_at: when the clock that fired started, on the watchdog's clock: the time
            the request entered *state* (reason ``"state"``), its last progress
            (``"stall"``) or its first observation (``"lifetime"``).
        elapsed: seconds from *entered_at* to the check that found it overdue.
        deadline: the deadline that fired, in seconds.
        reason: ``"state"``, ``"lifetime"`` or ``"stall"``.
        mode: ``"enforce"`` (the request is failed and untracked) or ``"report"`` (nothing
            is failed; the expiry is only reported).
        attributes: user attributes attached with :meth:`~stallguard.Watchdog.annotate`,
            and those the watchdog's ``describe`` function gave for the key.
        trace_parent: a parent span context attached with
            :meth:`~stallguard.Watchdog.annotate` (an OpenTelemetry ``Context`` or
            ``SpanContext``), or None.
        trace_links: span contexts to link from the failure span.
    """

    key: K
    spec: str
    state: State
    entered_at: float
    elapsed: float
    deadline: float
    reason: Reason
    mode: Mode
    attributes: Mapping[str, Any] = attrs.field(factory=dict)
    trace_parent: Any = None
    trace_links: tuple[Any, ...] = ()

    @property
    def state_label(self) -> str:
        """The state's name, as in logs and spans."""
        return state_label(self.state)

    @property
    def enforced(self) -> bool:
        """True if the request is being failed (``mode == "enforce"``)."""
        return self.mode == "enforce"

    def describe(self) -> str:
        """A one-line human reason, e.g. for a failure message shown to a client:
        ``"stallguard: Transferring for 121.3s, past its 120s deadline"``."""
        what = {
            "state": f"in {self.state_label}",
            "stall": f"without progress in {self.state_label}",
            "lifetime": f"alive (now in {self.state_label})",
        }[self.reason]
        window = {"state": "deadline", "stall": "progress window", "lifetime": "lifetime"}
        return (
            f"stallguard: {what} for {self.elapsed:.3f}s, past its "
            f"{self.deadline:g}s {window[self.reason]} (spec {self.spec!r})"
        )


# Building the Expiry is most of an expiry's cost. attrs' frozen __init__ sets each field
# through object.__setattr__ (~1.1 µs for 11 fields on CPython 3.11); new_expiry sets
# the slots through their descriptors instead (~0.75 µs), which builds the identical
# object. That is only valid while Expiry has exactly these slotted fields and nothing
# else runs at construction: checked here, at import.
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
        "stallguard._details.new_expiry builds Expiry by setting its slots "
        f"{_EXPIRY_FIELDS} directly, but Expiry changed (fields now "
        f"{tuple(f.name for f in attrs.fields(Expiry))}); update new_expiry"
    )
_new = Expiry.__new__
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


def new_expiry(
    key: Any,
    spec: str,
    state: State,
    entered_at: float,
    elapsed: float,
    deadline: float,
    reason: str,
    mode: str,
    attributes: Mapping[str, Any],
    trace_parent: Any,
    trace_links: tuple[Any, ...],
) -> Expiry[Any]:
    """``Expiry(...)`` with every field given, at two thirds of its cost (the
    watchdog's check builds one per expiry)."""
    expiry: Expiry[Any] = _new(Expiry)
    _set_key(expiry, key)
    _set_spec(expiry, spec)
    _set_state(expiry, state)
    _set_entered_at(expiry, entered_at)
    _set_elapsed(expiry, elapsed)
    _set_deadline(expiry, deadline)
    _set_reason(expiry, reason)
    _set_mode(expiry, mode)
    _set_attributes(expiry, attributes)
    _set_trace_parent(expiry, trace_parent)
    _set_trace_links(expiry, trace_links)
    return expiry


@attrs.frozen
class TrackedRequest(Generic[K]):
    """One tracked request in a :class:`Snapshot`."""

    key: K
    state: State
    entered_at: float
    #: Seconds in the current state.
    age: float
    #: Seconds until the state deadline fires (negative once overdue), or None.
    remaining: float | None


@attrs.frozen
class StateSummary:
    """Per-state figures in a :class:`Snapshot`: what an operator needs to see a stall
    before it bites."""

    state: State
    deadline: Deadline
    #: Requests in this state now.
    count: int
    #: Seconds the longest-waiting request has been in this state (None if empty).
    oldest_age: float | None


@attrs.frozen
class Snapshot(Generic[K]):
    """A consistent view of a watchdog, from :meth:`stallguard.Watchdog.snapshot`."""

    spec: str
    mode: Mode
    #: The watchdog clock's time of the snapshot.
    at: float
    #: Per non-terminal state label.
    states: Mapping[str, StateSummary]
    #: Every tracked request, oldest state entry first (empty if not asked for).
    requests: tuple[TrackedRequest[K], ...]
    tracked: int
    #: Expiries so far, enforced or reported.
    expired: int
    #: Exceptions raised by hooks (logged, never propagated).
    hook_errors: int
    #: Events dropped because their key had already concluded (a late ``observe``: any
    #: state after the key concluded, and a terminal state after it was force-failed).
    late_events: int
    #: Runner loops (``WatchdogThread``, ``run_watchdog``) ended by an error: each one
    #: also logged at ERROR; see docs/runners.md.
    runner_errors: int = 0
    #: Expiries an enforcement hook withdrew (it returned :data:`CONCLUDED`: the request
    #: had ended in the moment before the check); not counted in *expired*.
    withdrawn: int = 0
