"""The weight-sync tests import their helpers (weights_support.py) from this directory, as
the multi-process test's subprocesses do."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
