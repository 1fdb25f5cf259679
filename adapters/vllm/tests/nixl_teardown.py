"""Does tearing the peer down stop a late transfer? Raw NIXL agents (UCX over TCP on
loopback, DRAM), no vLLM; run in .venv-vllm by test_vllm_real.py:

    python nixl_teardown.py OUT.json

D READs 16 MiB from P; P is SIGSTOPped (every thread) so the READ stays ``PROC``; D
tears P down (``remove_remote_agent``, NIXL's way to invalidate a peer); D polls the
handle; D gives the destination buffer to a "new owner" (a sentinel value); P resumes.
Recorded: the handle's state after the teardown, and how many of the new owner's bytes
changed, and whether they are P's data. (stallguard's quarantine treats neither a
released handle nor a removed agent as proof that a transfer is over.)
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import time
from typing import Any

from stallguard.testing import stop_and_wait

os.environ.setdefault("UCX_TLS", "tcp,self")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
N = 1 << 22  # float32 elements: 16 MiB
SENTINEL = -7.0


def _prefill(qm: Any, qd: Any, ev: Any) -> None:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    P = nixl_agent("P", nixl_agent_config(num_threads=1))
    src = torch.arange(N, dtype=torch.float32) + 1.0  # P's data: 1..N, never the sentinel
    P.register_memory(src)
    qm.put(P.get_agent_metadata())
    qd.put(P.get_serialized_descs(P.get_xfer_descs(src)))
    ev.wait()
    while True:
        P.get_new_notifs()
        time.sleep(0.01)


def _poll(D: Any, h: Any) -> str:
    try:
        return str(D.check_xfer_state(h))
    except Exception as e:  # NIXL raises once the remote agent is gone
        return f"raised {type(e).__name__}"


def main() -> None:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    out_path = sys.argv[1]
    ctx = mp.get_context("spawn")
    qm, qd, ev = ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_prefill, args=(qm, qd, ev), daemon=True)
    p.start()
    out: dict[str, Any] = {}
    try:
        D = nixl_agent("D", nixl_agent_config(num_threads=1))
        dst = torch.zeros(N, dtype=torch.float32)
        D.register_memory(dst)
        name = D.add_remote_agent(qm.get(timeout=120))
        remote = D.deserialize_descs(qd.get(timeout=120))
        ev.set()
        h = D.initialize_xfer("READ", D.get_xfer_descs(dst), remote, "P", b"warm")
        D.transfer(h)
        t0 = time.monotonic()
        while D.check_xfer_state(h) == "PROC" and time.monotonic() - t0 < 60:
            time.sleep(0.01)
        out["warm_read_ok"] = bool((dst == torch.arange(N, dtype=torch.float32) + 1.0).all())
        D.release_xfer_handle(h)
        dst.zero_()
        stop_and_wait(p.pid)
        h = D.initialize_xfer("READ", D.get_xfer_descs(dst), remote, "P", b"late")
        D.transfer(h)
        time.sleep(1.0)
        out["state_before_teardown"] = _poll(D, h)
        out["landed_before_teardown_bytes"] = int((dst != 0).sum()) * 4
        D.remove_remote_agent(name if isinstance(name, str) else "P")
        out["state_after_teardown"] = _poll(D, h)
        dst.fill_(SENTINEL)  # the memory handed to a new owner
        os.kill(p.pid, signal.SIGCONT)
        t1 = time.monotonic()
        first = None
        while time.monotonic() - t1 < 5.0:
            D.get_new_notifs()
            if first is None and bool((dst != SENTINEL).any()):
                first = time.monotonic() - t1
            time.sleep(0.02)
        changed = dst != SENTINEL
        idx = changed.nonzero().flatten()
        out["new_owner_bytes"] = N * 4
        out["new_owner_bytes_changed"] = int(changed.sum()) * 4
        out["changed_bytes_are_prefill_data"] = (
            bool((dst[idx] == idx.to(torch.float32) + 1.0).all()) if len(idx) else None
        )
        out["first_change_after_thaw_s"] = first
    except BaseException as e:
        out["error"] = repr(e)
    finally:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except OSError:
            pass
    with open(out_path, "w") as f:
        json.dump(out, f)
    os._exit(0)


if __name__ == "__main__":
    main()
