"""The SGLang plugin entry point (``sglang.srt.plugins`` group, name ``stallguard``).

SGLang's ``load_plugins()`` calls :func:`register` first thing in every scheduler
process (and in the launcher, the DP controller and the detokenizer). It does nothing
unless ``STALLGUARD_SGLANG_CONFIG`` names a TOML file or ``STALLGUARD_SGLANG=1`` asks for
the defaults.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, NoReturn

from stallguard import ConfigError
from stallguard.adapters import describe_exception, shorten

from ._config import ENV_CONFIG, ENV_ENABLE, Config, load_config
from .package import SUPPORTED_SGLANG, is_supported, sglang_version

__all__ = ["activate", "install", "load_config_or_exit", "register"]

log = logging.getLogger("stallguard.sglang")

_installed: Config | None = None
# (class, attribute, original) for every target patch() wrapped, so that tests can undo it
_patched: list[tuple[type, str, Any]] = []


def load_config_or_exit() -> Config | None:
    """The configuration the environment asks for (None: the adapter is disabled).

    Raises:
        SystemExit: for a bad configuration (a file that cannot be read or interpreted,
            a bad value, a bad ``STALLGUARD_SGLANG*`` variable), with a message naming
            the file, the key and the value; for any other exception while loading it
            too, naming the file. An ``Exception`` would be swallowed by
            ``load_plugins()`` and the server would start unguarded.
    """
    try:
        return load_config()
    except ConfigError as e:
        _refuse(f"invalid configuration, refusing to start: {e}")
    except Exception as e:  # not a documented error: still, never start unguarded
        _refuse(
            f"cannot load the configuration ({_named_source()}), refusing to start: "
            f"{describe_exception(e)}"
        )


def _named_source() -> str:
    """What the environment names as the configuration, for a message."""
    path = os.environ.get(ENV_CONFIG, "").strip()
    if path:
        return f"{ENV_CONFIG}={path!r}"
    return f"{ENV_ENABLE}={shorten(repr(os.environ.get(ENV_ENABLE)))}"


def _refuse(problem: str) -> NoReturn:
    """Log *problem* and stop the process (a ``SystemExit``, which ``load_plugins()``
    does not catch)."""
    message = f"stallguard-sglang: {problem}"
    log.error("%s", message)
    raise SystemExit(message) from None


def register() -> None:
    """Install stallguard's hooks through SGLang's ``HookRegistry`` if the environment
    enables the adapter; otherwise do nothing. Idempotent.

    A bad configuration stops the process: ``load_plugins()`` catches and logs every
    ``Exception`` a plugin raises and carries on without it, which would leave the server
    running unguarded, so the error is raised as ``SystemExit`` with a message naming the
    file, the key and the value. So is any failure to install the hooks for a
    configuration that loaded: a server that was given a configuration either runs with
    it or does not start.
    """
    if _installed is not None:
        return
    activate(via="plugins")


def activate(*, via: str) -> Config | None:
    """Load the configuration the environment asks for and :func:`install` it (the
    plugin entry point and the ``.pth`` fallback's import hook both come here).

    Returns:
        The configuration installed, or None if the adapter is disabled.

    Raises:
        SystemExit: for a bad configuration (:func:`load_config_or_exit`), or if
            installing the hooks for one that loaded fails, naming the configuration:
            never a server that was given a configuration and runs without it.
    """
    config = load_config_or_exit()
    if config is None:
        log.debug("stallguard-sglang: disabled (set %s or STALLGUARD_SGLANG=1)", ENV_CONFIG)
        return None
    try:
        install(config, via=via)
    except Exception as e:
        _refuse(
            f"cannot install the hooks for config {config.source}, refusing to start: "
            f"{describe_exception(e)}"
        )
    return config


def install(config: Config, *, via: str = "plugins") -> None:
    """Install the hooks for *config* (the plugin entry point and the ``.pth`` fallback
    call this; tests may too).

    Args:
        config: what to enforce.
        via: ``"plugins"`` registers AROUND/AFTER hooks with SGLang's ``HookRegistry``
            (applied by ``load_plugins()`` right after the plugins ran); ``"patch"``
            wraps the targets directly, for SGLang builds without the plugin framework
            (the target modules must be importable).
    """
    global _installed
    if _installed is not None:
        if _installed != config:
            log.warning(
                "stallguard-sglang: already installed with config %s; ignoring %s",
                _installed.source,
                config.source,
            )
        return
    from . import _decode, _hooks, _runtime

    version = sglang_version()
    _warn_if_unsupported(version)
    rt = _runtime.Runtime(config, version=version)
    _runtime.set_runtime(rt)
    plan = _decode.hook_plan(config, _hooks.hook_plan(config, version))
    _register(plan, via)
    _installed = config
    line = (
        f"stallguard-sglang active on SGLang {version} (config {config.source}; prefill "
        f"{config.prefill.mode}, bootstrap queue {config.bootstrap_queue.mode}, decode "
        f"{config.decode.mode}; {len(plan)} hooks via {via})"
    )
    if _logging_configured(log):
        log.info("%s", line)
    else:
        # SGLang's launch_server calls load_plugins() before it configures logging (in
        # the launcher and in every scheduler process): logged now, the line would be
        # dropped. The runtime logs it at the first queue call instead, with the table.
        rt.pending_active_line = line


def _warn_if_unsupported(version: str | None) -> None:
    """Warn when SGLang *version* is outside the supported range (installing anyway)."""
    try:
        supported = version is None or is_supported(version)
    except ValueError:  # not a PEP 440 version: a local build, say
        supported = False
    if not supported:
        log.warning(
            "stallguard-sglang: SGLang %s is outside the supported range %s; installing "
            "anyway (check the startup table and that the hooks applied)",
            version,
            SUPPORTED_SGLANG,
        )


def _register(plan: list[tuple[str, Callable[..., Any], str]], via: str) -> None:
    """Hook each ``(target, fn, kind)`` of *plan* in, *via* SGLang's ``HookRegistry``
    (``"plugins"``) or by wrapping the targets (``"patch"``)."""
    if via == "plugins":
        from sglang.srt.plugins.hook_registry import (  # type: ignore[import-untyped]
            HookRegistry,
            HookType,
        )

        for target, fn, kind in plan:
            HookRegistry.register(
                target, fn, HookType.AROUND if kind == "around" else HookType.AFTER
            )
    elif via == "patch":
        for target, fn, kind in plan:
            patch(target, fn, kind)
    else:
        raise ValueError(f"via must be 'plugins' or 'patch', got {via!r}")


def _logging_configured(logger: logging.Logger) -> bool:
    """Whether an INFO record of *logger* would reach a handler now (the check
    ``logging`` itself makes; ``logging.lastResort`` only takes warnings)."""
    if not logger.isEnabledFor(logging.INFO):
        return False
    current: logging.Logger | None = logger
    while current is not None:
        if current.handlers:
            return True
        if not current.propagate:
            return False
        current = current.parent
    return False


def patch(target: str, fn: Callable[..., Any], kind: str) -> None:
    """Wrap *target* (``"module.Class.method"``) with *fn* directly, as ``HookRegistry``
    would (``"around"``: ``fn(original, *args, **kwargs)``; ``"after"``:
    ``fn(result, *args, **kwargs)``). The wrapper's ``__wrapped__`` is the original.
    Idempotent per target."""
    import functools
    import importlib

    module_name, class_name, attr = target.rsplit(".", 2)
    cls = getattr(importlib.import_module(module_name), class_name)
    original = cls.__dict__.get(attr, getattr(cls, attr))
    if getattr(original, "_stallguard_hook", None) is fn:
        return
    if kind == "around":

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(original, *args, **kwargs)

    else:

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            fn(result, *args, **kwargs)
            return result

    wrapper.__wrapped__ = original
    wrapper._stallguard_hook = fn  # type: ignore[attr-defined]
    _patched.append((cls, attr, original))
    setattr(cls, attr, wrapper)


def _uninstall() -> None:
    """Undo :func:`install` with ``via="patch"`` (for tests; hooks registered with
    SGLang's ``HookRegistry`` cannot be undone this way)."""
    global _installed
    from . import _runtime

    while _patched:
        cls, attr, original = _patched.pop()
        setattr(cls, attr, original)
    _runtime.set_runtime(None)
    _installed = None
