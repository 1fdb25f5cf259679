"""Shadow -> advise -> enforce against the REAL SGLang inflight queue, in a fresh process
(run by test_adapter_advice.py; prometheus_client must see PROMETHEUS_MULTIPROC_DIR at
its first import, as in a scheduler process).

Traffic (one FakeClock, real NixlKVSenders over a real NixlKVManager's status plumbing;
the transfer engine is faked as in tests/sglang_support): every 0.1 s two requests enter
the inflight queue in WaitingForInput, move to Transferring after a random wait and to
Success after a random transfer (seeded: the same traffic in every run). One "slow"
request transfers for 25 s and then succeeds; one "stuck" request never leaves
Transferring.
"""

from __future__ import annotations

import io
import random
import sys
from contextlib import redirect_stdout
from typing import Any

import tomllib

T0 = 1000.0
WFI, TRANSFERRING, SUCCESS = 2, 3, 4
STEP = 0.1


def _transfer(rng: random.Random) -> float:
    """Lognormal around 0.37 s, at least two iterations (a state shorter than one
    iteration is never seen by the adapter: its events are applied together)."""
    return max(2 * STEP, rng.lognormvariate(-1.0, 0.6))


def traffic(n: int, seed: int = 7) -> list[tuple[str, float, float, float]]:
    """(rid, enters the queue at, waits in WaitingForInput for, transfers for)."""
    rng = random.Random(seed)
    plan = [
        (f"r{i}", T0 + (i // 2) * STEP, rng.uniform(0.01, 0.3), _transfer(rng)) for i in range(n)
    ]
    plan.append(("slow", T0 + 1.0, 0.05, 25.0))
    plan.append(("stuck", T0 + 2.0, 0.05, float("inf")))
    return plan


def run_traffic(config: dict[str, Any], n: int, extra: float = 0.0) -> dict[str, Any]:
    """Drive *plan* through the real queue with the adapter installed; returns how each
    request ended."""
    import sglang_support as sgs
    from stallguard_sglang.testing import installed

    from stallguard.testing import FakeClock

    clock = FakeClock(T0)
    plan = traffic(n)
    ends = max(t + w + x for _, t, w, x in plan if x != float("inf")) + 5 + extra
    with installed(config, clock=clock):
        sched = sgs.FakeScheduler()
        mgr = sgs.make_manager("nixl")
        pending = sorted(plan, key=lambda p: p[1])
        moves: list[tuple[float, int, Any]] = []  # (at, status, sender)
        while clock() < ends:
            while pending and pending[0][1] <= clock():
                rid, at, wait, transfer = pending.pop(0)
                sender = sgs.make_sender(mgr, sgs.next_room())
                sgs.set_status(sender, WFI)
                sched.prefill(sgs.make_request(rid, sender, prefilled=False))
                moves.append((at + wait, TRANSFERRING, sender))
                if transfer != float("inf"):
                    moves.append((at + wait + transfer, SUCCESS, sender))
            moves.sort(key=lambda m: m[0])
            while moves and moves[0][0] <= clock():
                _, status, sender = moves.pop(0)
                if sender.kv_mgr.request_status.get(sender.bootstrap_room) not in (0, None):
                    sgs.set_status(sender, status)
            sched.step()
            clock.advance(STEP)
        for _ in range(3):  # idle iterations: the last stays are exported
            clock.advance(1.0)
            sched.step()
        outcome = {rid: c.outcome for rid, c in sched.conclusions.items()}
        outcome["__inflight__"] = sched.inflight_rids()
    return outcome


def shadow_advise_enforce(metrics_dir: str, n: int) -> dict[str, Any]:
    """Report mode with generous deadlines, advise from the multiprocess directory, then
    enforce the advised deadlines on the same traffic."""
    import sglang_support as sgs
    from stallguard_sglang import parse_config
    from stallguard_sglang.__main__ import main
    from stallguard_sglang._advise import advise_text, read_source

    sgs.setup_context(0, 1)
    shadow = {
        "prefill": {
            "mode": "report",
            "deadlines": {"Bootstrapping": 300, "WaitingForInput": 10, "Transferring": 20},
        }
    }
    out: dict[str, Any] = {"shadow": run_traffic(shadow, n)}
    text = read_source(multiproc_dir=metrics_dir)
    out["metrics"] = text
    buf = io.StringIO()
    with redirect_stdout(buf):
        out["status"] = main(["advise", "--multiproc-dir", metrics_dir, "--min-samples", "100"])
    out["printed"] = buf.getvalue()
    block = out["printed"].split("# paste into the file STALLGUARD_SGLANG_CONFIG names:\n")[1]
    out["toml"] = block
    config = parse_config(tomllib.loads(block), source="advised")
    out["advised"] = {
        state: d.seconds for state, d in config.prefill.deadlines.items() if d is not None
    }
    advice = advise_text(text, min_samples=100)[("inflight", "nixl")]
    out["suggested"] = advice.deadlines
    out["counts"] = {s: a.count for s, a in advice.states.items()}
    out["fired"] = {s: a.fired for s, a in advice.states.items()}
    out["fired_completed"] = {s: a.fired_completed for s, a in advice.states.items()}
    enforce = {
        "prefill": {
            "mode": "enforce",
            "deadlines": dict(tomllib.loads(block)["prefill"]["deadlines"]),
        }
    }
    # long enough for the longest advised deadline to pass on "stuck"
    out["enforce"] = run_traffic(enforce, n, extra=max(out["advised"].values()))
    out["plan"] = [(rid, w, x) for rid, _, w, x in traffic(n)]
    sgs.teardown_context()
    return out


if __name__ == "__main__":  # pragma: no cover - manual run
    print(shadow_advise_enforce(sys.argv[1], int(sys.argv[2]))["printed"])
