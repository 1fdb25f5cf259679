"""The pd_wedge demo's driver-worker pipe (examples/pd_wedge/_rpc.py), without SGLang:
the driver never blocks on a worker that stopped reading (a SIGSTOPped prefill), and
what it sent arrives in order once the worker reads again."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest

from examples.pd_wedge._rpc import Endpoint, WorkerError

PAYLOAD = "x" * 1000  # 300 of these: ~300 KB, far past a pipe's 64 KiB buffer


def test_control_the_flood_does_not_fit_in_the_pipe():
    """What the outbox is for: the 300 messages do not fit in a pipe nobody reads, so a
    plain (blocking) send of them would hang (shown here without blocking: the raw pipe
    set non-blocking refuses the rest)."""
    driver, worker = multiprocessing.Pipe()
    os.set_blocking(driver.fileno(), False)
    with pytest.raises(BlockingIOError):
        for i in range(300):
            driver.send((None, "submit", {"i": i, "pad": PAYLOAD}))
    worker.close()


def test_sending_to_a_worker_that_does_not_read_never_blocks_and_keeps_the_order():
    driver, worker = multiprocessing.Pipe()
    rpc = Endpoint("frozen", driver)
    done = threading.Event()

    def flood() -> None:
        for i in range(300):
            assert rpc.send("submit", i=i, pad=PAYLOAD)
        done.set()

    threading.Thread(target=flood, daemon=True).start()
    # the control: this much does not fit in the pipe, so a blocking send would hang here
    assert done.wait(10), "send() blocked on a worker that is not reading"
    got = [worker.recv() for _ in range(300)]  # the worker "resumes"
    assert [m[2]["i"] for m in got] == list(range(300))
    assert all(m[0] is None and m[1] == "submit" for m in got)


def test_a_call_to_a_frozen_worker_times_out_and_its_answer_is_not_mistaken_later():
    driver, worker = multiprocessing.Pipe()
    rpc = Endpoint("frozen", driver)
    try:
        rpc.call("ping", timeout=0.2)
    except WorkerError as exc:
        assert "no answer to 'ping'" in str(exc)
    else:
        raise AssertionError("a call to a worker that never answers returned")
    late_id, _, _ = worker.recv()
    worker.send((late_id, True, "late"))  # the first call's answer, after its timeout

    def answer() -> None:
        msg_id, command, _ = worker.recv()
        worker.send((msg_id, True, command))

    threading.Thread(target=answer, daemon=True).start()
    assert rpc.call("snapshot", timeout=10) == "snapshot"


def test_a_worker_that_is_gone_is_reported_by_send():
    driver, worker = multiprocessing.Pipe()
    rpc = Endpoint("killed", driver)
    worker.close()
    deadline = time.monotonic() + 10
    while rpc.send("submit", i=0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not rpc.send("submit", i=1)
