"""SGLang's ``KVPoll`` states, the one definition the adapter uses.

``KVPoll`` (``sglang.srt.disaggregation.base.conn``) is a class of plain ints; a sender's
``poll()`` and its manager's ``request_status`` hold those ints. Defined here without
importing SGLang.
"""

from __future__ import annotations

__all__ = [
    "BOOTSTRAPPING",
    "FAILED",
    "KVPOLL",
    "LIVE",
    "LIVE_STATES",
    "SUCCESS",
    "TERMINAL_STATES",
    "TRANSFERRING",
    "WAITING",
]

#: ``KVPoll`` values (their index) -> state names.
KVPOLL: tuple[str, ...] = ("Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success")
FAILED, BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS = range(5)
#: The values of the non-terminal states (the ones a deadline can apply to).
LIVE = frozenset((BOOTSTRAPPING, WAITING, TRANSFERRING))
#: The non-terminal state names, the ones that take a deadline.
LIVE_STATES: tuple[str, ...] = tuple(KVPOLL[v] for v in (BOOTSTRAPPING, WAITING, TRANSFERRING))
#: The terminal state names.
TERMINAL_STATES: tuple[str, ...] = (KVPOLL[SUCCESS], KVPOLL[FAILED])
