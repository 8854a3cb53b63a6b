from __future__ import annotations

import shutil
import tempfile
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


REPO = Path(__file__).resolve().parents[2]
SANDBOX_WRITABLE_ENV = "EMBER_SANDBOX_WRITABLE"  # sandboxes.py's WRITABLE_ENV


@pytest.fixture(scope="session", autouse=True)
def sandbox_shared() -> Iterator[Path]:
    """One folder (1777) that every worker the tests start mounts writable into its
    replicas' sandboxes, with the coverage data folder infra/test.sh made: a sandbox
    shows a replica nothing else of the node's, /tmp included."""
    folder = Path(tempfile.mkdtemp(prefix="ember-test-shared-"))
    folder.chmod(0o1777)
    shared = [str(folder)]
    if (REPO / ".coverage-data").is_dir():  # replicas write their coverage data there
        shared.append(str(REPO / ".coverage-data"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SANDBOX_WRITABLE_ENV, ":".join(shared))
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def replica_writable(sandbox_shared: Path) -> Iterator[Path]:
    """A folder a replica may write into, whatever its user: replicas run as their
    workspace's unprivileged uid in a sandbox, and pytest's own temporary folders are
    root's alone (0700). For files a test and a replica pass each other (a PID, a
    progress mark)."""
    folder = Path(tempfile.mkdtemp(dir=sandbox_shared))
    folder.chmod(0o1777)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
