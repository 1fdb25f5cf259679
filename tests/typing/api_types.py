"""Static checks of the public API's inferred types, run by ``mypy --strict`` (see
tests/test_typing.py); at run time every ``assert_type`` is a no-op. A change that makes
a public name ``Any`` or changes a return type fails here."""

from __future__ import annotations

from typing import Any, assert_type

import stallguard as sg
from stallguard.instrumentation import ExpiryHook, get_on_expire_hooks
from stallguard.testing import FakeClock, record_expiries

spec = sg.Spec("kv", {"Transferring": 120, "Waiting": sg.Deadline(60, stall=5)}, terminal=["Done"])
assert_type(spec.deadlines["Transferring"], sg.Deadline)
assert_type(spec.lifetime, float | None)

options = sg.WatchdogOptions(mode="report", clock=FakeClock())
assert_type(options.mode, sg.Mode)
assert_type(options.memory, int)

wd: sg.Watchdog[int] = sg.Watchdog(spec, options=options, on_expire=lambda e: e.key + 1)
described: sg.Watchdog[int] = sg.Watchdog(spec, describe=lambda key: {"room": key + 1})
assert_type(wd.observe(1, "Transferring"), None)
assert_type(wd.heartbeat(1), bool)
assert_type(wd.forget(1), bool)
assert_type(wd.check(), list[sg.Expiry[int]])
assert_type(wd.next_deadline(), float | None)
assert_type(wd.state_of(1), sg.State | None)
assert_type(wd.mode, sg.Mode)
assert_type(wd.spec, sg.Spec)
assert_type(wd.options, sg.WatchdogOptions)

snapshot = wd.snapshot()
assert_type(snapshot, sg.Snapshot[int])
assert_type(snapshot.requests[0].key, int)
assert_type(snapshot.states["Transferring"].count, int)

listener = wd.add_listener(on_leave=lambda label, seconds: None)
assert_type(listener, sg.Listener)
assert_type(listener.remove(), bool)
assert_type(wd.listeners, tuple[sg.Listener, ...])


def on_expire(expiry: sg.Expiry[int]) -> None:
    assert_type(expiry.key, int)
    assert_type(expiry.reason, sg.Reason)
    assert_type(expiry.describe(), str)


wd.add_listener(on_expire=on_expire)


class Sender:
    room = 7

    def poll(self) -> int:
        return 3


@wd.guard(key=lambda s: s.room, failed=0, state={3: "Transferring", 4: "Done"})
def poll(sender: Sender) -> int:
    return sender.poll()


assert_type(poll(Sender()), int)

with record_expiries() as seen:
    assert_type(seen, list[sg.Expiry[Any]])
assert_type(get_on_expire_hooks(), tuple[ExpiryHook, ...])

config = sg.load_config({"spec": {"kv": {"deadlines": {"Transferring": 120}}}})
assert_type(config, sg.WatchdogConfig)
assert_type(config.watchdog(), sg.Watchdog[Any])
assert_type(sg.parse_deadlines({"Transferring": 120}), dict[sg.State, sg.Deadline])
