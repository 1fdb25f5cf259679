"""stallguard for vLLM: per-phase deadlines for disaggregated requests on vLLM's NIXL
connector (pull and push), failing stuck ones through vLLM's own failed-receive path.

Select ``StallguardNixlConnector`` (or ``StallguardNixlPushConnector``) in vLLM's
``--kv-transfer-config``; configure with ``STALLGUARD_VLLM_CONFIG=<file.toml>``. See
docs/vllm.md.

Importing this package is cheap: nothing here imports vLLM.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "DEFAULTS",
    "ENV_CONFIG",
    "ENV_ENABLE",
    "SUPPORTED_VLLM",
    "TESTED_VLLM",
    "Config",
    "CoverageRow",
    "Orders",
    "PhaseTracker",
    "connector_config",
    "coverage_rows",
    "format_coverage",
    "is_supported",
    "load_config",
    "parse_config",
    "register",
    "vllm_version",
]

_LAZY = {
    "DEFAULTS": "._config",
    "ENV_CONFIG": "._config",
    "ENV_ENABLE": "._config",
    "Config": "._config",
    "connector_config": "._config",
    "load_config": "._config",
    "parse_config": "._config",
    "CoverageRow": "._coverage",
    "coverage_rows": "._coverage",
    "format_coverage": "._coverage",
    "Orders": "._phases",
    "PhaseTracker": "._phases",
    "SUPPORTED_VLLM": ".package",
    "TESTED_VLLM": ".package",
    "is_supported": ".package",
    "vllm_version": ".package",
    "register": ".plugin",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        if name == "__version__":
            from importlib.metadata import PackageNotFoundError, version

            try:
                return version("stallguard-vllm")
            except PackageNotFoundError:
                return "0+unknown"
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
