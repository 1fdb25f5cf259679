"""Which Toy releases the adapter supports: one specifier and its check."""

from __future__ import annotations

from stallguard.adapters import VersionSupport

SUPPORT = VersionSupport("toy-engine", ">=1.2,<2", label="Toy", tested=("1.4.0",))
