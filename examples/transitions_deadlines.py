"""10,000 `transitions` models under per-state deadlines, with no extra thread, next to
what the library's own ``Timeout`` state costs for 1,000.

Both sides run the same machine: Queued -> Bootstrapping -> Transferring -> Success, plus
``fail`` from anywhere to Failed. A few models stall in Transferring; everything else
finishes. Then:

* stallguard (:func:`stallguard.transitions.attach`): one watchdog for all models; the
  stalled ones are failed by the machine's own ``fail`` trigger when this program calls
  ``watchdog.check()``, on its own thread.
* transitions' ``Timeout`` state: a ``threading.Timer`` (an OS thread) per model that
  enters the state; ``on_timeout`` runs on that timer thread.

Printed: threads in use, microseconds per transition (against the same machine without
either), Python memory per model (tracemalloc), resident memory growth, and who failed
the stalled models. The program exits non-zero if stallguard failed a model it should not
have, missed one, or used a thread.

Run: ``python examples/transitions_deadlines.py`` (about 10 s), or ``--quick``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable

from transitions import Machine
from transitions.extensions.states import Timeout, add_state_features

import stallguard
import stallguard.instrumentation
import stallguard.transitions

STATES = ["Queued", "Bootstrapping", "Transferring", "Success", "Failed"]


class Transfer:
    """A model: the machine adds its triggers and its ``state``."""

    def __init__(self, number: int) -> None:
        self.number = number


@add_state_features(Timeout)
class TimeoutMachine(Machine):
    """transitions' Machine whose states accept ``timeout=`` / ``on_timeout=``."""


def build(machine_class: type[Machine] = Machine, states: list[object] | None = None) -> Machine:
    machine = machine_class(
        model=None, states=states or STATES, initial="Queued", auto_transitions=False
    )
    machine.add_transition("bootstrap", "Queued", "Bootstrapping")
    machine.add_transition("transfer", "Bootstrapping", "Transferring")
    machine.add_transition("succeed", "Transferring", "Success")
    machine.add_transition("fail", "*", "Failed")
    machine.add_transition("back", "Transferring", "Bootstrapping")  # for the cost loop
    return machine


def spec(deadline: float) -> stallguard.Spec:
    return stallguard.Spec(
        name="transfer",
        deadlines={"Queued": None, "Bootstrapping": 30, "Transferring": deadline},
        terminal=["Success", "Failed"],
    )


def rss_kib() -> int:
    """Resident memory of this process (Linux), in KiB; 0 where /proc is missing."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_transitions(models: list[Transfer]) -> float:
    """Bootstrap then transfer every model; seconds per transition."""
    start = time.perf_counter()
    for model in models:
        model.bootstrap()
    for model in models:
        model.transfer()
    return (time.perf_counter() - start) / (2 * len(models))


def transition_cost(count: int = 1_000, rounds: int = 7) -> tuple[float, float]:
    """Seconds per transition on the same machine, plain and with stallguard attached:
    Transferring <-> Bootstrapping round trips, the two runs interleaved, best of
    *rounds* (a single pass is at the mercy of whatever else the machine runs)."""
    plain, guarded = build(), build()
    stallguard.transitions.attach(guarded, spec(60))
    pairs = []
    for machine in (plain, guarded):
        models = [Transfer(i) for i in range(count)]
        machine.add_model(models, initial="Bootstrapping")
        pairs.append(models)
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, models in enumerate(pairs):
            start = time.perf_counter()
            for model in models:
                model.transfer()
            for model in models:
                model.back()
            best[i] = min(best[i], (time.perf_counter() - start) / (2 * count))
    return best[0], best[1]


def per_model_bytes(setup: Callable[[int], object], count: int) -> float:
    """Python memory (tracemalloc) held per model after *setup(count)*."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = setup(count)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del kept
    return (after - before) / count


def plain_setup(count: int) -> object:
    machine = build()
    models = [Transfer(i) for i in range(count)]
    machine.add_model(models)
    run_transitions(models)
    return machine, models


def stallguard_setup(count: int) -> object:
    machine = build()
    watchdog = stallguard.transitions.attach(machine, spec(60))
    models = [Transfer(i) for i in range(count)]
    machine.add_model(models)
    run_transitions(models)
    return machine, watchdog, models


def timeout_setup(count: int, timeout: float = 60) -> object:
    machine = build(TimeoutMachine, timeout_states(timeout, lambda *a: None))
    models = [Transfer(i) for i in range(count)]
    machine.add_model(models)
    run_transitions(models)
    for model in models:  # cancel the timers: leave Transferring
        model.succeed()
    return machine, models


def timeout_states(timeout: float, on_timeout: object) -> list[object]:
    return [
        "Queued",
        "Bootstrapping",
        {"name": "Transferring", "timeout": timeout, "on_timeout": on_timeout},
        "Success",
        "Failed",
    ]


def stallguard_side(count: int, deadline: float, stall_every: int, memory_count: int) -> bool:
    print(f"stallguard.transitions: {count:,} models, {deadline:g} s deadline on Transferring")
    failed_on: list[str] = []
    machine = build()
    machine.on_enter_Failed(lambda *a: failed_on.append(threading.current_thread().name))
    watchdog = stallguard.transitions.attach(machine, spec(deadline))
    models = [Transfer(i) for i in range(count)]

    threads_before = threading.active_count()
    machine.add_model(models)

    driving = run_transitions(models)
    threads_waiting = threading.active_count()
    stalled = [m for m in models if m.number % stall_every == 0]
    for model in models:
        if model.number % stall_every:
            model.succeed()
    waiting = len(watchdog)
    time.sleep(deadline)  # let the stalled ones overstay their deadline
    start = time.perf_counter()
    expiries = watchdog.check()  # where the program decides: here, its main thread
    check_ms = (time.perf_counter() - start) * 1e3
    threads_after = threading.active_count()
    plain_per_transition, per_transition = transition_cost()

    plain_bytes = per_model_bytes(plain_setup, memory_count)
    guarded_bytes = per_model_bytes(stallguard_setup, memory_count)

    print(
        f"  threads: {threads_before} before, {threads_waiting} while {count:,} models are "
        f"in flight, {threads_after} after ({threads_waiting - threads_before} extra)"
    )
    print(
        f"  transition: {plain_per_transition * 1e6:.1f} us plain, "
        f"{per_transition * 1e6:.1f} us with stallguard "
        f"({(per_transition - plain_per_transition) * 1e6:+.1f} us; best of 7, 1,000 models); "
        f"{driving * 1e6:.1f} us on average while driving the {count:,} models above"
    )
    print(
        f"  memory: {plain_bytes:,.0f} B/model plain, {guarded_bytes:,.0f} B/model with "
        f"stallguard ({guarded_bytes - plain_bytes:+,.0f} B), tracemalloc, "
        f"{memory_count:,} models"
    )
    healthy_failed = sum(1 for m in models if m.state == "Failed" and m not in stalled)
    print(
        f"  expired: {len(expiries)} of {len(stalled)} stalled models ({waiting} waiting), "
        f"failed by trigger 'fail' on {sorted(set(failed_on))} in one check() of "
        f"{check_ms:.2f} ms; {healthy_failed} healthy models failed"
    )
    ok = (
        {e.key for e in expiries} == {id(m) for m in stalled}
        and all(m.state == "Failed" for m in stalled)
        and healthy_failed == 0
        and threads_waiting == threads_before == threads_after
        and set(failed_on) == {threading.current_thread().name}
        and len(watchdog) == 0
    )
    if expiries:
        print(f"  e.g. {expiries[0].describe()}")
    print(f"  check: {'OK' if ok else 'FAILED'}")
    return ok


def timeout_side(count: int, timeout: float, stall_every: int, memory_count: int) -> None:
    print(f"transitions Timeout state: {count:,} models, {timeout:g} s timeout on Transferring")
    fired_on: list[str] = []
    lock = threading.Lock()

    def on_timeout(*args: object) -> None:
        with lock:
            fired_on.append(threading.current_thread().name)

    machine = build(TimeoutMachine, timeout_states(timeout, on_timeout))
    models = [Transfer(i) for i in range(count)]
    machine.add_model(models)
    threads_before = threading.active_count()
    rss_before = rss_kib()
    for model in models:
        model.bootstrap()
    start = time.perf_counter()
    for model in models:
        model.transfer()  # enters the Timeout state: starts a timer thread
    per_transition = (time.perf_counter() - start) / count
    threads_waiting = threading.active_count()
    rss_grown = rss_kib() - rss_before
    stalled = [m for m in models if m.number % stall_every == 0]
    for model in models:
        if model.number % stall_every:
            model.succeed()  # leaving the state cancels its timer
    deadline = time.monotonic() + timeout + 5
    while len(fired_on) < len(stalled) and time.monotonic() < deadline:
        time.sleep(0.01)
    runner = machine.get_state("Transferring").runner
    timeout_bytes = per_model_bytes(timeout_setup, memory_count)
    print(
        f"  threads: {threads_before} before, {threads_waiting} while {count:,} models are "
        f"in flight ({threads_waiting - threads_before} extra: one timer thread per model)"
    )
    print(
        f"  transition into the Timeout state: {per_transition * 1e6:.1f} us (each starts a thread)"
    )
    print(
        f"  memory: {timeout_bytes:,.0f} B/model (tracemalloc, {memory_count:,} models), "
        f"plus thread stacks: resident memory grew {rss_grown:,} KiB "
        f"({rss_grown / count:.1f} KiB/model)"
    )
    print(
        f"  timed out: {len(fired_on)} of {len(stalled)} stalled models, on_timeout ran on "
        f"{len(set(fired_on))} timer threads, not the program's; the state's timer dict "
        f"still holds {len(runner):,} entries (one per model that ever entered it)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1,000 / 100 models (for tests)")
    parser.add_argument("--models", type=int, help="stallguard models (default 10,000)")
    parser.add_argument("--timeout-models", type=int, help="Timeout models (default 1,000)")
    args = parser.parse_args(argv)
    count = args.models or (1_000 if args.quick else 10_000)
    timeout_count = args.timeout_models or (100 if args.quick else 1_000)
    deadline = 0.1 if args.quick else 0.5
    memory_count = min(count, 2_000)

    # The process-wide expiry hooks (a log line and an OpenTelemetry span per expiry) are
    # switched off here so that check() is timed on its own and the output stays short.
    stallguard.instrumentation.set_on_expire_hooks([])
    ok = stallguard_side(count, deadline, stall_every=100, memory_count=memory_count)
    print()
    timeout = 0.5 if args.quick else 1.0
    timeout_side(timeout_count, timeout, stall_every=100, memory_count=min(timeout_count, 500))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
