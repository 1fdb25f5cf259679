"""Sizing property tests: a few hundred examples in CI, more under a larger profile."""

from __future__ import annotations

from hypothesis import settings


def at_least(examples: int) -> int:
    """*examples* in CI; the loaded profile's ``max_examples`` when it is larger
    (``HYPOTHESIS_PROFILE=long``, registered in tests/conftest.py)."""
    return max(examples, settings.default.max_examples)
