"""stallguard.transitions holds machines and models weakly (issue 10, point 10): a machine
that its program drops is garbage-collected with its models, and the watchdog forgets
their requests, so nothing of it expires later. Real ``transitions`` machines throughout.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from transitions import Machine
from transitions.extensions import LockedMachine

import stallguard as sg
import stallguard.transitions as sgt
from stallguard.testing import FakeClock

STATES = ["Queued", "Bootstrapping", "Transferring", "Success", "Failed"]
SPEC = sg.Spec(
    name="transfer_weak",
    deadlines={"Queued": None, "Bootstrapping": 300, "Transferring": 120},
    terminal=["Success", "Failed"],
)
SAFETY = 10  # seconds: only guards against a hang


class Transfer:
    pass


class NoWeakref:
    """A model that cannot be weakly referenced (it has a __dict__ but no __weakref__)."""

    __slots__ = ("__dict__",)


def build(cls: type[Machine] = Machine) -> Machine:
    machine = cls(model=None, states=STATES, initial="Queued")
    machine.add_transition("bootstrap", "Queued", "Bootstrapping")
    machine.add_transition("transfer", "Bootstrapping", "Transferring")
    machine.add_transition("succeed", "Transferring", "Success")
    machine.add_transition("fail", "*", "Failed")
    return machine


def members(wd: sg.Watchdog[object]) -> int:
    return len(sgt._ROUTERS[wd].members)


@pytest.mark.parametrize("cls", [Machine, LockedMachine])
def test_a_dropped_machine_is_collected_with_its_models_and_forgotten(cls) -> None:
    clock = FakeClock()
    expired: list[object] = []
    machine = build(cls)
    wd = sgt.attach(machine, SPEC, clock=clock, callback=lambda m, e: expired.append(m))
    models = [Transfer() for _ in range(3)]
    for model in models:
        machine.add_model(model)
    models[0].bootstrap()
    models[1].bootstrap()
    models[1].transfer()
    assert len(wd) == 3
    refs = [weakref.ref(machine), *map(weakref.ref, models)]
    del machine, models, model
    gc.collect()
    assert [ref() for ref in refs] == [None] * 4  # the machine and every model
    assert len(wd) == 0 and members(wd) == 0  # their requests are forgotten
    clock.advance(10_000)
    assert wd.check() == [] and expired == []  # nothing of them expires later


def test_collection_while_the_collecting_thread_holds_the_watchdog_lock() -> None:
    # The garbage collector runs at any allocation, possibly inside the watchdog's locked
    # section: forgetting (which takes the lock) is then handed to a helper thread.
    lock = getattr(sg.Watchdog(SPEC), "_lock", None)
    if lock is None:  # pragma: no cover - the watchdog's internals changed
        pytest.skip("the watchdog has no _lock to hold")
    machine = build()
    wd = sgt.attach(machine, SPEC, clock=FakeClock())
    model = Transfer()
    machine.add_model(model)
    ref = weakref.ref(machine)
    del machine, model
    with wd._lock:  # type: ignore[attr-defined]
        gc.collect()  # the finalizer runs here; forgetting now would deadlock
        assert ref() is None
    for thread in threading.enumerate():
        if thread.name == "stallguard-transitions-forget":
            thread.join(SAFETY)
    assert len(wd) == 0 and members(wd) == 0


def test_dropping_one_machine_keeps_the_others_models() -> None:
    clock = FakeClock()
    first, second = build(), build()
    wd = sgt.attach(first, SPEC, clock=clock)
    sgt.attach(second, watchdog=wd)
    kept = Transfer()
    second.add_model(kept)
    first.add_model(Transfer())
    kept.bootstrap()
    assert len(wd) == 2
    del first
    gc.collect()
    assert len(wd) == 1 and wd.state_of(id(kept)) == "Bootstrapping"
    clock.advance(300)
    assert [e.key for e in wd.check()] == [id(kept)]
    assert kept.state == "Failed"  # the surviving machine's trigger still fires


def test_detach_still_works_and_lets_the_machine_go() -> None:
    machine = build()
    wd = sgt.attach(machine, SPEC, clock=FakeClock())
    model = Transfer()
    machine.add_model(model)
    assert sgt.detach(machine) is True and len(wd) == 0
    assert "set_state" not in vars(machine)
    ref = weakref.ref(machine)
    del machine, model
    gc.collect()
    assert ref() is None
    assert len(wd) == 0


def test_a_model_that_cannot_be_weakly_referenced_is_held_until_removed() -> None:
    machine = build()
    wd = sgt.attach(machine, SPEC, clock=FakeClock())
    model = NoWeakref()
    machine.add_model(model)
    model.bootstrap()
    assert wd.state_of(id(model)) == "Bootstrapping"
    ref = weakref.ref(machine)
    machine.remove_model(model)  # what lets the machine go (as would detach())
    del machine, model
    gc.collect()
    assert ref() is None and len(wd) == 0


class Machines(RuleBasedStateMachine):
    """Random machines sharing one watchdog: models added, moved, removed; machines
    dropped. After every step the watchdog tracks exactly the live, non-terminal models
    of the live machines; a dropped machine and its models are collected."""

    def __init__(self) -> None:
        super().__init__()
        # Everything older than this example is frozen out of the collector's sight, so
        # each gc.collect() below scans only this example's objects (fast).
        gc.freeze()
        self.clock = FakeClock()
        self.wd: sg.Watchdog[object] | None = None
        self.machines: list[Machine] = []
        self.models: dict[int, list[Transfer]] = {}  # machine index -> its models
        self.dropped: list[weakref.ref[object]] = []

    @rule()
    def new_machine(self) -> None:
        machine = build()
        if self.wd is None:
            self.wd = sgt.attach(machine, SPEC, clock=self.clock)
        else:
            sgt.attach(machine, watchdog=self.wd)
        self.machines.append(machine)
        self.models[id(machine)] = []

    @precondition(lambda self: self.machines)
    @rule(data=st.data())
    def add_model(self, data: st.DataObject) -> None:
        machine = data.draw(st.sampled_from(self.machines))
        model = Transfer()
        machine.add_model(model)
        self.models[id(machine)].append(model)

    @precondition(lambda self: any(self.models.values()))
    @rule(data=st.data(), trigger=st.sampled_from(["bootstrap", "transfer", "succeed", "fail"]))
    def move(self, data: st.DataObject, trigger: str) -> None:
        model = data.draw(st.sampled_from([m for ms in self.models.values() for m in ms]))
        if getattr(model, f"may_{trigger}")():
            getattr(model, trigger)()

    @precondition(lambda self: any(self.models.values()))
    @rule(data=st.data())
    def remove_model(self, data: st.DataObject) -> None:
        machine = data.draw(st.sampled_from([m for m in self.machines if self.models[id(m)]]))
        model = self.models[id(machine)].pop()
        machine.remove_model(model)

    @precondition(lambda self: self.machines)
    @rule(data=st.data())
    def drop_machine(self, data: st.DataObject) -> None:
        machine = data.draw(st.sampled_from(self.machines))
        self.machines.remove(machine)
        models = self.models.pop(id(machine))
        self.dropped.append(weakref.ref(machine))
        self.dropped.extend(weakref.ref(m) for m in models)
        del machine, models
        gc.collect()

    @invariant()
    def tracks_exactly_the_live_models(self) -> None:
        assert all(ref() is None for ref in self.dropped)
        if self.wd is None:
            return
        live = [m for ms in self.models.values() for m in ms if m.state not in SPEC.terminal]
        assert len(self.wd) == len(live)
        assert all(self.wd.state_of(id(m)) == m.state for m in live)

    def teardown(self) -> None:
        gc.unfreeze()


Machines.TestCase.settings = settings(max_examples=40, stateful_step_count=20, deadline=None)
TestMachines = Machines.TestCase
