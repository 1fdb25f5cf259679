"""Quarantine: memory of a failed request, held until its transport is proven quiet.

Failing a request and freeing its memory are two acts. A backstop does the first at
the deadline (the client gets its error at once) and the second only once nothing can
still land in that memory: releasing a NIXL transfer handle does not stop the transfer,
and a frozen peer that wakes up completes its READ or WRITE into the same addresses
(docs/quarantine.md has the measurements). A :class:`Quarantine` is the ledger of such
holds: the adapter puts the failed request's memory in with :meth:`~Quarantine.hold`,
and takes it out with :meth:`~Quarantine.release` when the transport reports the
transfer over (``DONE`` or ``ERR``), the peer's connection was torn down in a way shown
to stop delivery, or the peer process is gone. Nothing else frees quarantined memory.

A hold is one more non-terminal state (``Quarantined``) of a core
:class:`~stallguard.Watchdog` (in report mode: a hold is never failed, it is
escalated), with its own deadline. A hold that outlives it is **overdue**, once:
``check()`` returns it, the ``on_overdue`` callback runs (an adapter tears the peer's
connection down there, if its backend can), it is logged at ERROR and reported by the
instrumentation hooks as a ``stallguard.stall_reported`` span of state ``Quarantined``
with the hold's peer, size and action. The memory stays held until a proof comes:
never freed on a timer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

import attrs

from ._details import Expiry
from ._errors import ConfigError
from ._spec import Spec
from ._validate import check_seconds, is_count, is_text
from ._watchdog import Watchdog

__all__ = [
    "PROOFS",
    "QUARANTINED",
    "Hold",
    "PeerHolds",
    "Quarantine",
    "QuarantineSnapshot",
]

K = TypeVar("K")

log = logging.getLogger("stallguard.quarantine")

#: The state a held request is tracked in.
QUARANTINED = "Quarantined"
_RELEASED = "Released"

#: What :meth:`Quarantine.release` accepts as proof that nothing can land any more.
PROOFS: Mapping[str, str] = {
    "transfer_done": "the transport reported every transfer into the memory complete",
    "transfer_error": "the transport reported every transfer into the memory ended in error",
    "peer_gone": "the peer process is gone (its connection failed, every transfer ended)",
    "torn_down": "the peer's connection was torn down and the transfers reported ended",
    "never_posted": "no transfer into the memory was ever posted",
}


@attrs.frozen
class Hold(Generic[K]):
    """One quarantined request's memory.

    Attributes:
        key: the request's key.
        peer: the peer whose transfer may still write (or read) the memory.
        units: how many allocation units are held (blocks, pages), as the adapter counts.
        nbytes: how many bytes are held (0 if unknown).
        since: when the hold began, on the quarantine's clock.
        overdue: True once the hold outlived the quarantine's deadline.
        attributes: the adapter's span attributes for the hold.
    """

    key: K
    peer: str
    units: int
    nbytes: int
    since: float
    overdue: bool = False
    attributes: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class PeerHolds:
    """Per-peer figures in a :class:`QuarantineSnapshot`."""

    peer: str
    holds: int
    units: int
    nbytes: int
    overdue: int
    #: Seconds the oldest hold of this peer has been held.
    oldest_age: float


@attrs.frozen
class QuarantineSnapshot:
    """A consistent view of a :class:`Quarantine`."""

    name: str
    at: float
    deadline: float | None
    holds: int
    units: int
    nbytes: int
    overdue: int
    by_peer: Mapping[str, PeerHolds]
    #: Holds released since start, by proof.
    released: Mapping[str, int]
    #: Holds that went overdue since start.
    escalated: int


class Quarantine(Generic[K]):
    """Holds failed requests' memory until the transport proves it quiet.

    Args:
        name: names the quarantine in logs and spans (the watchdog spec's name).
        deadline: seconds a hold may last before it is overdue (escalated, never freed);
            None: holds are never escalated (they are still reported by
            :meth:`snapshot`).
        clock: seconds, never going backwards; default :func:`time.monotonic`.
        unit: what :attr:`Hold.units` counts, for messages (``"blocks"``, ``"pages"``).
        on_overdue: called with each hold that went overdue, once, from :meth:`check`
            (an adapter tears the peer's connection down there). An exception it raises
            is logged and counted; the hold stays.
        overdue_action: a word for logs and spans saying what *on_overdue* does
            (default ``"teardown requested"`` with *on_overdue*, else ``"holding"``).

    Raises:
        ConfigError: a bad argument, named with its value.

    Thread-safe: holds and releases may come from any thread.
    """

    def __init__(
        self,
        name: str,
        *,
        deadline: float | None,
        clock: Callable[[], float] | None = None,
        unit: str = "blocks",
        on_overdue: Callable[[Hold[K]], object] | None = None,
        overdue_action: str | None = None,
    ) -> None:
        seconds = _checked_arguments(name, deadline, unit, on_overdue)
        self._name = name
        self._deadline = seconds
        self._unit = unit
        self._on_overdue = on_overdue
        self._action = overdue_action or (
            "teardown requested" if on_overdue is not None else "holding"
        )
        self._lock = threading.Lock()
        self._holds: dict[K, Hold[K]] = {}
        self._released: dict[str, int] = {}
        self._escalated = 0
        self._callback_errors = 0
        self._wd: Watchdog[K] = Watchdog(
            Spec(name=name, deadlines={QUARANTINED: seconds}, terminal=[_RELEASED]),
            clock=clock if clock is not None else time.monotonic,
            mode="report",
            describe=self._describe,
        )

    # ------------------------------------------------------------------ read-only

    @property
    def name(self) -> str:
        return self._name

    @property
    def deadline(self) -> float | None:
        """Seconds a hold may last before it is overdue."""
        return self._deadline

    @property
    def watchdog(self) -> Watchdog[K]:
        """The core watchdog the holds are tracked in (state ``Quarantined``)."""
        return self._wd

    def __contains__(self, key: object) -> bool:
        return key in self._holds

    def __len__(self) -> int:
        return len(self._holds)

    def get(self, key: K) -> Hold[K] | None:
        """The hold of *key*, or None."""
        return self._holds.get(key)

    def holds(self) -> list[Hold[K]]:
        """Every hold, oldest first."""
        with self._lock:
            return sorted(self._holds.values(), key=lambda h: h.since)

    # ------------------------------------------------------------------ changes

    def hold(
        self,
        key: K,
        *,
        peer: str,
        units: int = 0,
        nbytes: int = 0,
        attributes: Mapping[str, Any] | None = None,
    ) -> Hold[K]:
        """Quarantine *key*'s memory (the request was failed; a transfer may still
        land). Holding a key already held changes nothing and returns its hold.

        Raises:
            ConfigError: *peer* not a str, *units*/*nbytes* not non-negative ints.
        """
        _check_hold(peer, units, nbytes)
        with self._lock:
            held = self._holds.get(key)
            if held is not None:
                return held
            now = self._wd.clock()
            held = Hold(
                key=key,
                peer=peer,
                units=units,
                nbytes=nbytes,
                since=now,
                attributes=dict(attributes or {}),
            )
            self._holds[key] = held
            # a key that was held and released before is a new stay: forget the old one
            self._wd.forget(key, remember=False)
            self._wd.observe(key, QUARANTINED, at=now)
        return held

    def release(self, key: K, *, proof: str) -> Hold[K] | None:
        """Take *key*'s memory out of quarantine: *proof* (one of :data:`PROOFS`) says
        why nothing can land in it any more. Returns the hold (the caller frees its
        memory now), or None if *key* was not held.

        Raises:
            ConfigError: *proof* is not one of :data:`PROOFS`.
        """
        if proof not in PROOFS:
            raise ConfigError(
                f"Quarantine.release proof must be one of {', '.join(PROOFS)}, got {proof!r}"
            )
        with self._lock:
            held = self._holds.pop(key, None)
            if held is None:
                return None
            self._released[proof] = self._released.get(proof, 0) + 1
            self._wd.observe(key, _RELEASED)
        if held.overdue:
            log.warning(
                "stallguard: quarantine %s: %s released after %.3fs (%s): %d %s, %d bytes "
                "from peer %s freed",
                self._name,
                key,
                self._wd.clock() - held.since,
                proof,
                held.units,
                self._unit,
                held.nbytes,
                held.peer,
            )
        return held

    def check(self, now: float | None = None) -> list[Hold[K]]:
        """The holds that went overdue since the last check (each once): logged at
        ERROR, reported, handed to *on_overdue*. They stay held. Cheap when none is due
        (one comparison)."""
        expiries = self._wd.check(now)
        if not expiries:
            return []
        out: list[Hold[K]] = []
        for expiry in expiries:
            held = self._escalate(expiry)
            if held is not None:
                out.append(held)
                self._overdue(held, expiry)
        return out

    def _escalate(self, expiry: Expiry[K]) -> Hold[K] | None:
        """Mark the hold that *expiry* is about overdue; None if there is nothing to
        escalate."""
        with self._lock:
            held = self._holds.get(expiry.key)
            # released meanwhile, already escalated, or released and held again (a new
            # stay, with its own deadline): nothing to escalate
            if held is None or held.overdue or held.since != expiry.entered_at:
                return None
            held = attrs.evolve(held, overdue=True)
            self._holds[expiry.key] = held
            self._escalated += 1
        return held

    def _overdue(self, held: Hold[K], expiry: Expiry[K]) -> None:
        """Log the *held* memory that went overdue, and hand it to *on_overdue*."""
        log.error(
            "stallguard: quarantine %s: %s has held %d %s (%d bytes) for %.3fs, past "
            "its %ss deadline, and peer %s has not proven its transfers over: %s. "
            "The memory stays held until it does (see docs/quarantine.md)",
            self._name,
            expiry.key,
            held.units,
            self._unit,
            held.nbytes,
            expiry.elapsed,
            self._deadline,
            held.peer,
            self._action,
        )
        if self._on_overdue is None:
            return
        try:
            self._on_overdue(held)
        except Exception:
            self._callback_errors += 1
            log.exception(
                "stallguard: quarantine %s: on_overdue failed for %s; still holding",
                self._name,
                expiry.key,
            )

    def snapshot(self, now: float | None = None) -> QuarantineSnapshot:
        """Totals and per-peer figures of what is held now."""
        at = self._wd.clock() if now is None else float(now)
        with self._lock:
            holds = list(self._holds.values())
            released = dict(self._released)
            escalated = self._escalated
        by_peer = {
            peer: _peer_holds(peer, [h for h in holds if h.peer == peer], at)
            for peer in sorted({h.peer for h in holds})
        }
        units, nbytes, overdue = _totals(holds)
        return QuarantineSnapshot(
            name=self._name,
            at=at,
            deadline=self._deadline,
            holds=len(holds),
            units=units,
            nbytes=nbytes,
            overdue=overdue,
            by_peer=by_peer,
            released=released,
            escalated=escalated,
        )

    @property
    def callback_errors(self) -> int:
        """Exceptions raised by *on_overdue* (logged, never propagated)."""
        return self._callback_errors

    # ------------------------------------------------------------------ internals

    def _describe(self, key: K) -> Mapping[str, Any]:
        held = self._holds.get(key)
        if held is None:
            return {}
        return {
            **held.attributes,
            "stallguard.quarantine.peer": held.peer,
            "stallguard.quarantine.units": held.units,
            "stallguard.quarantine.bytes": held.nbytes,
            "stallguard.quarantine.action": self._action,
        }


def _checked_arguments(
    name: object, deadline: float | None, unit: object, on_overdue: object
) -> float | None:
    """:class:`Quarantine`'s arguments, checked in that order; the deadline in seconds."""
    if not is_text(name):
        raise ConfigError(f"Quarantine name must be a non-empty str, got {name!r}")
    seconds = check_seconds("Quarantine deadline", deadline)
    if on_overdue is not None and not callable(on_overdue):
        raise ConfigError(f"on_overdue must be a callable, got {on_overdue!r}")
    if not is_text(unit):
        raise ConfigError(f"unit must be a non-empty str, got {unit!r}")
    return seconds


def _check_hold(peer: object, units: object, nbytes: object) -> None:
    """Refuse :meth:`Quarantine.hold`'s arguments unless *peer* is a str and *units* and
    *nbytes* are non-negative ints."""
    if not isinstance(peer, str):
        raise ConfigError(f"Quarantine.hold peer must be a str, got {peer!r}")
    for what, value in (("units", units), ("nbytes", nbytes)):
        if not is_count(value):
            raise ConfigError(f"Quarantine.hold {what} must be a non-negative int, got {value!r}")


def _peer_holds(peer: str, holds: list[Hold[Any]], at: float) -> PeerHolds:
    """The figures of *peer*'s *holds* (at least one) at time *at*."""
    units, nbytes, overdue = _totals(holds)
    return PeerHolds(
        peer=peer,
        holds=len(holds),
        units=units,
        nbytes=nbytes,
        overdue=overdue,
        oldest_age=max(0.0, at - min(h.since for h in holds)),
    )


def _totals(holds: list[Hold[Any]]) -> tuple[int, int, int]:
    """The units, the bytes and the overdue holds of *holds*, summed."""
    return (
        sum(h.units for h in holds),
        sum(h.nbytes for h in holds),
        sum(h.overdue for h in holds),
    )
