"""Which SGLang releases stallguard-sglang supports, and what the installed one can do.

Nothing here imports SGLang (that takes seconds and initialises torch): versions come
from the installed distribution's metadata and features from its files.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # (not typing's: see the note below)
if TYPE_CHECKING:
    import packaging.specifiers

    from stallguard.adapters import VersionSupport

__all__ = [
    "SUPPORTED_SGLANG",
    "TESTED_SGLANG",
    "has_plugin_framework",
    "is_supported",
    "nixl_has_bootstrap_timeout",
    "parse_version",
    "sglang_version",
    "support",
    "supported_specifier",
]

# (stallguard.adapters, and through it importlib.metadata and packaging, is imported
# inside the functions that need it: the .pth activation imports this module at
# interpreter start-up when the adapter is enabled, and importing importlib.metadata
# alone costs tens of milliseconds)

#: The SGLang releases the adapter supports: a PEP 440 specifier, checked with
#: ``packaging`` everywhere (:func:`is_supported`, ``python -m stallguard_sglang``, the
#: plugin's start-up warning). Pre-releases inside the range count (``0.5.18rc0``);
#: ``0.5.17rc0`` comes before ``0.5.17`` and does not.
SUPPORTED_SGLANG = ">=0.5.17,<0.6"
#: The releases the adapter's test suite runs against (real SGLang code, see docs/sglang.md).
TESTED_SGLANG = ("0.5.17", "0.5.23")

#: upstream PR sgl-project/sglang#34692 gave NIXL its prefill bootstrap deadline in 0.5.18.
_NIXL_BOOTSTRAP_TIMEOUT_SINCE = (0, 5, 18)

_SUPPORT: VersionSupport | None = None


def support() -> VersionSupport:
    """:data:`SUPPORTED_SGLANG` and its check, a ``stallguard.adapters.VersionSupport``
    (made at the first call: this module is imported at interpreter start-up by the
    ``.pth`` activation, where stallguard must not be)."""
    global _SUPPORT
    if _SUPPORT is None:
        from stallguard.adapters import VersionSupport

        _SUPPORT = VersionSupport("sglang", SUPPORTED_SGLANG, label="SGLang", tested=TESTED_SGLANG)
    return _SUPPORT


def supported_specifier() -> packaging.specifiers.SpecifierSet:
    """:data:`SUPPORTED_SGLANG` as a ``packaging.specifiers.SpecifierSet``."""
    return support().specifier_set()


def parse_version(version: str) -> tuple[int, ...]:
    """The release part of a PEP 440 version as a tuple of ints: ``"0.5.23.post1"`` ->
    ``(0, 5, 23)``, ``"0.5.18rc0"`` -> ``(0, 5, 18)``.

    Raises:
        ValueError: if *version* is not a PEP 440 version (the message names it).
    """
    from stallguard.adapters import release_of

    return release_of(version)


def sglang_version() -> str | None:
    """The installed SGLang's version (from its distribution metadata), or None if SGLang
    is not installed. Does not import SGLang."""
    return support().installed()


def is_supported(version: str | None = None) -> bool:
    """True if *version* (default: the installed SGLang) is in :data:`SUPPORTED_SGLANG`
    under PEP 440 (``packaging``): ``0.5.17rc0`` is not, ``0.5.18rc0`` is. False if SGLang
    is not installed.

    Raises:
        ValueError: if *version* is not a PEP 440 version.
    """
    return support().is_supported(version)


def nixl_has_bootstrap_timeout(version: str | None = None) -> bool:
    """True if SGLang *version* fails a NIXL sender stuck in ``Bootstrapping`` on its own
    (``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``): 0.5.18 and later (its pre-releases
    included). On 0.5.17 and earlier such a request waits forever unless stallguard's
    bootstrap-queue guard runs."""
    version = version if version is not None else sglang_version()
    if version is None:
        return False
    return parse_version(version) >= _NIXL_BOOTSTRAP_TIMEOUT_SINCE


def has_plugin_framework() -> bool:
    """True if the installed SGLang has the plugin framework (``sglang.srt.plugins``,
    entry-point group ``sglang.srt.plugins``). Checks the file, without importing SGLang
    (and without ``importlib.util``, whose imports cost milliseconds at start-up)."""
    module = sys.modules.get("sglang")
    if module is None:
        locations = _search_locations("sglang")
    else:
        locations = getattr(getattr(module, "__spec__", None), "submodule_search_locations", None)
    if not locations:
        return False
    return any(
        os.path.exists(os.path.join(location, "srt", "plugins", "__init__.py"))
        for location in locations
    )


def _search_locations(name: str) -> list[str] | None:
    """The package directories of the top-level module *name*, not yet imported, as
    ``importlib.util.find_spec`` finds them (None if no finder knows it)."""
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        spec = find_spec(name, None)
        if spec is not None:
            locations: list[str] | None = spec.submodule_search_locations
            return locations
    return None
