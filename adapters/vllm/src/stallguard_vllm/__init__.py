"""stallguard for vLLM: per-phase deadlines for disaggregated requests on vLLM's NIXL
connector (pull and push), failing stuck ones through vLLM's own failed-receive path.

Select ``StallguardNixlConnector`` (or ``StallguardNixlPushConnector``) in vLLM's
``--kv-transfer-config``; configure with ``STALLGUARD_VLLM_CONFIG=<file.toml>``. See
docs/vllm.md.

Importing this package is cheap: nothing here imports vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stallguard.adapters import lazy_attribute, lazy_names

if TYPE_CHECKING:  # the lazy exports below, with their static types
    from ._config import DEFAULTS as DEFAULTS
    from ._config import ENV_CONFIG as ENV_CONFIG
    from ._config import ENV_ENABLE as ENV_ENABLE
    from ._config import EXTRA_CONFIG_KEY as EXTRA_CONFIG_KEY
    from ._config import Config as Config
    from ._config import connector_config as connector_config
    from ._config import load_config as load_config
    from ._config import parse_config as parse_config
    from ._coverage import CoverageRow as CoverageRow
    from ._coverage import coverage_rows as coverage_rows
    from ._coverage import format_coverage as format_coverage
    from ._phases import Orders as Orders
    from ._phases import PhaseTracker as PhaseTracker
    from .package import SUPPORTED_VLLM as SUPPORTED_VLLM
    from .package import TESTED_VLLM as TESTED_VLLM
    from .package import is_supported as is_supported
    from .package import vllm_version as vllm_version
    from .plugin import register as register

#: module -> the public names it defines, imported at first use; the TYPE_CHECKING
#: imports above are the same names, for their types (tests/test_adapter_kit.py checks
#: that the two agree)
_EXPORTS = {
    "._config": (
        "DEFAULTS",
        "ENV_CONFIG",
        "ENV_ENABLE",
        "EXTRA_CONFIG_KEY",
        "Config",
        "connector_config",
        "load_config",
        "parse_config",
    ),
    "._coverage": ("CoverageRow", "coverage_rows", "format_coverage"),
    "._phases": ("Orders", "PhaseTracker"),
    ".package": ("SUPPORTED_VLLM", "TESTED_VLLM", "is_supported", "vllm_version"),
    ".plugin": ("register",),
}
__all__ = lazy_names(_EXPORTS)


def __getattr__(name: str) -> object:
    return lazy_attribute(__name__, _EXPORTS, name, distribution="stallguard-vllm")


def __dir__() -> list[str]:
    return list(__all__)
