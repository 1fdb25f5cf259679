"""The instrumentation hook registry: process-wide, like stamina's.

Two pieces of process-wide state live here, behind the registry's lock
(``stallguard._registry``, which watchdogs read without importing this package):

* the configured expiry hooks (``None`` = the defaults) and their resolved form; the
  registry caches what watchdogs call, so ``check()`` reads one module global per
  expiry batch;
* the metrics expiry hook, kept apart from the configured hooks so that
  :func:`set_on_expire_hooks` and :func:`~stallguard.instrumentation.enable_metrics`
  do not undo each other.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, Union

import attrs

from .. import _registry
from .._errors import ConfigError

if TYPE_CHECKING:
    from .._details import Expiry
    from .._watchdog import Watchdog

__all__ = [
    "ExpiryHook",
    "ExpiryHookFactory",
    "get_on_expire_hooks",
    "live_watchdogs",
    "set_on_expire_hooks",
]

log = logging.getLogger("stallguard")


class ExpiryHook(Protocol):
    """What an instrumentation hook is: a callable that takes the frozen
    :class:`~stallguard.Expiry` of every expiry, enforced or reported.

    Hooks run on the thread that called :meth:`~stallguard.Watchdog.check`, after the
    watchdog lock is released. Their return value is ignored. An exception is logged
    and counted in :attr:`~stallguard.Snapshot.hook_errors`; it never reaches the
    caller of ``check()`` and never stops the other hooks.
    """

    def __call__(self, expiry: Expiry[Any]) -> object: ...


def _check_factory(_instance: Any, _attribute: Any, value: Any) -> None:
    if not callable(value):
        raise ConfigError(
            f"ExpiryHookFactory(hook_factory=...) must be a callable that takes no "
            f"arguments and returns a hook, got {value!r}"
        )


@attrs.frozen
class ExpiryHookFactory:
    """A hook built on first use.

    Wraps a callable that takes no arguments and returns an :class:`ExpiryHook`. It is
    called once, the first time an expiry happens (or :func:`get_on_expire_hooks` is
    called) after the hooks were set, so that importing a telemetry library costs
    nothing in a process whose requests never expire.

    Example::

        def init_statsd_hook() -> ExpiryHook:
            import statsd  # paid only on the first expiry

            client = statsd.StatsClient()
            return lambda expiry: client.incr(f"stallguard.{expiry.state_label}")

        set_on_expire_hooks([LoggingOnExpireHook, ExpiryHookFactory(init_statsd_hook)])
    """

    hook_factory: Callable[[], ExpiryHook] = attrs.field(validator=_check_factory)


#: What :func:`set_on_expire_hooks` accepts.
HookSpec = Union[ExpiryHook, ExpiryHookFactory]

_lock = _registry.lock
# The hooks set with set_on_expire_hooks(); None means the defaults. (Read by
# stallguard.testing.record_expiries to restore them.)
_configured: tuple[HookSpec, ...] | None = None
# _configured with factories resolved; None until the first expiry after a change.
_resolved: tuple[ExpiryHook, ...] | None = None
# The expiry counter installed by enable_metrics(), or None.
_metrics_hook: ExpiryHook | None = None


def _default_hooks() -> tuple[HookSpec, ...]:
    """Logging always; OpenTelemetry spans when ``opentelemetry`` is importable."""
    from ._logging import LoggingOnExpireHook

    hooks: list[HookSpec] = [LoggingOnExpireHook]
    try:
        import opentelemetry.trace  # noqa: F401
    except ImportError:  # opentelemetry-api is a dependency, but a vendored copy may lack it
        pass
    else:
        from ._otel import OpenTelemetryOnExpireHook

        hooks.append(OpenTelemetryOnExpireHook)
    return tuple(hooks)


def set_on_expire_hooks(hooks: Iterable[HookSpec] | None) -> None:
    """Set the process-wide instrumentation hooks that see every expiry, in every
    watchdog, in both ``enforce`` and ``report`` mode.

    Args:
        hooks: an iterable of hooks (callables taking an :class:`~stallguard.Expiry`)
            and :class:`ExpiryHookFactory` instances, run in this order; ``None``
            restores the defaults (:data:`LoggingOnExpireHook`, plus
            :data:`OpenTelemetryOnExpireHook` when ``opentelemetry`` is importable); an
            empty iterable disables them.

    Metrics are switched separately, by :func:`enable_metrics` and
    :func:`disable_metrics`; this function leaves them alone.

    Raises:
        ConfigError: if *hooks* is not an iterable, or holds something that is neither
            callable nor an :class:`ExpiryHookFactory`.
    """
    global _configured, _resolved
    configured = None if hooks is None else _checked_hooks(hooks)
    with _lock:
        _configured = configured
        _resolved = None
        _registry.invalidate()


def _checked_hooks(hooks: object) -> tuple[HookSpec, ...]:
    """*hooks* as a tuple, checked to be an iterable of hooks and factories."""
    if isinstance(hooks, (str, bytes)) or not isinstance(hooks, Iterable):
        hint = " (wrap a single hook in a list)" if callable(hooks) else ""
        raise ConfigError(
            f"set_on_expire_hooks(hooks) takes an iterable of hooks or None{hint}, got {hooks!r}"
        )
    configured = tuple(hooks)
    for hook in configured:
        if not (isinstance(hook, ExpiryHookFactory) or callable(hook)):
            raise ConfigError(
                f"set_on_expire_hooks(hooks) takes callables or ExpiryHookFactory "
                f"instances, got {hook!r} in {configured!r}"
            )
    return configured


def get_on_expire_hooks() -> tuple[ExpiryHook, ...]:
    """The configured hooks (or the defaults), with factories resolved.

    Resolving imports what the factories need, so calling this once at start-up moves
    that one-time cost out of the first expiry. The metrics counter installed by
    :func:`enable_metrics` is not included.

    Raises:
        Exception: whatever a hook factory raised, now or during an earlier expiry.
            (During an expiry a failing factory is logged, and each expiry it misses is
            counted in :attr:`~stallguard.Snapshot.hook_errors`, like a failing hook.)
    """
    with _lock:
        hooks = _resolve(strict=True)
    for hook in hooks:
        if isinstance(hook, _FailedFactory):  # failed during an earlier expiry
            raise hook.error
    return hooks


def _resolve(*, strict: bool) -> tuple[ExpiryHook, ...]:
    """Resolve the configured hooks (lock held)."""
    global _resolved
    if _resolved is not None:
        return _resolved
    specs = _default_hooks() if _configured is None else _configured
    resolved: list[ExpiryHook] = []
    for spec in specs:
        if not isinstance(spec, ExpiryHookFactory):
            resolved.append(spec)
            continue
        try:
            resolved.append(spec.hook_factory())
        except Exception as exc:
            if strict:
                raise
            log.exception("stallguard: instrumentation hook factory %r failed", spec)
            resolved.append(_FailedFactory(spec, exc))
    _resolved = tuple(resolved)
    return _resolved


@attrs.frozen
class _FailedFactory:
    """Stands in for a hook whose factory raised: each expiry raises again, so the
    watchdog logs and counts the failure as it would for a failing hook."""

    factory: ExpiryHookFactory
    error: BaseException

    def __call__(self, expiry: Expiry[Any]) -> None:
        raise RuntimeError(
            f"stallguard: instrumentation hook factory {self.factory!r} failed "
            f"with {self.error!r}; this expiry was not reported to it"
        ) from self.error


def _active() -> tuple[ExpiryHook, ...]:
    """What watchdogs call for each expiry: the resolved hooks, then the metrics
    counter (installed as the registry's resolver; lock held). Never raises."""
    hooks = _resolve(strict=False)
    return hooks if _metrics_hook is None else (*hooks, _metrics_hook)


_registry.resolver = _active


def _cheap_to_resolve() -> bool:
    """The default hooks, with OpenTelemetry already imported: resolving them imports
    nothing new (lock held)."""
    return _configured is None and "opentelemetry.trace" in sys.modules


_registry.cheap_to_resolve = _cheap_to_resolve


def _set_metrics(
    hook: ExpiryHook | None, on_register: Callable[[Watchdog[Any]], None] | None
) -> list[Watchdog[Any]]:
    """Install (or, with None, remove) the metrics expiry hook and the per-watchdog
    installer; returns the live watchdogs, registered atomically with the switch so that
    no watchdog is missed or handled twice."""
    global _metrics_hook
    with _lock:
        _metrics_hook = hook
        _registry.on_register = on_register
        _registry.invalidate()
        return _registry.live_watchdogs()


def live_watchdogs() -> list[Watchdog[Any]]:
    """Every :class:`~stallguard.Watchdog` still alive in this process, in no
    particular order. Watchdogs are held weakly: one that is no longer referenced
    disappears from this list once garbage-collected. Used by the observable gauges of
    :func:`enable_metrics`; handy for an operator endpoint."""
    return _registry.live_watchdogs()
