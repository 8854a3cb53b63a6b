"""The attack suite (issue 47): each test is a hostile tenant's action against a real
`ember server` and an outcome an operator could observe on the node (a file written as
root, a token read, another workspace's data shown), written first against the code it
guards and seen failing there.

The e2e tests' harness and fixtures serve here too: their folder goes on sys.path and
their conftest's fixtures are taken over under the same names."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

E2E = Path(__file__).resolve().parents[1] / "e2e"
sys.path.insert(0, str(E2E))

_spec = importlib.util.spec_from_file_location("ember_e2e_fixtures", E2E / "conftest.py")
assert _spec is not None and _spec.loader is not None
_e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_e2e)

_replicas_share_a_folder = _e2e._replicas_share_a_folder
apps_dir = _e2e.apps_dir
