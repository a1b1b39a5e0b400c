"""Makes tests/schedules/schedule_testkit.py importable (pyproject's pythonpath only holds tests/); the suite-wide
tests/conftest.py pins one intra-op thread."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
