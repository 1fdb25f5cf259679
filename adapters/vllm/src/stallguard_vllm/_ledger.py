"""The worker side's bookkeeping of the generic guard: which receives to report failed,
and which ends of a failed receive to pass on to the scheduler.

Pure Python (no vLLM import), so its promises are tested with random event sequences
(tests/test_vllm_ledger.py). The guard's worker calls, once per step:

1. :meth:`FailLedger.order` with the receives the scheduler ordered failed;
2. :meth:`FailLedger.due` with the connector refinement's verdict per ordered receive
   (``"fail"``: report it failed now; ``"wait"``: not yet, ask again next step, e.g. a
   handshake with no transfer posted; ``"drop"``: the transfer just completed, let it
   succeed) - the receives to add to ``failed_recving``;
3. :meth:`FailLedger.ends` with the inner connector's ``finished_recving`` and the
   refinement's set of those ends that prove nothing (for example a local timeout
   while the peer may still write) - the ends to pass on to the scheduler, which frees
   the blocks on them.

Promises:

* a receive is reported failed at most once, and only if it was ordered;
* the end of a receive reported failed is passed on only when the connector proved
  it (an end not in *unproven*), never before; withheld ends stay withheld (its blocks
  stay quarantined) until a proven end comes;
* the end of any other receive is passed on unchanged, in the step it comes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

__all__ = ["FailLedger", "Verdict"]

Verdict = Literal["fail", "wait", "drop"]


class FailLedger:
    """One worker's ordered and failed receives."""

    def __init__(self) -> None:
        #: ordered failed by the scheduler, not yet reported
        self.ordered: set[str] = set()
        #: reported failed; their blocks are held until a proven end
        self.failed: set[str] = set()
        #: failed receives whose inner connector reported an unproven end
        self.withheld: set[str] = set()

    def order(self, rids: Iterable[str]) -> None:
        """The scheduler ordered *rids* failed (a receive already failed is ignored)."""
        for rid in rids:
            if rid not in self.failed:
                self.ordered.add(rid)

    def due(self, verdict: Callable[[str], Verdict]) -> set[str]:
        """The ordered receives to report failed this step (each once)."""
        out: set[str] = set()
        for rid in tuple(self.ordered):
            v = verdict(rid)
            if v == "wait":
                continue
            self.ordered.discard(rid)
            if v == "fail":
                self.failed.add(rid)
                out.add(rid)
        return out

    def ends(self, finished: Iterable[str], unproven: Iterable[str] = ()) -> set[str]:
        """Of the inner connector's *finished* receives, those to pass on: all but the
        failed ones whose end is in *unproven* (withheld: their blocks stay held)."""
        weak = set(unproven)
        out: set[str] = set()
        for rid in finished:
            self.ordered.discard(rid)  # ended: nothing left to fail
            if rid in self.failed:
                if rid in weak:
                    self.withheld.add(rid)
                    continue
                self.failed.discard(rid)
                self.withheld.discard(rid)
            out.add(rid)
        return out

    def __len__(self) -> int:
        return len(self.ordered) + len(self.failed)
