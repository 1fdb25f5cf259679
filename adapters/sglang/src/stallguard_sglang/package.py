"""Which SGLang releases stallguard-sglang supports, and what the installed one can do.

Nothing here imports SGLang (that takes seconds and initialises torch): versions come
from the installed distribution's metadata and features from its files.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re

__all__ = [
    "SUPPORTED_SGLANG",
    "TESTED_SGLANG",
    "has_plugin_framework",
    "is_supported",
    "nixl_has_bootstrap_timeout",
    "parse_version",
    "sglang_version",
]

#: The SGLang releases the adapter supports (a PEP 440 specifier, for humans and pip).
SUPPORTED_SGLANG = ">=0.5.17,<0.6"
#: The releases the adapter's test suite runs against (real SGLang code, see docs/sglang.md).
TESTED_SGLANG = ("0.5.17", "0.5.23")

_MIN = (0, 5, 17)
_MAX_EXCLUSIVE = (0, 6)
#: upstream PR sgl-project/sglang#34692 gave NIXL its prefill bootstrap deadline in 0.5.18.
_NIXL_BOOTSTRAP_TIMEOUT_SINCE = (0, 5, 18)


def parse_version(version: str) -> tuple[int, ...]:
    """The release part of a version string as a tuple of ints: ``"0.5.23.post1"`` ->
    ``(0, 5, 23)``, ``"0.5.18rc0"`` -> ``(0, 5, 18)``.

    Raises:
        ValueError: if *version* does not start with a number.
    """
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if match is None:
        raise ValueError(f"not a version number: {version!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def sglang_version() -> str | None:
    """The installed SGLang's version (from its distribution metadata), or None if SGLang
    is not installed. Does not import SGLang."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def is_supported(version: str | None = None) -> bool:
    """True if *version* (default: the installed SGLang) is in :data:`SUPPORTED_SGLANG`."""
    version = version if version is not None else sglang_version()
    if version is None:
        return False
    release = parse_version(version)
    return _MIN <= release < _MAX_EXCLUSIVE


def nixl_has_bootstrap_timeout(version: str | None = None) -> bool:
    """True if SGLang *version* fails a NIXL sender stuck in ``Bootstrapping`` on its own
    (``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``): 0.5.18 and later. On 0.5.17 and
    earlier such a request waits forever unless stallguard's bootstrap-queue guard runs."""
    version = version if version is not None else sglang_version()
    if version is None:
        return False
    return parse_version(version) >= _NIXL_BOOTSTRAP_TIMEOUT_SINCE


def has_plugin_framework() -> bool:
    """True if the installed SGLang has the plugin framework (``sglang.srt.plugins``,
    entry-point group ``sglang.srt.plugins``). Checks the file, without importing SGLang."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(
        os.path.exists(os.path.join(location, "srt", "plugins", "__init__.py"))
        for location in spec.submodule_search_locations
    )
