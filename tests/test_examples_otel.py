"""examples/otel_console.py runs as a newcomer would run it and prints the span it
promises. It also covers what the in-process tests cannot without leaking global state:
the default span hook on a *global* TracerProvider installed by the application."""

from __future__ import annotations

import json
from datetime import datetime

from _examples import run_example


def json_objects(text: str) -> list[dict]:
    """The JSON documents printed one after another by ConsoleSpanExporter."""
    decoder = json.JSONDecoder()
    objects, at = [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return objects
        obj, at = decoder.raw_decode(text, at)
        objects.append(obj)


def test_otel_console_example_prints_the_forced_failure_span():
    out = run_example("otel_console.py")
    assert out.returncode == 0, out.stderr
    spans = {span["name"]: span for span in json_objects(out.stdout)}
    assert set(spans) == {"stallguard.forced_failure", "kv_transfer"}
    failure, request = spans["stallguard.forced_failure"], spans["kv_transfer"]

    assert failure["status"]["status_code"] == "ERROR"
    assert failure["status"]["description"] == (
        "stallguard: in Transferring for 121.000s, past its 120s deadline (spec 'kv_sender')"
    )
    assert failure["attributes"] == {
        "sglang.bootstrap_room": 7,
        "sglang.rid": "req-7",
        "stallguard.spec": "kv_sender",
        "stallguard.key": "7",
        "stallguard.state": "Transferring",
        "stallguard.deadline_s": 120.0,
        "stallguard.elapsed_s": 121.0,
        "stallguard.late_s": 1.0,
        "stallguard.reason": "state",
        "stallguard.mode": "enforce",
        "error.type": "state_deadline_exceeded",
    }
    # In the request's trace, as a child of its span.
    assert failure["context"]["trace_id"] == request["context"]["trace_id"]
    assert failure["parent_id"] == request["context"]["span_id"]
    assert failure["resource"]["attributes"]["service.name"] == "prefill-server"
    # Back-dated to the entry into Transferring: 121 s before its end, and 0.5 s (plus
    # the example's own run time) after the request started.
    start = datetime.fromisoformat(failure["start_time"])
    end = datetime.fromisoformat(failure["end_time"])
    assert (end - start).total_seconds() == 121.0
    request_start = datetime.fromisoformat(request["start_time"])
    assert (start - request_start).total_seconds() >= 0.5 - 1e-6

    assert (
        "WARNING stallguard: stallguard forced failure: spec=kv_sender key=7 "
        "state=Transferring reason=state elapsed_s=121.000 deadline_s=120"
    ) in out.stderr
