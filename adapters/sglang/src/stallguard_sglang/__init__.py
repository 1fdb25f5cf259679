"""stallguard for SGLang: per-state deadlines for the prefill KV senders and the decode
queues.

Install ``stallguard-sglang`` next to SGLang and set ``STALLGUARD_SGLANG_CONFIG`` to a
TOML file (or ``STALLGUARD_SGLANG=1`` for the defaults). SGLang's plugin loader then
calls :func:`register` in every scheduler process, and each request in the prefill
inflight queue that overstays its ``KVPoll`` state's deadline is failed through SGLang's
own failure path, with an OpenTelemetry span and a Prometheus count. See docs/sglang.md.

Importing this package is cheap: nothing here imports SGLang.
"""

from __future__ import annotations

import importlib

# (not typing.TYPE_CHECKING: the .pth activation imports this package at interpreter
# start-up, and importing typing costs milliseconds)
TYPE_CHECKING = False
if TYPE_CHECKING:  # the lazy exports below, with their static types
    from collections.abc import Callable
    from typing import Any

    from stallguard import Watchdog

    from ._config import (
        BACKENDS,
        ENV_CONFIG,
        ENV_ENABLE,
        BootstrapQueueConfig,
        Config,
        PrefillConfig,
        load_config,
        parse_config,
    )
    from ._metrics import FORCED_FAILURES, STALLS_REPORTED
    from ._profiles import (
        PROFILES,
        BackendProfile,
        SupportRow,
        effective_deadlines,
        format_support_table,
        sglang_settings,
        support_table,
    )
    from .package import (
        SUPPORTED_SGLANG,
        TESTED_SGLANG,
        is_supported,
        sglang_version,
        supported_specifier,
    )
    from .plugin import install, register

__all__ = [
    "BACKENDS",
    "ENV_CONFIG",
    "ENV_ENABLE",
    "FORCED_FAILURES",
    "PROFILES",
    "STALLS_REPORTED",
    "SUPPORTED_SGLANG",
    "TESTED_SGLANG",
    "BackendProfile",
    "BootstrapQueueConfig",
    "Config",
    "DECODE_PHASES",
    "DecodeConfig",
    "PrefillConfig",
    "SupportRow",
    "decode_deadlines",
    "decode_support_table",
    "effective_deadlines",
    "format_support_table",
    "install",
    "is_supported",
    "load_config",
    "parse_config",
    "register",
    "set_clock",
    "sglang_settings",
    "sglang_version",
    "support_table",
    "supported_specifier",
    "watchdogs",
]

_LAZY = {
    "BACKENDS": "._config",
    "ENV_CONFIG": "._config",
    "ENV_ENABLE": "._config",
    "BootstrapQueueConfig": "._config",
    "Config": "._config",
    "DECODE_PHASES": "._config",
    "DecodeConfig": "._config",
    "PrefillConfig": "._config",
    "load_config": "._config",
    "parse_config": "._config",
    "PROFILES": "._profiles",
    "BackendProfile": "._profiles",
    "SupportRow": "._profiles",
    "decode_deadlines": "._profiles",
    "decode_support_table": "._profiles",
    "effective_deadlines": "._profiles",
    "format_support_table": "._profiles",
    "sglang_settings": "._profiles",
    "support_table": "._profiles",
    "FORCED_FAILURES": "._metrics",
    "STALLS_REPORTED": "._metrics",
    "SUPPORTED_SGLANG": ".package",
    "TESTED_SGLANG": ".package",
    "is_supported": ".package",
    "sglang_version": ".package",
    "supported_specifier": ".package",
    "install": ".plugin",
    "register": ".plugin",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        if name == "__version__":
            from importlib.metadata import PackageNotFoundError, version

            try:
                return version("stallguard-sglang")
            except PackageNotFoundError:
                return "0+unknown"
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


def watchdogs() -> dict[tuple[str, str], list[Watchdog[Any]]]:
    """The watchdogs the adapter runs in this process, by ``(queue, backend)``
    (``queue`` is ``"inflight"``, ``"bootstrap"``, ``"prealloc"`` or ``"transfer"``):
    one per queue and backend seen, so a prefill scheduler process normally has two
    (its backend, and ``fake`` for warmup), a decode one one per decode queue.
    Empty until the adapter is installed and a queue held requests."""
    from ._runtime import runtime

    rt = runtime()
    out: dict[tuple[str, str], list[Watchdog[Any]]] = {}
    if rt is None:
        return out
    for guard in rt.guards:
        for backend, wd in guard.watchdogs.items():
            out.setdefault((guard.kind, backend), []).append(wd)
    return out


def set_clock(clock: Callable[[], float]) -> None:
    """Use *clock* (seconds, never going backwards; default ``time.monotonic``) for the
    watchdogs created from now on in this process. For tests: pass a
    :class:`stallguard.testing.FakeClock`. Needs the adapter installed.

    Raises:
        RuntimeError: if the adapter is not installed in this process.
    """
    from ._runtime import runtime

    rt = runtime()
    if rt is None:
        raise RuntimeError(
            "stallguard-sglang is not installed in this process (register() found no "
            "STALLGUARD_SGLANG_CONFIG / STALLGUARD_SGLANG=1)"
        )
    if not callable(clock):
        raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
    rt.clock = clock
