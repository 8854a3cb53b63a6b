from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Platform, running_platform

APPS = Path(__file__).parent / "apps"


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """One platform per test module, with the domain set so both URL forms work."""
    root = tmp_path_factory.mktemp("platform")
    with running_platform(root, extra=("--domain", "ember.localhost")) as running:
        yield running


@pytest.fixture(scope="module")
def apps_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of tests/e2e/apps, so bundles never pick up stray files."""
    target = tmp_path_factory.mktemp("apps") / "apps"
    shutil.copytree(APPS, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


@pytest.fixture(scope="session", autouse=True)
def _replicas_share_a_folder(sandbox_shared: Path) -> None:
    """Every server these tests start shows its replicas the session's shared folder
    (tests/conftest.py's `sandbox_shared`)."""
