"""Helpers for testing code that runs SGLang's prefill queues with stallguard.

:func:`installed` installs the adapter in the current process for the duration of a
``with`` block (wrapping SGLang's classes directly, as the ``.pth`` fallback does) and
removes it afterwards, so that tests with different configurations can share a process
(importing SGLang costs seconds).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from ._config import Config, parse_config

__all__ = ["installed"]


@contextlib.contextmanager
def installed(
    config: Config | dict[str, Any] | None = None,
    *,
    clock: Callable[[], float] | None = None,
) -> Iterator[Config]:
    """Install stallguard-sglang for the block, then uninstall it.

    Args:
        config: a :class:`~stallguard_sglang.Config`, or a dict shaped like the TOML
            file (validated by :func:`~stallguard_sglang.parse_config`); default: the
            defaults.
        clock: the clock of the adapter's watchdogs, e.g. a
            :class:`stallguard.testing.FakeClock` (default ``time.monotonic``).

    Raises:
        RuntimeError: if the adapter is already installed in this process (by
            ``load_plugins()`` or another ``installed()`` block).
    """
    from . import plugin
    from ._runtime import runtime

    if runtime() is not None:
        raise RuntimeError("stallguard-sglang is already installed in this process")
    if config is None:
        config = Config(source="stallguard_sglang.testing")
    elif not isinstance(config, Config):
        config = parse_config(config, source="stallguard_sglang.testing")
    plugin.install(config, via="patch")
    try:
        rt = runtime()
        assert rt is not None
        if clock is not None:
            rt.clock = clock
        yield config
    finally:
        plugin._uninstall()
