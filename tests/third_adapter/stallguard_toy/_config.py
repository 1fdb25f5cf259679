"""The adapter's configuration: the enable switch, a TOML file, per-key overrides.

File schema::

    mode = "enforce"            # or "report"
    [deadlines]
    Loading = 30                # seconds, "none", or { seconds = ..., stall = ... }
    Generating = { seconds = 600, stall = 20 }
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from stallguard import Deadline, Mode
from stallguard.adapters import EnvReader, TableReader, env_enabled, read_config

ENV_ENABLE = "STALLGUARD_TOY"
ENV_CONFIG = "STALLGUARD_TOY_CONFIG"
PHASES = ("Loading", "Generating")
TERMINAL = ("Done", "Failed")
_DEFAULTS = {"Loading": Deadline(seconds=30.0), "Generating": Deadline(seconds=600.0)}


@dataclass(frozen=True)
class Config:
    """The Toy adapter's configuration."""

    mode: Mode = "enforce"
    deadlines: Mapping[str, Deadline] = field(default_factory=lambda: MappingProxyType(_DEFAULTS))
    source: str = "defaults"


def parse_config(data: object, *, source: str = "<dict>") -> Config:
    """Validate a parsed document; errors name *source*, the key and the value."""
    top = TableReader(data, source=source, where="", allowed=("mode", "deadlines"))
    mode: Any = top.choice("mode", ("enforce", "report"), "enforce")
    deadlines = top.deadlines("deadlines", PHASES, terminal=TERMINAL, listing="phases:")
    return Config(mode=mode, deadlines=MappingProxyType({**_DEFAULTS, **deadlines}), source=source)


_VARS = {f"STALLGUARD_TOY_DEADLINE_{p.upper()}": p for p in PHASES}


def load_config(environ: Mapping[str, str] | None = None) -> Config | None:
    """The configuration the environment asks for (None: disabled)."""
    env = os.environ if environ is None else environ
    path = env_enabled(env, enable_var=ENV_ENABLE, config_var=ENV_CONFIG)
    if path is None:
        return None
    config = (
        read_config(path, var=ENV_CONFIG, parse=lambda d: parse_config(d, source=path))
        if path
        else Config(source=f"{ENV_ENABLE}=1")
    )
    over = EnvReader(
        env,
        "STALLGUARD_TOY_",
        known=("STALLGUARD_TOY_MODE", *_VARS),
        ignore=(ENV_CONFIG,),
        forms="STALLGUARD_TOY_MODE, STALLGUARD_TOY_DEADLINE_<PHASE>",
    )
    changes: dict[str, Any] = {}
    if "STALLGUARD_TOY_MODE" in over:
        changes["mode"] = over.choice("STALLGUARD_TOY_MODE", ("enforce", "report"))
    deadlines = dict(config.deadlines)
    for var, phase in _VARS.items():
        if var in over:
            deadlines[phase] = Deadline(seconds=over.seconds(var), stall=deadlines[phase].stall)
    return replace(config, deadlines=MappingProxyType(deadlines), **changes)
