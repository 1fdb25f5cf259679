from __future__ import annotations

import os

import pytest
from hypothesis import settings

from stallguard.instrumentation import disable_metrics, set_on_expire_hooks

# The hypothesis profiles ("suite", the default: no per-example deadline; "long", for
# local hunting) are registered and loaded by the repository's root conftest.py, so that
# the adapters' tests get them too (docs/testing.md):
#   HYPOTHESIS_PROFILE=long .venv/bin/python -m pytest tests/...
# or pytest's --hypothesis-profile=long. Tests that set their own max_examples size it
# with tests/_profiles.py's at_least(), so the profile raises it too.
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))


@pytest.fixture(autouse=True)
def _default_hooks():
    """Each test starts and ends with the default instrumentation hooks and metrics off
    (a test that left metrics on would make every later watchdog record a duration
    histogram point per state change)."""
    set_on_expire_hooks(None)
    disable_metrics()
    yield
    set_on_expire_hooks(None)
    disable_metrics()


@pytest.fixture
def no_hooks():
    """No process-wide instrumentation hooks (no log line, no span) during the test:
    only the watchdog's own hooks and listeners see its expiries."""
    set_on_expire_hooks([])
    yield
    set_on_expire_hooks(None)
