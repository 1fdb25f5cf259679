"""pd_wedge: the PD-disaggregation wedge on real transfer engines, and stallguard ending it.

Run ``python -m examples.pd_wedge`` (or ``python examples/pd_wedge/run.py``) from the
repository root, in the project's ``.venv`` (``python3 tools/dev.py env`` builds it).
docs/demo.md explains what it shows and how to read the table and the picture.
"""

from ._main import main

__all__ = ["main"]
