"""Each benchmark's quick mode, run as a user runs it (`python bench/NAME.py --quick`) from
the repository's root: it must reach its verdicts (whichever they are: speed is the
benchmark's to report, never a test's to assert), and one that fails part-way prints
what it measured before.

The servers a benchmark starts sandbox their replicas like any other: the e2e tests'
fixture that has them share a writable folder (and the coverage data folder) serves
here too."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

E2E = Path(__file__).resolve().parents[1] / "e2e"
sys.path.insert(0, str(E2E))

_spec = importlib.util.spec_from_file_location("ember_e2e_fixtures_bench", E2E / "conftest.py")
assert _spec is not None and _spec.loader is not None
_e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_e2e)

_replicas_share_a_folder = _e2e._replicas_share_a_folder
