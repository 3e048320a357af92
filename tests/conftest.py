"""Put the repository root on sys.path so tests import `tests.markers` (the package itself is
imported from its install, `weight_transfer`)."""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
