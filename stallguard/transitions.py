"""Per-state deadlines for `transitions <https://github.com/pytransitions/transitions>`_
state machines, with no thread or timer per model.

:func:`attach` connects a :class:`~stallguard.Spec` to a ``transitions.Machine`` (or an
``AsyncMachine``, or their ``Locked`` variants): every state change of every model is
fed to a :class:`~stallguard.Watchdog`, and when a model overstays a deadline the
watchdog's :meth:`~stallguard.Watchdog.check` fires a trigger (``"fail"`` by default) or
a callback on that model. ``check()`` runs where you choose: from a runner
(:func:`stallguard.run_watchdog`, :class:`stallguard.WatchdogThread`) or from your own
loop. See docs/transitions.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import inspect
import logging
import operator
import threading
import weakref
from collections.abc import Callable, Hashable, Mapping
from typing import Any

try:
    import transitions
    from transitions.core import listify
except ImportError as exc:  # the optional extra is not installed
    if exc.name is None or exc.name.partition(".")[0] != "transitions":
        raise  # something inside transitions failed to import: not a missing extra
    raise ImportError(
        "stallguard.transitions needs the transitions library, which is an optional "
        "extra: pip install 'stallguard[transitions]'",
        name=exc.name,
    ) from exc

from stallguard._details import CONCLUDED, Expiry, Mode
from stallguard._errors import ConfigError, StallguardError
from stallguard._options import WatchdogOptions
from stallguard._spec import Spec, state_label
from stallguard._watchdog import Watchdog

__all__ = ["attach", "detach"]

log = logging.getLogger("stallguard")

_DEFAULT_TRIGGER = "fail"
_UNSET: Any = object()

# watchdog -> the router that hands its expiries to the right model
_ROUTERS: weakref.WeakKeyDictionary[Watchdog[Any], _Router] = weakref.WeakKeyDictionary()
# machine -> its attachment
_ATTACHED: weakref.WeakKeyDictionary[Any, _Attachment] = weakref.WeakKeyDictionary()


class _Strong:
    """Stands in for a weak reference to a model that cannot have one (a class with
    ``__slots__`` and no ``__weakref__``): such a model is held while attached."""

    __slots__ = ("model",)

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self) -> Any:
        return self.model


def _reference(model: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(model)
    except TypeError:
        return _Strong(model)


class _Router:
    """A watchdog's ``on_expire``: finds the model behind an expired key and fires the
    action its machine's attachment configured."""

    def __init__(self) -> None:
        # key -> (attachment, reference to the model). Models are held weakly: a model
        # refers to its machine (its trigger methods are bound to it), so a strong
        # reference here would keep every attached machine alive as long as the watchdog.
        self.members: dict[Hashable, tuple[_Attachment, Callable[[], Any]]] = {}

    def __call__(self, expiry: Expiry[Any]) -> object:
        entry = self.members.get(expiry.key)
        if entry is None:  # removed from its machine between the expiry and this hook
            return CONCLUDED
        attachment, ref = entry
        model = ref()
        if model is None:  # collected: nothing left to fail
            return CONCLUDED
        return attachment.fire(model, expiry)


def _key_function(key: object) -> Callable[[Any], Hashable]:
    if key is None:
        return id
    if isinstance(key, str):
        if not key.isidentifier():
            raise ConfigError(f"key must be an attribute name or a callable, got {key!r}")
        return operator.attrgetter(key)
    if callable(key):
        return key  # type: ignore[return-value,unused-ignore]
    raise ConfigError(f"key must be None (id(model)), an attribute name or a callable, got {key!r}")


class _Attachment:
    """What :func:`attach` installed on one machine."""

    def __init__(
        self,
        machine: Any,
        watchdog: Watchdog[Any],
        router: _Router,
        *,
        key: Callable[[Any], Hashable],
        trigger: str | None,
        callback: Callable[[Any, Expiry[Any]], object] | None,
        loop: asyncio.AbstractEventLoop | None,
    ) -> None:
        # The machine is held weakly: attaching must not keep it alive. (The methods
        # installed on it hold this attachment, so the machine keeps its watchdog.)
        self._machine = weakref.ref(machine)
        self.label = _label(machine)
        self.watchdog = watchdog
        self.router = router
        self.key = key
        self.trigger = trigger
        self.callback = callback
        self.loop = loop
        self.attribute: str = machine.model_attribute
        # machine state label -> spec state (a str or an enum member)
        self.states = {state_label(s): s for s in watchdog.spec.states}
        self.terminal = frozenset(watchdog.spec.terminal)
        self.tasks: set[asyncio.Future[Any] | concurrent.futures.Future[Any]] = set()
        self.saved: dict[str, Any] = {}
        self.sync: Callable[[Any], None] = self._make_sync()

    @property
    def machine(self) -> Any:
        machine = self._machine()
        if machine is None:  # pragma: no cover - only reachable from a dying machine
            raise StallguardError(f"{self.label} was garbage-collected")
        return machine

    # ------------------------------------------------------------------ install

    def install(self) -> None:
        machine = self.machine
        for name in ("set_state", "add_model", "remove_model"):
            self.saved[name] = machine.__dict__.get(name, _UNSET)
        set_state, add_model, remove_model = (
            machine.set_state,
            machine.add_model,
            machine.remove_model,
        )
        sync = self.sync

        def observed_set_state(state: Any, model: Any = None) -> None:
            set_state(state, model)
            if model is None:
                for mod in machine.models:
                    sync(mod)
            elif isinstance(model, (list, tuple)):
                for mod in model:
                    sync(mod)
            else:
                sync(model)

        def observed_add_model(model: Any, *args: Any, **kwargs: Any) -> None:
            self.join(list(listify(model)))
            add_model(model, *args, **kwargs)

        def observed_remove_model(model: Any, *args: Any, **kwargs: Any) -> None:
            remove_model(model, *args, **kwargs)
            self.leave(list(listify(model)))

        self.join(list(machine.models))  # first: it raises on a key shared by two models
        machine.set_state = observed_set_state
        machine.add_model = observed_add_model
        machine.remove_model = observed_remove_model
        _ATTACHED[machine] = self
        self.finalizer = weakref.finalize(machine, _collected, self)
        self.finalizer.atexit = False
        for model in machine.models:
            sync(model)

    def uninstall(self) -> None:
        machine = self.machine
        self.finalizer.detach()
        for name, saved in self.saved.items():
            if saved is _UNSET:
                machine.__dict__.pop(name, None)
            else:
                machine.__dict__[name] = saved
        _ATTACHED.pop(machine, None)
        self.forget_models()

    def forget_models(self) -> None:
        """Unregister every model of this attachment and stop tracking it."""
        members = self.router.members
        for key, (attachment, _ref) in list(members.items()):
            if attachment is self:
                del members[key]
                self.watchdog.forget(key, remember=False)

    # ------------------------------------------------------------------ models

    def _model(self, model: Any) -> Any:
        return self.machine if model is self.machine.self_literal else model

    def join(self, models: list[Any]) -> None:
        """Register *models* (being added to the machine) under their keys; all or none."""
        members = self.router.members
        batch: dict[Hashable, Any] = {}
        for model in map(self._model, models):
            key = self._hashable_key(model)
            entry = members.get(key)
            other = entry[1]() if entry is not None else batch.get(key, model)
            if other is not model and other is not None:
                raise ConfigError(
                    f"key {key!r} of model {model!r} is already used by model {other!r}: "
                    "each attached model needs its own key (see attach(key=...))"
                )
            batch[key] = model
        watchdog = self.watchdog
        for key, model in batch.items():
            members[key] = (self, _reference(model))
            if key not in watchdog:
                # a new life for this key: a stale conclusion must not drop its states
                watchdog.forget(key, remember=False)

    def _hashable_key(self, model: Any) -> Hashable:
        key = self.key(model)
        try:
            hash(key)
        except TypeError:
            raise ConfigError(
                f"key(model) returned {key!r} for model {model!r}: a watchdog key must "
                "be hashable (see attach(key=...))"
            ) from None
        return key

    def leave(self, models: list[Any]) -> None:
        """Unregister *models* (removed from the machine) and stop tracking them."""
        members = self.router.members
        for model in map(self._model, models):
            key = self.key(model)
            entry = members.get(key)
            if entry is not None and entry[0] is self and entry[1]() is model:
                del members[key]
                self.watchdog.forget(key, remember=False)

    def _make_sync(self) -> Callable[[Any], None]:
        """The function that feeds a model's current state to the watchdog after every
        ``set_state``: the per-transition cost, so everything it needs is a local."""
        key_of = self.key
        members = self.router.members
        attribute = self.attribute
        states = self.states
        terminal = self.terminal
        watchdog = self.watchdog
        tracked = watchdog.__contains__
        forget = watchdog.forget
        observe = watchdog.observe
        enum_type = enum.Enum

        def sync(model: Any) -> None:
            key = key_of(model)
            entry = members.get(key)
            if entry is None or entry[1]() is not model:
                return  # removed from the machine: its leftover triggers change nothing
            value = getattr(model, attribute)
            label = value.name if isinstance(value, enum_type) else value
            state = states.get(label, value)
            if state not in terminal and not tracked(key):
                # An actual state change by the machine is authoritative, never a late
                # event: a model that concluded (terminal, expired) and moves on to a
                # live state is tracked again. (Entering a terminal state keeps the
                # conclusion, so watchdog.expired(key) still tells after the trigger ran.)
                forget(key, remember=False)
            observe(key, state)

        return sync

    # ------------------------------------------------------------------ expiry

    def fire(self, model: Any, expiry: Expiry[Any]) -> object:
        """Fail *model*; returns :data:`~stallguard.CONCLUDED` when the callback says the
        model had already ended (or its machine is gone), withdrawing the expiry."""
        if self.callback is not None:
            result = self.callback(model, expiry)
            if result is CONCLUDED:
                return CONCLUDED
            what = f"callback {self.callback!r}"
        elif self.trigger is not None:
            machine = self._machine()
            if machine is None:  # collected while check() ran; its finalizer forgets
                return CONCLUDED
            result = machine.events[self.trigger].trigger(model)
            what = f"trigger {self.trigger!r}"
        else:
            return None
        self._follow(result, model, what, expiry)
        return None

    def _follow(self, result: object, model: Any, what: str, expiry: Expiry[Any]) -> None:
        """Schedule an awaitable *result* of the trigger or callback (*what*); warn
        about a trigger that did not run."""
        if inspect.isawaitable(result):
            self._schedule(result, model, what)
        elif result is False and self.callback is None:
            log.warning(
                "stallguard: %s on expired model %r did not run (a condition refused it); "
                "the model stays in %s",
                what,
                model,
                expiry.state_label,
            )

    def _schedule(self, awaitable: Any, model: Any, what: str) -> None:
        async def run() -> Any:
            return await awaitable

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        task: asyncio.Future[Any] | concurrent.futures.Future[Any]
        if running is not None:
            task = running.create_task(run())
        elif self.loop is not None and not self.loop.is_closed():
            # a concurrent future: its callbacks are safe to add from this thread
            task = asyncio.run_coroutine_threadsafe(run(), self.loop)
        else:
            if inspect.iscoroutine(awaitable):
                awaitable.close()
            raise StallguardError(
                f"{what} for expired model {model!r} is a coroutine, and check() ran outside "
                "an asyncio event loop: run the watchdog in the AsyncMachine's loop "
                "(stallguard.run_watchdog under asyncio), or pass attach(loop=...)"
            )
        self.tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, model, what))

    def _done(
        self, task: asyncio.Future[Any] | concurrent.futures.Future[Any], model: Any, what: str
    ) -> None:
        self.tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            log.error("stallguard: %s for expired model %r failed", what, model, exc_info=error)
        elif task.result() is False and self.callback is None:
            log.warning("stallguard: %s on expired model %r did not run", what, model)


def _collected(attachment: _Attachment) -> None:
    """An attached machine was garbage-collected: forget its models' requests.

    This runs inside the garbage collector, in whatever thread triggered it, possibly
    one that holds the watchdog's lock (the collector runs at any allocation). Forgetting
    needs that lock, so it is done here only when the lock is free; otherwise on a
    short-lived thread, which waits for the lock's holder to release it.
    """
    lock = getattr(attachment.watchdog, "_lock", None)
    if lock is not None and lock.acquire(blocking=False):
        lock.release()  # free, so not held by this thread: forgetting cannot deadlock
        attachment.forget_models()
        return
    try:
        threading.Thread(
            target=attachment.forget_models, name="stallguard-transitions-forget", daemon=True
        ).start()
    except RuntimeError:  # interpreter shutdown: nothing is left to forget for
        pass


def _label(machine: Any) -> str:
    name = machine.name[:-2] if machine.name.endswith(": ") else machine.name
    return f"machine {name!r}" if name else f"the {type(machine).__name__} {machine!r}"


def _validate(machine: Any, spec: Spec, trigger: str | None) -> None:
    from transitions.extensions.nesting import HierarchicalMachine

    if isinstance(machine, HierarchicalMachine):
        raise ConfigError(
            f"machine {machine!r} is a HierarchicalMachine, which stallguard.transitions does "
            "not support yet (nested and parallel states); use a flat Machine or AsyncMachine"
        )
    _check_states(machine, spec)
    if trigger is not None:
        _check_trigger(machine, spec, trigger)


def _check_states(machine: Any, spec: Spec) -> None:
    """Refuse a spec and a machine whose states differ."""
    machine_states = set(machine.states)
    spec_states = {state_label(s) for s in spec.states}
    missing = sorted(spec_states - machine_states)
    if missing:
        raise ConfigError(
            f"spec {spec.name!r} declares states that {_label(machine)} "
            f"lacks: {missing}; the machine's states are {sorted(machine_states)}"
        )
    undeclared = sorted(machine_states - spec_states)
    if undeclared:
        raise ConfigError(
            f"{_label(machine)} has states that spec {spec.name!r} does "
            f"not declare: {undeclared}. Declare each one in the spec (with a deadline, "
            "None for an explicit 'no deadline', or as terminal), so that no state goes "
            "without a deadline by omission (transitions adds a state named 'initial' "
            "when no initial state is given)"
        )


def _check_trigger(machine: Any, spec: Spec, trigger: str) -> None:
    """Refuse a *trigger* that *machine* lacks, or that has no transition from a state
    where *spec* can expire a model."""
    if trigger not in machine.events:
        raise ConfigError(
            f"on_expire_trigger {trigger!r} is not a trigger of "
            f"{_label(machine)}; its triggers are {sorted(machine.events)}"
        )
    stuck = [label for label in _can_expire(spec) if trigger not in machine.get_triggers(label)]
    if stuck:
        raise ConfigError(
            f"on_expire_trigger {trigger!r} has no transition from {stuck}, where spec "
            f"{spec.name!r} can expire a model; add one, e.g. "
            f"machine.add_transition({trigger!r}, source='*', dest='Failed')"
        )


def _can_expire(spec: Spec) -> list[str]:
    """The labels of the states where *spec* can expire a model (a deadline, a progress
    window or the spec's lifetime bounds them)."""
    return [
        state_label(state)
        for state, deadline in spec.deadlines.items()
        if deadline.bounded or spec.lifetime is not None
    ]


def attach(
    machine: transitions.Machine,
    spec: Spec | None = None,
    *,
    on_expire_trigger: str | None = _UNSET,
    callback: Callable[[Any, Expiry[Any]], object] | None = None,
    key: str | Callable[[Any], Hashable] | None = None,
    watchdog: Watchdog[Any] | None = None,
    options: WatchdogOptions | None = None,
    clock: Callable[[], float] | None = None,
    mode: Mode | None = None,
    memory: int | None = None,
    loop: asyncio.AbstractEventLoop | None = None,
) -> Watchdog[Any]:
    """Put *machine*'s models under *spec*'s deadlines.

    Every state change of every model of *machine* is observed: transitions (including
    the ``to_<state>()`` auto transitions), ``machine.set_state(...)``, the initial state
    of a model added later with ``machine.add_model``; ``machine.remove_model`` stops
    tracking a model. When :meth:`Watchdog.check` finds a model overdue it fires
    *on_expire_trigger* on it (``"fail"`` by default) or calls *callback*.

    Nothing runs by itself: call ``check()`` from your loop, or run the returned watchdog
    with :func:`stallguard.run_watchdog` / :class:`stallguard.WatchdogThread`. Triggers
    fire where ``check()`` runs; if that is another thread than the one driving the
    machine, use a ``LockedMachine``.

    Args:
        machine: a ``transitions.Machine``, ``AsyncMachine``, ``LockedMachine`` (not a
            ``HierarchicalMachine``).
        spec: the deadlines. Every spec state must be a machine state, and every machine
            state must be declared in the spec (a deadline, ``None`` for none, or
            terminal). May be omitted when *watchdog* is given.
        on_expire_trigger: the trigger fired (without arguments) on an expired model; it
            must have a transition from every state that can expire. ``None``: fire
            nothing (the expiry is still reported by the instrumentation hooks).
        callback: instead of a trigger, call ``callback(model, expiry)``. It may return
            an awaitable (with an ``AsyncMachine``), which is scheduled as a task, or
            :data:`stallguard.CONCLUDED` when it finds the model had already ended (the
            expiry is then withdrawn: see docs/watchdog.md).
        key: how the watchdog names a model: ``None`` for ``id(model)`` (the default),
            an attribute name (e.g. ``"request_id"``), or a callable ``key(model)``. It
            must not change while the model is attached.
        watchdog: a watchdog returned by an earlier :func:`attach`, to share it among
            several machines (keys must then be unique across them). Default: a new one.
        options, clock, mode, memory: for a new watchdog, as for
            :class:`stallguard.Watchdog`: a :class:`~stallguard.WatchdogOptions` (its
            defaults when omitted), whose fields the keywords override.
        loop: the asyncio loop of an ``AsyncMachine``, used when ``check()`` runs outside
            it (on a :class:`~stallguard.WatchdogThread`). When ``check()`` runs in the
            loop (:func:`stallguard.run_watchdog` under asyncio), it is not needed.

    Returns:
        The watchdog. Its :meth:`~stallguard.Watchdog.snapshot` shows the models per state.

    Raises:
        ConfigError: naming the offending states or trigger, if the spec and the machine
            do not match, if the trigger cannot fire from a state that can expire, if
            *machine* is already attached, or if two models share a key.

    Example::

        machine = Machine(model=None, states=["Queued", "Transferring", "Done", "Failed"],
                          initial="Queued")
        machine.add_transition("fail", "*", "Failed")
        ...
        watchdog = stallguard.transitions.attach(machine, stallguard.Spec(
            name="transfer", deadlines={"Queued": None, "Transferring": 30},
            terminal=["Done", "Failed"]))
        machine.add_model(Transfer())   # tracked from its initial state on
        watchdog.check()                # fires model.fail() on the overdue ones
    """
    _check_machine(machine)
    trigger = _trigger(on_expire_trigger, callback)
    if loop is not None and not isinstance(loop, asyncio.AbstractEventLoop):
        raise ConfigError(f"loop must be an asyncio event loop, got {loop!r}")
    key_of = _key_function(key)
    if watchdog is not None:
        spec, router = _shared(watchdog, spec, {"clock": clock, "mode": mode, "memory": memory})
    elif not isinstance(spec, Spec):
        raise ConfigError(f"spec must be a stallguard.Spec, got {spec!r}")
    _validate(machine, spec, trigger)

    if watchdog is None:
        router = _Router()
        # defaults and validation: WatchdogOptions, the one owner of both
        watchdog = Watchdog(
            spec, on_expire=router, options=options, clock=clock, mode=mode, memory=memory
        )
        _ROUTERS[watchdog] = router
    attachment = _Attachment(
        machine, watchdog, router, key=key_of, trigger=trigger, callback=callback, loop=loop
    )
    attachment.install()
    return watchdog


def _check_machine(machine: object) -> None:
    """Refuse what is not a machine, or a machine already attached."""
    if not isinstance(machine, transitions.Machine):
        raise ConfigError(f"machine must be a transitions.Machine, got {machine!r}")
    if machine in _ATTACHED:
        raise ConfigError(
            f"{_label(machine)} is already attached to a watchdog; "
            "call stallguard.transitions.detach(machine) first"
        )


def _trigger(
    on_expire_trigger: str | None, callback: Callable[[Any, Expiry[Any]], object] | None
) -> str | None:
    """The trigger to fire on an expired model: none when *callback* is given (and
    *on_expire_trigger* must then be left out), else *on_expire_trigger* or ``"fail"``."""
    if callback is not None:
        if on_expire_trigger is not _UNSET:
            raise ConfigError(
                f"pass either on_expire_trigger ({on_expire_trigger!r}) or callback "
                f"({callback!r}), not both"
            )
        if not callable(callback):
            raise ConfigError(f"callback must be callable, got {callback!r}")
        return None
    trigger = _DEFAULT_TRIGGER if on_expire_trigger is _UNSET else on_expire_trigger
    if trigger is not None and not isinstance(trigger, str):
        raise ConfigError(f"on_expire_trigger must be a trigger name or None, got {trigger!r}")
    return trigger


def _shared(
    watchdog: Watchdog[Any], spec: Spec | None, given: Mapping[str, object]
) -> tuple[Spec, _Router]:
    """The spec and the router of *watchdog*, an existing watchdog of :func:`attach`
    (*spec*, if given, must be its spec; no option may be *given* for it)."""
    if not isinstance(watchdog, Watchdog):
        raise ConfigError(
            f"watchdog must be a stallguard.Watchdog returned by attach(), got {watchdog!r}"
        )
    router = _ROUTERS.get(watchdog)
    if router is None:
        raise ConfigError(
            f"watchdog {watchdog!r} was not created by stallguard.transitions.attach(), "
            "so it cannot fire triggers on models; pass a spec instead, or a watchdog "
            "returned by attach()"
        )
    _refuse_options(watchdog, given)
    if spec is not None and spec != watchdog.spec:
        raise ConfigError(
            f"spec {spec.name!r} differs from the spec of watchdog {watchdog!r}; "
            "omit spec to use the watchdog's"
        )
    return (watchdog.spec if spec is None else spec), router


def _refuse_options(watchdog: Watchdog[Any], given: Mapping[str, object]) -> None:
    """Refuse options *given* (not None) for an existing *watchdog*: it has its own."""
    extra = sorted(name for name, value in given.items() if value is not None)
    if extra:
        raise ConfigError(
            f"{', '.join(extra)} cannot be given with an existing watchdog "
            f"({watchdog!r}); it already has them"
        )


def detach(machine: transitions.Machine) -> bool:
    """Undo :func:`attach`: restore *machine*'s methods and stop tracking its models.

    Returns:
        True if *machine* was attached.
    """
    attachment = _ATTACHED.get(machine)
    if attachment is None:
        return False
    attachment.uninstall()
    return True
