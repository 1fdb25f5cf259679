"""Per-state deadlines in an async program, on asyncio or trio, with no thread or timer
per request.

A handful of simulated KV transfers run as tasks: Bootstrapping -> Transferring ->
Success. One of them hangs in Transferring (its peer went away). One reports its progress
from a worker thread, as transfer engines' callbacks do. ``stallguard.watching`` runs the
watchdog in the background: it sleeps until the earliest deadline, is woken early when an
earlier one appears (from any thread), and fails the hung transfer by cancelling its task,
which is how this program fails a request.

Run: ``python examples/anyio_runner.py --backend trio`` (or asyncio; about half a second).
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

import anyio

import stallguard

SPEC = stallguard.Spec(
    name="kv_sender",
    deadlines={"Bootstrapping": 1.0, "Transferring": 0.3},
    terminal=["Success", "Failed"],
)
STEP = 0.02  # how long a healthy transfer spends in each state (well under its deadline)


async def main(backend: str) -> int:
    scopes: dict[str, anyio.CancelScope] = {}
    outcome: dict[str, str] = {}

    def fail(expiry: stallguard.Expiry[str]) -> None:
        # on_expire runs on the runner's task, in the event loop: cancel the request's task
        outcome[expiry.key] = f"failed: {expiry.describe()}"
        scopes[expiry.key].cancel()

    watchdog = stallguard.Watchdog(SPEC, on_expire=fail)

    async def transfer(key: str, *, hang: bool = False, from_thread: bool = False) -> None:
        with anyio.CancelScope() as scope:
            scopes[key] = scope
            watchdog.observe(key, "Bootstrapping")
            await anyio.sleep(STEP)
            if from_thread:  # a transfer engine's callback thread reports the progress
                await anyio.to_thread.run_sync(watchdog.observe, key, "Transferring")
            else:
                watchdog.observe(key, "Transferring")
            if hang:
                await anyio.sleep_forever()
            await anyio.sleep(STEP)
            watchdog.observe(key, "Success")
            outcome[key] = "success"
        if scope.cancelled_caught:
            watchdog.observe(key, "Failed")  # harmless: the watchdog already concluded it

    start = time.monotonic()
    async with stallguard.watching(watchdog), anyio.create_task_group() as tg:
        tg.start_soon(transfer, "req-1")
        tg.start_soon(transfer, "req-2")
        tg.start_soon(partial(transfer, "req-3", from_thread=True))
        tg.start_soon(partial(transfer, "req-4", hang=True))
    elapsed = time.monotonic() - start

    print(f"backend: {backend}; all transfers concluded after {elapsed:.2f} s")
    for key in sorted(outcome):
        print(f"  {key}: {outcome[key]}")
    snapshot = watchdog.snapshot()
    print(f"  tracked now: {snapshot.tracked}; expired: {snapshot.expired}")
    expected = {"req-1": "success", "req-2": "success", "req-3": "success"}
    ok = (
        {k: v for k, v in outcome.items() if k != "req-4"} == expected
        and outcome.get("req-4", "").startswith("failed: stallguard: in Transferring")
        and watchdog.expired("req-4")
        and snapshot.expired == 1
        and snapshot.tracked == 0
        and not watchdog.listeners  # the runner let go of the watchdog
    )
    print(f"  check: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    args = parser.parse_args()
    sys.exit(anyio.run(main, args.backend, backend=args.backend))
