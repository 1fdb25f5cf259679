"""Taking over requests an integration kept itself while none of their deadlines could
be due: :meth:`Watchdog.adopt` and :meth:`Watchdog.record_stays` (the class binds these
functions as its methods).

An integration that sees every request arrive and every state change (the SGLang
adapter's hooks) can keep a request's state and its start on its own record while the
request is young, as the watchdog's own deferred admission does (``_fifo.Young``): no
deadline counts from before the request was first seen, and none is shorter than the
shortest duration of the spec, so none can be due before the first sight plus that
duration. At any time before that it hands the request over with :func:`adopt`, which
puts the request on the deadline clocks with **the exact starts it was given** (onto a
clock's heap when earlier than its FIFO's tail, as an admission does), where
``observe(..., at=)`` would raise a start to the latest one on its clock. The stays of
the requests it never hands over (most of them) reach the time-in-state statistics
through :func:`record_stays`, one lock per batch.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from ._fifo import Rec, due_of, enrol
from ._spec import State
from ._validate import check_at, check_time, unknown_state

if TYPE_CHECKING:
    from ._watchdog import Watchdog

__all__ = ["adopt", "record_stays"]

K = TypeVar("K", bound=Hashable)

_INF = float("inf")


def adopt(
    wd: Watchdog[K],
    key: K,
    state: State,
    *,
    since: float,
    beat: float | None = None,
    born: float | None = None,
) -> bool:
    """Track *key*, which the watchdog does not track, in live *state* entered at
    *since* (its progress window, if the state has one, last renewed at *beat*; default
    *since*), with exactly those starts: for an integration that kept the request itself
    while none of its deadlines could be due (see the module's docstring). Its lifetime,
    if the spec has one, counts from *born*: when the request was first seen (default
    *since*; pass it whenever the request was in another state before *since*, or its
    lifetime would count from a later start than it has).

    The caller must hand the request over before its earliest deadline could be due
    (its first sight plus the shortest duration of the spec); a deadline already past
    is due at the next :meth:`check`.

    Returns:
        True if *key* is now tracked; False if it was already tracked or is remembered
        as concluded (nothing changes, as for a late ``observe``).

    Raises:
        UnknownStateError: *state* is not a state of the spec (with
            ``unknown_state="raise"``).
        ValueError: *state* is terminal; *since* or *beat* is later than the clock's
            now, NaN or infinite, *beat* is earlier than *since*, or *born* is later
            than *since*.
        TypeError: *since*, *beat* or *born* is not a number, or *key* is not hashable.
    """
    slot = wd._slots.get(state)
    if slot is None:
        unknown_state(wd, key, state)
        return False
    if slot.terminal:
        raise ValueError(f"adopt() needs a live state, got terminal {state!r}")
    with wd._lock:
        now = wd._read(wd._clock())
        since = check_at(since, now)
        beat = since if beat is None else check_at(beat, now)
        if beat < since:
            raise ValueError(f"beat={beat!r} is earlier than since={since!r}")
        born = since if born is None else check_at(born, now)
        if born > since:
            raise ValueError(f"born={born!r} is later than since={since!r}")
        if key in wd._where or key in wd._gone:
            return False
        rec = wd._where[key] = Rec(key, slot, since)
        rec.beat = beat
        rec.lifestart = born
        life = wd._young.life
        enrol(rec, life)  # (not young: onto the FIFOs, or the heaps when out of order)
        due = due_of(rec, life)
        if due < wd._next_due:
            wd._next_due = due
    return True


def record_stays(wd: Watchdog[Any], stays: Iterable[tuple[State, float]]) -> None:
    """Record stays the watchdog did not track, each ``(live state, seconds in it)``,
    in the time-in-state statistics (nothing when they are off): the stays of requests
    an integration kept itself and never handed over (see the module's docstring).

    Raises:
        ValueError: a state is not a live state of the spec, or a duration is negative,
            NaN or infinite (nothing of the batch is recorded).
        TypeError: a duration is not a number.
    """
    items = list(stays)
    slots = wd._slots
    for state, seconds in items:
        if not (seconds.__class__ is float and 0.0 <= seconds < _INF):  # (the usual case)
            seconds = check_time("seconds", seconds)
            if seconds < 0:
                raise ValueError(f"record_stays(): a stay of {seconds!r} s in {state!r}")
        slot = slots.get(state)
        if slot is None or slot.terminal:
            raise ValueError(f"record_stays(): {state!r} is not a live state of the spec")
    stats = wd._stats
    if stats is None:
        return
    hist = stats.hist
    with wd._lock:
        for state, seconds in items:
            hist(state).add(float(seconds))
