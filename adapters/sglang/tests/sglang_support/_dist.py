"""Run a function on N ranks of a real gloo process group, each in a spawned process.

Does not import sglang in the parent: only the children pay that (~8 s each, in parallel).
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from stallguard.testing import free_port

__all__ = ["RankInfo", "RankError", "run_ranks", "free_port"]


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """What `run_ranks` passes to the function as its first argument."""

    rank: int
    world: int
    group: Any  # torch.distributed.ProcessGroup over all ranks (gloo)
    port: int


class RankError(RuntimeError):
    """One or more ranks raised, died, or did not finish in time."""


def _child(conn, fn, rank, world, port, setup, server_args, collective_timeout, args, kwargs):
    status, payload = "err", None
    try:
        import torch.distributed as dist

        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            PORT=str(port),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        timeout = datetime.timedelta(seconds=collective_timeout)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
        group = dist.new_group(list(range(world)), backend="gloo", timeout=timeout)
        if setup:
            from ._core import setup_context

            setup_context(rank, world, **server_args)
        result = fn(RankInfo(rank, world, group, port), *args, **kwargs)
        status, payload = "ok", result
    except BaseException:
        payload = traceback.format_exc()
    try:
        try:
            conn.send((status, payload))
        except Exception:  # unpicklable result
            conn.send(
                ("err", f"rank {rank}: could not send result back:\n{traceback.format_exc()}")
            )
        conn.close()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # NIXL's bootstrap thread is not a daemon and gloo teardown can block: leave now.
        os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world: int = 2,
    *,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float = 120.0,
    collective_timeout: float = 30.0,
    setup: bool = True,
    server_args: dict | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn(RankInfo, *args, **kwargs)` on `world` ranks of a real gloo group
    (`tcp://127.0.0.1:<free port>`), each in a `spawn`ed process, and return the
    per-rank results in rank order.

    `fn` must be a module-level function importable by the children (they get the
    parent's sys.path); results must be picklable. With `setup=True` each child calls
    `setup_context(rank, world, **server_args)` before `fn`. Bounded: a rank that raises
    makes the others be killed after a short grace period, and anything still running
    after `timeout` s is killed; both raise `RankError` with every rank's traceback.
    Collectives time out after `collective_timeout` s inside the children.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    old_env = {}
    for k, v in (env or {}).items():  # children inherit os.environ at spawn
        old_env[k] = os.environ.get(k)
        os.environ[k] = v
    procs, conns = [], {}
    try:
        for rank in range(world):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child,
                name=f"sglang-rank{rank}",
                daemon=True,
                args=(
                    child_conn,
                    fn,
                    rank,
                    world,
                    port,
                    setup,
                    server_args or {},
                    collective_timeout,
                    args,
                    kwargs or {},
                ),
            )
            p.start()
            child_conn.close()
            procs.append(p)
            conns[parent_conn] = rank
    finally:
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    grace_deadline = None
    pending = dict(conns)
    try:
        while pending:
            now = time.monotonic()
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            if now >= limit:
                break
            for conn in wait(list(pending), timeout=limit - now):
                rank = pending.pop(conn)
                try:
                    results[rank] = conn.recv()
                except EOFError:
                    procs[rank].join(1)
                    results[rank] = (
                        "err",
                        f"rank {rank} died without a result (exit code {procs[rank].exitcode})",
                    )
                if results[rank][0] == "err" and grace_deadline is None:
                    grace_deadline = time.monotonic() + 5.0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        for conn in conns:
            conn.close()

    missing = [r for r in range(world) if r not in results]
    errors = {r: payload for r, (status, payload) in results.items() if status != "ok"}
    if missing or errors:
        lines = [f"run_ranks({getattr(fn, '__qualname__', fn)}, world={world}) failed:"]
        for r in missing:
            why = "killed after another rank failed" if errors else f"no result within {timeout}s"
            lines.append(f"--- rank {r}: {why}")
        for r, tb in sorted(errors.items()):
            lines.append(f"--- rank {r} raised:\n{tb}")
        raise RankError("\n".join(lines))
    return [results[r][1] for r in range(world)]
