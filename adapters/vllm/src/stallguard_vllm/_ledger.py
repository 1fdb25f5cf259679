"""The worker side's bookkeeping of the generic guard: which receives to report failed,
and which ends of a failed receive to pass on to the scheduler.

Pure Python (no vLLM import), so its promises are tested with random event sequences
(tests/test_vllm_ledger.py). The guard's worker calls, once per step:

1. :meth:`FailLedger.order` with the receives the scheduler ordered failed and, where
   the scheduler knows them, the blocks each receive writes into;
2. :meth:`FailLedger.due` with the connector refinement's verdict per ordered receive
   (``"fail"``: report it failed now; ``"wait"``: not yet, ask again next step, e.g. a
   handshake with no transfer posted; ``"drop"``: the transfer just completed, let it
   succeed) - the receives to add to ``failed_recving``: those failed now whose blocks
   the scheduler did not send (the others are reported by their blocks, step 4);
3. :meth:`FailLedger.ends` with the inner connector's ``finished_recving`` and the
   refinement's set of those ends that prove nothing (for example a local timeout
   while the peer may still write) - the ends to pass on to the scheduler, which frees
   the blocks on them;
4. :meth:`FailLedger.take_load_errors` - the blocks of the receives failed this step
   whose blocks the scheduler sent, for ``get_block_ids_with_load_errors``: vLLM's
   scheduler fails a request whose blocks failed to load in the step it hears of them,
   while a ``failed_recving`` reaches it through the multiprocess executor only with
   the request's ``finished_recving`` (docs/vllm.md, "The client is answered at the
   deadline"). Such a receive is not put in ``failed_recving`` as well: the executor
   would hold that back and hand it to the scheduler with the receive's end, where it
   would read as the transfer having ended in error.

Promises:

* a receive is reported failed at most once, and only if it was ordered;
* it is reported failed either in ``failed_recving`` or by its blocks (as load
  errors), never both; its blocks at most once, in the step it fails, and never for a
  receive that did not fail;
* the end of a receive reported failed is passed on only when the connector proved
  it (an end not in *unproven*), never before; withheld ends stay withheld (its blocks
  stay quarantined) until a proven end comes;
* the end of any other receive is passed on unchanged, in the step it comes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
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
        #: ordered receives' blocks (as the scheduler sent them), until reported failed
        self.blocks: dict[str, tuple[int, ...]] = {}
        #: blocks of the receives reported failed, not yet taken
        self.load_errors: set[int] = set()

    def order(self, rids: Iterable[str], blocks: Mapping[str, Sequence[int]] | None = None) -> None:
        """The scheduler ordered *rids* failed (a receive already failed is ignored);
        *blocks*: the blocks each receive writes into, where the scheduler knows them."""
        for rid in rids:
            if rid not in self.failed:
                self.ordered.add(rid)
                if blocks and rid in blocks:
                    self.blocks[rid] = tuple(blocks[rid])

    def due(self, verdict: Callable[[str], Verdict]) -> set[str]:
        """Fail the ordered receives the verdict says to fail this step (each once);
        returns those to report in ``failed_recving`` (the ones without blocks)."""
        out: set[str] = set()
        for rid in tuple(self.ordered):
            v = verdict(rid)
            if v == "wait":
                continue
            self.ordered.discard(rid)
            ids = self.blocks.pop(rid, ())
            if v == "fail":
                self.failed.add(rid)
                if ids:
                    self.load_errors.update(ids)
                else:
                    out.add(rid)
        return out

    def take_load_errors(self) -> set[int]:
        """The blocks of the receives reported failed since the last call (each once)."""
        out, self.load_errors = self.load_errors, set()
        return out

    def ends(self, finished: Iterable[str], unproven: Iterable[str] = ()) -> set[str]:
        """Of the inner connector's *finished* receives, those to pass on: all but the
        failed ones whose end is in *unproven* (withheld: their blocks stay held)."""
        weak = set(unproven)
        out: set[str] = set()
        for rid in finished:
            self.ordered.discard(rid)  # ended: nothing left to fail
            self.blocks.pop(rid, None)
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
