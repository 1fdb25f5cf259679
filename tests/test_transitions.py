"""stallguard.transitions: deadlines on real `transitions` machines (Machine, LockedMachine,
AsyncMachine), driven by a FakeClock."""

from __future__ import annotations

import asyncio
import enum
import logging
from functools import partial

import anyio
import pytest
from transitions import Machine
from transitions.extensions import HierarchicalMachine, LockedMachine
from transitions.extensions.asyncio import AsyncMachine

import stallguard as sg
import stallguard.transitions as sgt
from stallguard.testing import FakeClock, record_expiries

STATES = ["Queued", "Bootstrapping", "Transferring", "Success", "Failed"]
SPEC = sg.Spec(
    name="transfer",
    deadlines={"Queued": None, "Bootstrapping": 300, "Transferring": 120},
    terminal=["Success", "Failed"],
)
SAFETY = 10  # seconds: only guards against a hang


class Transfer:
    def __init__(self, name: str = "") -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<Transfer {self.name}>"


def build(cls: type[Machine] = Machine, **kwargs: object) -> Machine:
    machine = cls(model=None, states=STATES, initial="Queued", **kwargs)
    machine.add_transition("bootstrap", "Queued", "Bootstrapping")
    machine.add_transition("transfer", "Bootstrapping", "Transferring")
    machine.add_transition("succeed", "Transferring", "Success")
    machine.add_transition("fail", "*", "Failed")
    machine.add_transition("retry", "Failed", "Queued")
    return machine


def test_every_state_change_is_observed() -> None:
    clock = FakeClock()
    machine = build()
    early = Transfer("early")
    machine.add_model(early)
    early.bootstrap()
    wd = sgt.attach(machine, SPEC, clock=clock)
    # a model already on the machine: tracked from its current state
    assert wd.state_of(id(early)) == "Bootstrapping"
    late = Transfer("late")
    machine.add_model(late)  # the initial state of a model added later
    assert wd.state_of(id(late)) == "Queued"
    late.bootstrap()  # a transition
    assert wd.state_of(id(late)) == "Bootstrapping"
    late.to_Transferring()  # an auto transition
    assert wd.state_of(id(late)) == "Transferring"
    machine.set_state("Bootstrapping", model=late)  # a direct set_state
    assert wd.state_of(id(late)) == "Bootstrapping"
    machine.set_state("Queued")  # set_state on every model
    assert wd.state_of(id(late)) == wd.state_of(id(early)) == "Queued"
    late.to_Bootstrapping()
    late.transfer()
    late.succeed()  # terminal: untracked
    assert id(late) not in wd and len(wd) == 1


def test_expiry_fires_the_trigger_on_the_overdue_model_only() -> None:
    clock = FakeClock()
    machine = build()
    wd = sgt.attach(machine, SPEC, clock=clock)
    stuck, healthy, waiting = Transfer("stuck"), Transfer("healthy"), Transfer("waiting")
    machine.add_model([stuck, healthy, waiting])
    stuck.bootstrap()
    stuck.transfer()
    healthy.bootstrap()
    clock.advance(100)
    healthy.transfer()  # enters Transferring 100 s after stuck did
    with record_expiries() as seen:
        assert wd.check(clock() + 19) == []
        clock.advance(20)
        [expiry] = wd.check()
    assert (expiry.key, expiry.state, expiry.elapsed) == (id(stuck), "Transferring", 120.0)
    assert seen == [expiry]
    assert (stuck.state, healthy.state, waiting.state) == ("Failed", "Transferring", "Queued")
    assert wd.expired(id(stuck))
    clock.advance(1000)
    [second] = wd.check()  # exactly once: only healthy, now overdue too
    assert second.key == id(healthy) and healthy.state == "Failed"
    assert waiting.state == "Queued" and wd.check() == []


def test_a_model_that_moves_on_after_concluding_is_tracked_again() -> None:
    clock = FakeClock()
    machine = build()
    wd = sgt.attach(machine, SPEC, clock=clock)
    model = Transfer()
    machine.add_model(model)
    model.bootstrap()
    clock.advance(300)
    assert [e.key for e in wd.check()] == [id(model)] and model.state == "Failed"
    model.retry()  # a real state change by the machine is never a late event
    assert wd.state_of(id(model)) == "Queued"
    model.bootstrap()
    clock.advance(300)
    assert [e.key for e in wd.check()] == [id(model)]


def test_callback_instead_of_trigger() -> None:
    clock = FakeClock()
    machine = build()
    calls: list[tuple[Transfer, sg.Expiry[object]]] = []
    wd = sgt.attach(machine, SPEC, clock=clock, callback=lambda model, e: calls.append((model, e)))
    model = Transfer()
    machine.add_model(model)
    model.bootstrap()
    clock.advance(300)
    [expiry] = wd.check()
    assert calls == [(model, expiry)]
    assert model.state == "Bootstrapping"  # the callback chose not to change it


def test_a_callback_that_finds_the_model_ended_withdraws_the_expiry() -> None:
    """The callback sees (under the application's own synchronization) that the model
    had finished when its deadline fired, and returns stallguard.CONCLUDED: nobody is
    told it was failed."""
    clock = FakeClock()
    machine = build()
    finished: set[int] = set()

    def callback(model: Transfer, expiry: sg.Expiry[object]) -> object:
        return sg.CONCLUDED if id(model) in finished else model.fail()

    wd = sgt.attach(machine, SPEC, clock=clock, callback=callback)
    done, stuck = Transfer("done"), Transfer("stuck")
    for model in (done, stuck):
        machine.add_model(model)
        model.bootstrap()
    finished.add(id(done))  # it ended; the machine has not been told yet
    clock.advance(300)
    with record_expiries() as recorded:
        got = wd.check()
    assert [e.key for e in got] == [id(stuck)] == [e.key for e in recorded]
    assert stuck.state == "Failed" and done.state == "Bootstrapping"
    assert not wd.expired(id(done)) and wd.expired(id(stuck))


def test_no_trigger_and_report_mode() -> None:
    clock = FakeClock()
    machine = build()
    wd = sgt.attach(machine, SPEC, clock=clock, mode="report")
    model = Transfer()
    machine.add_model(model)
    model.bootstrap()
    clock.advance(300)
    with record_expiries() as seen:
        wd.check()
    assert [e.mode for e in seen] == ["report"]
    assert model.state == "Bootstrapping" and id(model) in wd  # reported, not failed

    machine2 = build()
    wd2 = sgt.attach(machine2, SPEC, clock=clock, on_expire_trigger=None)
    other = Transfer()
    machine2.add_model(other)
    other.bootstrap()
    clock.advance(300)
    [_] = wd2.check()
    assert other.state == "Bootstrapping" and wd2.expired(id(other))


def test_removed_models_are_forgotten_and_their_leftover_triggers_ignored() -> None:
    clock = FakeClock()
    machine = build()
    wd = sgt.attach(machine, SPEC, clock=clock)
    model = Transfer()
    machine.add_model(model)
    model.bootstrap()
    machine.remove_model(model)
    assert len(wd) == 0
    model.transfer()  # transitions keeps the trigger on the model: not tracked again
    assert len(wd) == 0
    clock.advance(1000)
    assert wd.check() == [] and model.state == "Transferring"
    machine.add_model(model, initial="Bootstrapping")  # back on the machine
    assert wd.state_of(id(model)) == "Bootstrapping"


def test_key_attribute_and_collisions() -> None:
    clock = FakeClock()
    machine = build()
    wd = sgt.attach(machine, SPEC, clock=clock, key="name")
    machine.add_model(Transfer("r1"))
    assert wd.state_of("r1") == "Queued"
    with pytest.raises(sg.ConfigError, match=r"key 'r1' of model <Transfer r1> is already used"):
        machine.add_model(Transfer("r1"))
    with pytest.raises(sg.ConfigError, match=r"key 'r2' .* is already used"):
        machine.add_model([Transfer("r2"), Transfer("r2")])
    assert len(machine.models) == 1 and len(wd) == 1
    other = build()
    wd2 = sgt.attach(other, SPEC, clock=clock, key=lambda m: ("k", m.name))
    other.add_model(Transfer("x"))
    assert wd2.state_of(("k", "x")) == "Queued"
    with pytest.raises(sg.ConfigError, match=r"key must be None \(id\(model\)\)"):
        sgt.attach(build(), SPEC, key=3)  # type: ignore[arg-type]


def test_enum_states() -> None:
    class S(enum.Enum):
        Queued = 0
        Transferring = 1
        Done = 2
        Failed = 3

    clock = FakeClock()
    machine = Machine(model=None, states=S, initial=S.Queued)
    machine.add_transition("go", S.Queued, S.Transferring)
    machine.add_transition("fail", "*", S.Failed)
    spec = sg.Spec(  # labels match the machine's state names; either form works
        name="enum", deadlines={S.Queued: None, "Transferring": 5}, terminal=[S.Done, "Failed"]
    )
    wd = sgt.attach(machine, spec, clock=clock)
    model = Transfer()
    machine.add_model(model)
    model.go()
    assert wd.state_of(id(model)) == "Transferring"
    clock.advance(5)
    [expiry] = wd.check()
    assert model.state is S.Failed and expiry.state_label == "Transferring"


def test_locked_machine() -> None:
    clock = FakeClock()
    machine = build(LockedMachine)
    wd = sgt.attach(machine, SPEC, clock=clock)
    model = Transfer()
    machine.add_model(model)
    model.bootstrap()
    clock.advance(300)
    [_] = wd.check()
    assert model.state == "Failed"


def test_one_watchdog_for_several_machines() -> None:
    clock = FakeClock()
    first, second = build(), build()
    wd = sgt.attach(first, SPEC, clock=clock)
    assert sgt.attach(second, watchdog=wd) is wd
    a, b = Transfer("a"), Transfer("b")
    first.add_model(a)
    second.add_model(b)
    a.bootstrap()
    b.bootstrap()
    clock.advance(300)
    assert {e.key for e in wd.check()} == {id(a), id(b)}
    assert a.state == b.state == "Failed"


def test_detach_restores_the_machine() -> None:
    clock = FakeClock()
    machine = build()
    wd = sgt.attach(machine, SPEC, clock=clock)
    model = Transfer()
    machine.add_model(model)
    assert sgt.detach(machine) is True
    assert "set_state" not in vars(machine) and "add_model" not in vars(machine)
    assert len(wd) == 0
    model.bootstrap()
    machine.add_model(Transfer())
    assert len(wd) == 0
    assert sgt.detach(machine) is False
    assert sgt.attach(machine, SPEC, clock=clock) is not wd  # can be attached again


def test_a_trigger_refused_by_a_condition_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    machine = build()
    machine.add_transition("abort", "*", "Failed", conditions=lambda: False)
    wd = sgt.attach(machine, SPEC, clock=clock, on_expire_trigger="abort")
    model = Transfer()
    machine.add_model(model)
    model.bootstrap()
    clock.advance(300)
    with caplog.at_level(logging.WARNING, logger="stallguard"):
        [_] = wd.check()
    assert model.state == "Bootstrapping"
    assert "trigger 'abort' on expired model <Transfer > did not run" in caplog.text


# --------------------------------------------------------------------------- validation


def test_spec_states_the_machine_lacks_are_refused() -> None:
    spec = SPEC.evolve(deadlines={**SPEC.deadlines, "Decoding": 10, "Prefilling": 5})
    with pytest.raises(sg.ConfigError) as caught:
        sgt.attach(build(name="kv"), spec)
    assert str(caught.value) == (
        "spec 'transfer' declares states that machine 'kv' lacks: ['Decoding', 'Prefilling']; "
        "the machine's states are ['Bootstrapping', 'Failed', 'Queued', 'Success', "
        "'Transferring']"
    )


def test_machine_states_the_spec_lacks_are_refused() -> None:
    machine = Machine(model=None, states=["Transferring", "Success", "Failed"])  # + 'initial'
    machine.add_transition("fail", "*", "Failed")
    spec = sg.Spec(name="t", deadlines={"Transferring": 5}, terminal=["Success", "Failed"])
    with pytest.raises(sg.ConfigError, match=r"does not declare: \['initial'\]"):
        sgt.attach(machine, spec)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"on_expire_trigger": "abort"},
            r"on_expire_trigger 'abort' is not a trigger of .*; its triggers are \['bootstrap'",
        ),
        (
            {"on_expire_trigger": "succeed"},
            r"on_expire_trigger 'succeed' has no transition from \['Bootstrapping'\], where "
            r"spec 'transfer' can expire a model; add one, e.g. "
            r"machine.add_transition\('succeed', source='\*', dest='Failed'\)",
        ),
        ({"on_expire_trigger": 3}, r"on_expire_trigger must be a trigger name or None, got 3"),
        (
            {"on_expire_trigger": "fail", "callback": print},
            r"pass either on_expire_trigger \('fail'\) or callback",
        ),
        ({"callback": 3}, r"callback must be callable, got 3"),
        ({"loop": 3}, r"loop must be an asyncio event loop, got 3"),
        # issue 10: these raised a raw TypeError from inside a weak dictionary
        ({"watchdog": 3}, r"watchdog must be a stallguard.Watchdog returned by attach\(\), got 3"),
        ({"watchdog": "wd"}, r"watchdog must be a stallguard.Watchdog .*got 'wd'"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(sg.ConfigError, match=message):
        sgt.attach(build(), SPEC, **kwargs)  # type: ignore[arg-type]


def test_a_key_function_returning_an_unhashable_key_is_refused() -> None:
    machine = build()
    sgt.attach(machine, SPEC, key=lambda model: [model.name], clock=FakeClock())
    with pytest.raises(sg.ConfigError, match=r"key\(model\) returned \['a'\] for model "):
        machine.add_model(Transfer("a"))
    assert machine.models == []  # refused before transitions registered it


def test_lifetime_makes_every_deadlined_state_expirable() -> None:
    machine = build()
    machine.add_transition("cancel", ["Bootstrapping", "Transferring"], "Failed")
    with pytest.raises(sg.ConfigError, match=r"'cancel' has no transition from \['Queued'\]"):
        sgt.attach(machine, SPEC.evolve(lifetime=900), on_expire_trigger="cancel")
    assert sgt.attach(machine, SPEC, on_expire_trigger="cancel") is not None


def test_refusals() -> None:
    machine = build()
    sgt.attach(machine, SPEC)
    with pytest.raises(sg.ConfigError, match=r"is already attached to a watchdog"):
        sgt.attach(machine, SPEC)
    with pytest.raises(sg.ConfigError, match=r"machine must be a transitions.Machine"):
        sgt.attach(object(), SPEC)  # type: ignore[arg-type]
    with pytest.raises(sg.ConfigError, match=r"HierarchicalMachine, which .* not support"):
        sgt.attach(HierarchicalMachine(model=None, states=STATES, initial="Queued"), SPEC)
    with pytest.raises(sg.ConfigError, match=r"was not created by stallguard.transitions.attach"):
        sgt.attach(build(), watchdog=sg.Watchdog(SPEC))
    wd = sgt.attach(build(), SPEC)
    with pytest.raises(sg.ConfigError, match=r"clock, mode cannot be given with an existing"):
        sgt.attach(build(), watchdog=wd, clock=FakeClock(), mode="report")
    with pytest.raises(sg.ConfigError, match=r"spec 'other' differs from the spec of watchdog"):
        sgt.attach(build(), SPEC.evolve(name="other"), watchdog=wd)
    with pytest.raises(sg.ConfigError, match=r"spec must be a stallguard.Spec, got None"):
        sgt.attach(build())


# --------------------------------------------------------------------------- AsyncMachine


def build_async() -> AsyncMachine:
    return build(AsyncMachine)  # type: ignore[return-value]


class ScriptedWait:
    """Stands in for the runner's real-time wait: advances the FakeClock by the timeout."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    async def __call__(self, wake: anyio.Event, timeout: float | None) -> None:
        if timeout is None:
            await wake.wait()
        else:
            self.clock.advance(timeout)
            await anyio.lowlevel.checkpoint()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.anyio
async def test_a_runner_fails_models_of_a_plain_machine() -> None:
    clock = FakeClock()
    machine = build()
    wd = sgt.attach(machine, SPEC, clock=clock)
    stuck, done = Transfer("stuck"), Transfer("done")
    machine.add_model([stuck, done])
    with anyio.fail_after(SAFETY):
        async with sg.watching(wd, wait=ScriptedWait(clock)):
            stuck.bootstrap()  # wakes the runner: the first deadline
            done.bootstrap()
            done.transfer()
            done.succeed()
            while stuck.state != "Failed":
                await anyio.sleep(0)
    assert wd.expired(id(stuck)) and done.state == "Success" and not wd.expired(id(done))


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # AsyncMachine is asyncio-only
@pytest.mark.anyio
async def test_async_machine_a_stuck_transition_is_failed_by_the_runner() -> None:
    clock = FakeClock()
    machine = build_async()
    never = asyncio.Event()
    entered = anyio.Event()

    async def hang(*args: object) -> None:
        entered.set()
        await never.wait()  # a transfer callback that never returns

    machine.on_enter_Transferring(hang)
    wd = sgt.attach(machine, SPEC, clock=clock)
    model = Transfer("stuck")
    machine.add_model(model)
    await model.bootstrap()
    with anyio.fail_after(SAFETY):
        async with anyio.create_task_group() as tg:
            stuck = asyncio.ensure_future(model.transfer())
            await entered.wait()
            assert model.state == "Transferring"
            await tg.start(partial(sg.run_watchdog, wd, wait=ScriptedWait(clock)))
            # the runner expires the model at 120 s and schedules `await model.fail()`,
            # which cancels the hung transition (AsyncMachine's own rule)
            assert await stuck is False
            while model.state != "Failed":
                await anyio.sleep(0)
            tg.cancel_scope.cancel()
    assert wd.expired(id(model)) and len(wd) == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_async_machine_checked_from_a_thread_needs_the_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    loop = asyncio.get_running_loop()
    machine = build_async()
    wd = sgt.attach(machine, SPEC, clock=clock, loop=loop)
    model = Transfer()
    machine.add_model(model)
    await model.bootstrap()
    clock.advance(300)
    [_] = await anyio.to_thread.run_sync(wd.check)  # like a WatchdogThread would
    with anyio.fail_after(SAFETY):
        while model.state != "Failed":
            await anyio.sleep(0)

    # without loop=, the expiry is still decided, and the failure to fire is reported
    machine2 = build_async()
    wd2 = sgt.attach(machine2, SPEC, clock=clock)
    other = Transfer()
    machine2.add_model(other)
    await other.bootstrap()
    clock.advance(300)
    with caplog.at_level(logging.ERROR, logger="stallguard"):
        [_] = await anyio.to_thread.run_sync(wd2.check)
    assert wd2.snapshot().hook_errors == 1 and other.state == "Bootstrapping"
    assert "check() ran outside an asyncio event loop" in caplog.text
    assert "pass attach(loop=...)" in caplog.text


def test_machine_as_its_own_model_and_a_custom_model_attribute() -> None:
    clock = FakeClock()
    machine = Machine(states=STATES, initial="Queued", model_attribute="status")
    machine.add_transition("bootstrap", "Queued", "Bootstrapping")
    machine.add_transition("fail", "*", "Failed")
    wd = sgt.attach(machine, SPEC, clock=clock)
    assert wd.state_of(id(machine)) == "Queued"
    machine.bootstrap()
    clock.advance(300)
    [expiry] = wd.check()
    assert expiry.key == id(machine) and machine.status == "Failed"


def test_the_module_uses_the_real_transitions_library() -> None:
    import transitions

    assert sgt.transitions is transitions
    assert transitions.Machine is Machine
