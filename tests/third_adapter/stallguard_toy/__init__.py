"""stallguard for Toy, a sketch of a third engine adapter written against
``stallguard`` and ``stallguard.adapters`` only (issue 23's done-when check).

The engine (``toy_engine.py`` next to this package) stands in for a real serving
engine: requests go through two phases, ``Loading`` and ``Generating``, and the engine
offers a hook per phase change and a ``fail(rid)`` call. Enabled with ``STALLGUARD_TOY=1``
or ``STALLGUARD_TOY_CONFIG=<file.toml>``; per-key overrides ``STALLGUARD_TOY_MODE`` and
``STALLGUARD_TOY_DEADLINE_<PHASE>``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stallguard.adapters import lazy_attribute, lazy_names

if TYPE_CHECKING:
    from ._config import Config as Config
    from ._config import load_config as load_config
    from ._config import parse_config as parse_config
    from .guard import ToyGuard as ToyGuard
    from .package import SUPPORT as SUPPORT

_EXPORTS = {
    "._config": ("Config", "load_config", "parse_config"),
    ".guard": ("ToyGuard",),
    ".package": ("SUPPORT",),
}
__all__ = lazy_names(_EXPORTS)


def __getattr__(name: str) -> object:
    return lazy_attribute(__name__, _EXPORTS, name, distribution="stallguard-toy")


def __dir__() -> list[str]:
    return list(__all__)
