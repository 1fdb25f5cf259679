"""When the decode-side faults' prefill stops itself (``_ppeer``), without SGLang: the
rule is kept apart so that a test can try it against the sequences that broke it."""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import TypeVar

S = TypeVar("S")


def ready_to_freeze(
    statuses: Mapping[int, S],
    tags: Mapping[int, str],
    sent: Set[int],
    wanted: Set[str],
    *,
    waiting: S,
) -> bool:
    """Whether a room of every *wanted* tag (decode server) has its decode metadata here
    (its sender's status is *waiting*, ``KVPoll.WaitingForInput``) and its KV is not sent
    yet: freezing then pins one request on each of those servers.

    The wanted tags are the driver's, never read off the live rooms: under load, every
    room of one server can be done at the moment of the check, and a freeze then would
    pin a request on the other server only (the "with stallguard" arm then has no
    request in ``transfer WaitingForInput`` to fail, which is what the scenario shows).
    """
    ready = {
        tags[room] for room, status in statuses.items() if status == waiting and room not in sent
    }
    return bool(wanted) and ready >= wanted
