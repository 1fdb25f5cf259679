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

# (not typing.TYPE_CHECKING: the .pth activation imports this package at interpreter
# start-up, and importing typing costs milliseconds)
TYPE_CHECKING = False
if TYPE_CHECKING:  # the lazy exports below, with their static types
    from collections.abc import Callable
    from typing import Any

    from stallguard import Watchdog

    from ._config import BACKENDS as BACKENDS
    from ._config import DECODE_PHASES as DECODE_PHASES
    from ._config import ENV_CONFIG as ENV_CONFIG
    from ._config import ENV_ENABLE as ENV_ENABLE
    from ._config import ENV_MODE as ENV_MODE
    from ._config import BootstrapQueueConfig as BootstrapQueueConfig
    from ._config import Config as Config
    from ._config import DecodeConfig as DecodeConfig
    from ._config import PrefillConfig as PrefillConfig
    from ._config import apply_environment as apply_environment
    from ._config import load_config as load_config
    from ._config import parse_config as parse_config
    from ._metrics import FORCED_FAILURES as FORCED_FAILURES
    from ._metrics import STALLS_REPORTED as STALLS_REPORTED
    from ._profiles import PROFILES as PROFILES
    from ._profiles import BackendProfile as BackendProfile
    from ._profiles import SupportRow as SupportRow
    from ._profiles import decode_deadlines as decode_deadlines
    from ._profiles import decode_support_table as decode_support_table
    from ._profiles import effective_deadlines as effective_deadlines
    from ._profiles import format_support_table as format_support_table
    from ._profiles import sglang_settings as sglang_settings
    from ._profiles import support_table as support_table
    from .package import SUPPORTED_SGLANG as SUPPORTED_SGLANG
    from .package import TESTED_SGLANG as TESTED_SGLANG
    from .package import is_supported as is_supported
    from .package import sglang_version as sglang_version
    from .package import supported_specifier as supported_specifier
    from .plugin import install as install
    from .plugin import register as register

#: module -> the public names it defines (imported at first use, stallguard.adapters.
#: lazy_attribute); the TYPE_CHECKING imports above are the same names, for their types
#: (tests/test_adapter_kit.py checks that the two agree)
_EXPORTS = {
    "._config": (
        "BACKENDS",
        "DECODE_PHASES",
        "ENV_CONFIG",
        "ENV_ENABLE",
        "ENV_MODE",
        "BootstrapQueueConfig",
        "Config",
        "DecodeConfig",
        "PrefillConfig",
        "apply_environment",
        "load_config",
        "parse_config",
    ),
    "._metrics": ("FORCED_FAILURES", "STALLS_REPORTED"),
    "._profiles": (
        "PROFILES",
        "BackendProfile",
        "SupportRow",
        "decode_deadlines",
        "decode_support_table",
        "effective_deadlines",
        "format_support_table",
        "sglang_settings",
        "support_table",
    ),
    ".package": (
        "SUPPORTED_SGLANG",
        "TESTED_SGLANG",
        "is_supported",
        "sglang_version",
        "supported_specifier",
    ),
    ".plugin": ("install", "register"),
}
# (not stallguard.adapters.lazy_names(): importing stallguard here would cost the .pth
# start-up path what this package's laziness exists to avoid)
__all__ = sorted(
    {"set_clock", "watchdogs", *(name for names in _EXPORTS.values() for name in names)}
)


def __getattr__(name: str) -> object:
    # stallguard is imported at the first lazy lookup, not with this package
    from stallguard.adapters import lazy_attribute

    return lazy_attribute(__name__, _EXPORTS, name, distribution="stallguard-sglang")


def __dir__() -> list[str]:
    return list(__all__)


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
