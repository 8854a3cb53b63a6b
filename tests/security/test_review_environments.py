"""Review attacks on a requirement's environment build (agent/environments.py): pip and
the tenant's build backend run as the workspace's uid, the folder is the uid's while
pip runs and root's after, and the agent (root) keeps using the folder afterwards.

- The backend plants `.ember-ready` in the environment's folder as a link to a path of
  the node's: after pip the agent (root) `touch`es the marker by name, following the
  link, and creates a file where the tenant chose (here: in a folder only root may
  write in).
- The backend swaps the environment's `bin/python` for a link to the platform's admin
  token: before the replica starts, the agent (root) grants the workspace's uid read and
  execute on the interpreter's real path (replica_access.runtime_paths resolves the
  link) and passage through the folders above it; the next build's backend, which runs
  unsandboxed as that uid, reads the token.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness import Platform, running_platform
from test_environment import TENANT_APP, Tenant

# An in-tree build backend (no download): plants the link, then builds a real wheel so
# that the install ends well and the agent goes on to mark the environment ready.
PLANTING_BACKEND = """\
import os
import zipfile

TARGET = "TARGET_PATH"
INFO = "planted-1.0.dist-info"
METADATA = "Metadata-Version: 2.1\\nName: planted\\nVersion: 1.0\\n"


def _plant():
    # pip's HOME is <environment folder>/ember-build-home.
    folder = os.path.dirname(os.environ["HOME"])
    PLANT_BODY


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    # Given, so that build_wheel is pip's last call of the backend (no process of the
    # environment's interpreter is started after it).
    os.makedirs(os.path.join(metadata_directory, INFO))
    with open(os.path.join(metadata_directory, INFO, "METADATA"), "w") as file:
        file.write(METADATA)
    return INFO


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _plant()
    name = "planted-1.0-py3-none-any.whl"
    info = INFO
    files = {
        f"{info}/METADATA": METADATA,
        f"{info}/WHEEL": "Wheel-Version: 1.0\\nGenerator: x\\nRoot-Is-Purelib: true\\n"
        "Tag: py3-none-any\\n",
        "planted_mod.py": "X = 1\\n",
    }
    record = "".join(f"{path},,\\n" for path in files) + f"{info}/RECORD,,\\n"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)
        wheel.writestr(f"{info}/RECORD", record)
    return name
"""


# What the planting backends do in the environment's folder (`folder`), as its uid.
READY_LINK = """marker = os.path.join(folder, ".ember-ready")
    os.symlink(TARGET, marker)"""
PYTHON_LINK = """python = os.path.join(folder, "bin", "python")
    os.unlink(python)
    os.symlink(TARGET, python)"""
# Unsandboxed as the workspace's uid: reads TARGET and fails the build with its text.
READ_TARGET = """with open(TARGET) as file:
        raise RuntimeError("read-by-the-tenant:" + file.read().strip())"""


def _backend(target: Path | str, body: str) -> str:
    return PLANTING_BACKEND.replace("TARGET_PATH", str(target)).replace("PLANT_BODY", body)


def _post(platform: Platform, token: str, label: str) -> httpx.Response:
    with platform.client(token, timeout=240) as client:
        return client.post(f"/{label}/", json={})


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(tmp_path_factory.mktemp("platform"), replica_env=()) as running:
        yield running


@pytest.fixture(scope="module")
def tenant(platform: Platform, tmp_path_factory: pytest.TempPathFactory) -> Tenant:
    return Tenant(platform, tmp_path_factory.mktemp("tenant"))


def _deploy_with_backend(tenant: Tenant, name: str, backend: str) -> None:
    app = tenant.folder / name / "app.py"
    project = app.parent / "proj"
    project.mkdir(parents=True)
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
        '[project]\nname = "planted"\nversion = "1.0"\n'
    )
    (project / "backend.py").write_text(backend)
    (app.parent / "requirements.txt").write_text("./proj\n")
    app.write_text(TENANT_APP)
    deployed = tenant.cli("deploy", str(app), "--name", name)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr


def test_a_link_planted_as_the_ready_marker_makes_root_write_no_file(
    tenant: Tenant, tmp_path: Path
) -> None:
    root_only = tmp_path / "root-only"
    root_only.mkdir(mode=0o700)  # no workspace's uid may create anything here
    os.chmod(tmp_path, 0o711)
    target = root_only / "written-by-root"
    _deploy_with_backend(tenant, "marked", _backend(target, READY_LINK))
    answer = _post(tenant.platform, tenant.token, "mallory--marked--environ")
    assert answer.status_code == 200, answer.text  # the environment was built and used
    assert not target.exists(), (
        f"the agent, as root, followed the tenant's link and created {target} "
        f"(owner uid {target.stat().st_uid}, mode {oct(target.stat().st_mode)})"
    )


def test_a_link_planted_as_the_interpreter_opens_no_node_file_to_the_tenant(
    platform: Platform, tenant: Tenant
) -> None:
    """The backend swaps the environment's `bin/python` for a link to the admin token;
    the agent (root) grants the workspace's uid read and execute on the interpreter's
    real path (and binds it into the sandbox) before the replica starts. A second
    app's backend, unsandboxed as the same uid, then reads the token."""
    token_file = platform.state_dir / "admin-token"
    _deploy_with_backend(tenant, "before", _backend(token_file, READ_TARGET))
    before = _post(platform, tenant.token, "mallory--before--environ")
    assert "read-by-the-tenant" not in before.text and "Permission denied" in before.text
    _deploy_with_backend(tenant, "relinked", _backend(token_file, PYTHON_LINK))
    first = _post(platform, tenant.token, "mallory--relinked--environ")  # the grant
    _deploy_with_backend(tenant, "reader", _backend(token_file, READ_TARGET))
    second = _post(platform, tenant.token, "mallory--reader--environ")
    assert platform.token not in second.text, (
        f"the tenant read the platform's admin token ({first.status_code} then "
        f"{second.status_code}): {second.text[-300:]}"
    )
