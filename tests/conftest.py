from __future__ import annotations

import pytest

from stallguard.instrumentation import set_on_expire_hooks


@pytest.fixture(autouse=True)
def _default_hooks():
    """Each test starts and ends with the default instrumentation hooks."""
    set_on_expire_hooks(None)
    yield
    set_on_expire_hooks(None)
