"""A poll loop with one request that stalls, and stallguard failing it.

Run it: ``python examples/stalled_request.py``

Three fake "KV senders" move through SGLang-like phases. Two finish; one stops in
Transferring (think: its decode peer froze). Without stallguard the loop would wait for it
forever; with it, the guarded ``poll()`` returns Failed once Transferring has lasted longer
than its deadline, and the loop concludes the request the way it concludes any failure.
"""

from __future__ import annotations

import logging
import time

import stallguard

FAILED, BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS = range(5)
NAMES = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}

SPEC = stallguard.Spec(
    name="kv_sender",
    deadlines={"Bootstrapping": 2.0, "WaitingForInput": 1.0, "Transferring": 0.5},
    terminal=["Success", "Failed"],
)
watchdog = stallguard.Watchdog(SPEC)


class Sender:
    """Stands in for a transfer backend's sender: it advances one phase per ``step``
    polls, except that a stuck sender never leaves Transferring."""

    def __init__(self, room: int, *, step: int, stuck: bool = False) -> None:
        self.room, self.step, self.stuck, self.polls = room, step, stuck, 0

    @watchdog.guard(key=lambda self: self.room, failed=FAILED, state=NAMES)
    def poll(self) -> int:
        self.polls += 1
        phase = min(BOOTSTRAPPING + self.polls // self.step, SUCCESS)
        return min(phase, TRANSFERRING) if self.stuck else phase


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    inflight = [Sender(1, step=3), Sender(2, step=4, stuck=True), Sender(3, step=5)]
    started = time.monotonic()
    while inflight and time.monotonic() - started < 10:
        still = []
        for sender in inflight:
            state = sender.poll()
            if state == SUCCESS:
                print(f"room {sender.room}: Success after {sender.polls} polls")
            elif state == FAILED:
                print(f"room {sender.room}: Failed by stallguard after {sender.polls} polls")
            else:
                still.append(sender)
        inflight = still
        time.sleep(0.05)  # the scheduler loop's interval
    print(f"inflight at the end: {len(inflight)}; watchdog tracks {len(watchdog)}")
    return 0 if not inflight else 1


if __name__ == "__main__":
    raise SystemExit(main())
