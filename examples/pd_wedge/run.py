"""``python examples/pd_wedge/run.py [options]``: the same as ``python -m examples.pd_wedge``."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.pd_wedge import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
