"""Issue 47's environment attacks, tried by a tenant holding a deploy token of its own
workspace against a real `ember server`:

- the node's environment (an operator's S3 secret, a database password set on `ember
  server`) read by the tenant's replica, its `ember replica exec` command and its image's
  build step;
- a shared library the tenant planted in its weights cache, named by `LD_PRELOAD` in its
  endpoint's `env=`, loaded by a process that runs as root outside the sandbox (its
  constructor reads the node's /etc/shadow and leaves a mark where the test looks);
- a `setsid` the tenant planted, found on the `PATH` of one of its secrets by the agent
  that starts `ember replica exec -t`.

Each outcome is looked for on the node: a mark file written by a process that could read
/etc/shadow (root, with the node's own /etc: no sandbox shows it), or the secret's value
in what the tenant got back.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import pty
import select
import shutil
import struct
import subprocess
import termios
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import EMBER, Platform, running_platform
from machine_needs import need
from oci_registry import check_tools, push_small_image, running_registry

NODE_SECRET = "node-s3-secret-5f1d"
NODE_PASSWORD = "node-db-password-8c2e"

TENANT_APP = """\
import base64
import os

import ember


@ember.endpoint(scaledown_window=300, snapshot=False)
def environ() -> dict:
    return dict(os.environ)


@ember.endpoint(scaledown_window=300, snapshot=False)
def plant(name: str, data: str) -> str:
    # The workspace's weights cache: writable, kept on the node across replicas.
    path = os.path.join(os.environ["EMBER_WEIGHTS_CACHE"], name)
    with open(path, "wb") as file:
        file.write(base64.b64decode(data))
    os.chmod(path, 0o755)
    return path
"""

# Run as a constructor by whatever loads it: marks the file MARK when it can read the
# node's /etc/shadow (root, seeing the node's root file system).
PRELOAD_SOURCE = r"""
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

__attribute__((constructor)) static void taken(void) {
    int shadow = open("/etc/shadow", O_RDONLY);
    if (shadow < 0) return;
    close(shadow);
    char line[64];
    int n = snprintf(line, sizeof line, "root pid %d\n", (int)getpid());
    int mark = open("MARK", O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (mark >= 0) { (void)!write(mark, line, n); close(mark); }
}
"""

SETSID_SOURCE = """#!/bin/sh
if [ -r /etc/shadow ]; then echo "root pid $$" >> MARK; fi
exec /usr/bin/setsid "$@"
"""


def _call(platform: Platform, token: str, label: str, body: dict[str, Any]) -> Any:
    with platform.client(token, timeout=240) as client:
        answer = client.post(f"/{label}/", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


class Tenant:
    """Workspace `mallory` and its deploy token, on a platform whose server (and so its
    local worker) has an operator's credentials in its environment."""

    def __init__(self, platform: Platform, folder: Path) -> None:
        self.platform = platform
        self.folder = folder
        platform.ember("workspace", "create", "mallory")
        created = platform.ember("token", "create", "--workspace", "mallory", "--scope", "deploy")
        self.token = created.stdout.strip()

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.platform.ember_as(self.token, *args)

    def deploy(self, name: str, source: str, *, env: dict[str, str] | None = None) -> str:
        """Deploy `source` as app `name` (with `env=` on every endpoint); the CLI's output."""
        app = self.folder / name / "app.py"
        app.parent.mkdir(parents=True, exist_ok=True)
        if env:
            source = source.replace("snapshot=False", f"snapshot=False, env={env!r}")
        app.write_text(source)
        deployed = self.cli("deploy", str(app), "--name", name)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        return deployed.stdout + deployed.stderr

    def call(self, label: str, body: dict[str, Any] | None = None) -> Any:
        return _call(self.platform, self.token, f"mallory--{label}", body or {})

    def plant(self, name: str, data: bytes) -> str:
        """`data` written by the tenant's replica into its weights cache: the node's path
        of it (what the replica reads in /proc/self/mountinfo; looked up here)."""
        self.call("tools--plant", {"name": name, "data": base64.b64encode(data).decode()})
        found = list(self.platform.root.rglob(name))
        assert len(found) == 1, found
        return str(found[0])


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    root = tmp_path_factory.mktemp("platform")
    node_env = {"AWS_SECRET_ACCESS_KEY": NODE_SECRET, "PGPASSWORD": NODE_PASSWORD}
    # The operator hands none of them on (--replica-env): the harness would, by default.
    with running_platform(root, env=node_env, replica_env=()) as running:
        yield running


@pytest.fixture(scope="module")
def tenant(platform: Platform, tmp_path_factory: pytest.TempPathFactory) -> Tenant:
    found = Tenant(platform, tmp_path_factory.mktemp("tenant"))
    found.deploy("tools", TENANT_APP)
    return found


@pytest.fixture
def mark(replica_writable: Path) -> Path:
    """Where a root process the tenant reached leaves its mark (the node's path; a
    sandbox shows the same folder at the same path)."""
    return replica_writable / "mark"


def _compiled(source: str, mark: Path, folder: Path) -> bytes:
    if shutil.which("cc") is None:
        need("packages", "no C compiler (cc) to build the tenant's library with")
    (folder / "taken.c").write_text(source.replace("MARK", str(mark)))
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-o", str(folder / "taken.so"), str(folder / "taken.c")],
        check=True,
    )
    return (folder / "taken.so").read_bytes()


def _no_root_mark(mark: Path) -> None:
    marked = mark.read_text() if mark.exists() else ""
    assert marked == "", f"a root process outside the sandbox ran the tenant's code: {marked}"


def test_the_nodes_environment_reaches_no_replica_no_exec_command(
    platform: Platform, tenant: Tenant
) -> None:
    seen = tenant.call("tools--environ")
    leaked = {k: v for k, v in seen.items() if NODE_SECRET in v or NODE_PASSWORD in v}
    assert leaked == {}, f"the node's variables reached the replica: {sorted(leaked)}"
    assert seen["HOME"] == "/home/replica" and seen["PATH"]  # its own base is there
    listed = json.loads(tenant.cli("replica", "ls", "tools", "--json").stdout)
    replica = next(row["id"] for row in listed if row["label"].endswith("--environ"))
    shown = tenant.cli("replica", "exec", replica, "--", "env")
    assert shown.returncode == 0, shown.stderr
    assert "EMBER_REPLICA_PID=" in shown.stdout  # it ran in the replica
    assert NODE_SECRET not in shown.stdout and NODE_PASSWORD not in shown.stdout


def test_the_nodes_environment_reaches_no_build_step(
    platform: Platform, tenant: Tenant, tmp_path: Path
) -> None:
    check_tools()
    with running_registry(tmp_path / "registry") as registry:
        push_small_image(tmp_path / "image", [(f"{registry}/tools/box:v1", None)])
        source = (
            "import ember\n\n"
            f"image = ember.Image.from_registry('{registry}/tools/box:v1')"
            ".run_commands('echo step-env-begins; busybox env; echo step-env-ends')\n\n\n"
            "@ember.endpoint(image=image)\n"
            "def boxed() -> str:\n"
            "    return 'never runs: the image has no Python'\n"
        )
        output = tenant.deploy("boxed", source)
    assert "step-env-ends" in output, output  # the step ran, its output streamed back
    assert NODE_SECRET not in output and NODE_PASSWORD not in output, output


def test_ld_preload_in_an_images_env_never_loads_into_the_nodes_build_tools(
    tenant: Tenant, mark: Path, tmp_path: Path
) -> None:
    check_tools()
    library = tenant.plant("taken-by-build.so", _compiled(PRELOAD_SOURCE, mark, tmp_path))
    with running_registry(tmp_path / "registry") as registry:
        push_small_image(tmp_path / "image", [(f"{registry}/tools/box:v1", None)])
        source = (
            "import ember\n\n"
            f"image = ember.Image.from_registry('{registry}/tools/box:v1')"
            f".env({{'LD_PRELOAD': '{library}'}})"
            ".run_commands('echo built-with-the-preload-named')\n\n\n"
            "@ember.endpoint(image=image)\n"
            "def boxed() -> str:\n"
            "    return 'never runs: the image has no Python'\n"
        )
        output = tenant.deploy("preboxed", source)
    assert "built-with-the-preload-named" in output, output
    _no_root_mark(mark)


BACKEND = """\
import os

try:
    open("/etc/shadow").close()
except OSError:
    pass
else:
    with open("MARK", "a") as mark:
        mark.write(f"root pid {os.getpid()}\\n")


def build_wheel(*args, **kwargs):
    raise RuntimeError("built nothing")
"""


def test_a_requirement_built_from_the_bundle_never_runs_as_root(tenant: Tenant, mark: Path) -> None:
    """A local project named in requirements.txt: pip builds it with the project's own
    in-tree build backend (no download), whose code is the tenant's."""
    app = tenant.folder / "built" / "app.py"
    project = app.parent / "evil"
    project.mkdir(parents=True)
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
        '[project]\nname = "evil"\nversion = "1.0"\n'
    )
    (project / "backend.py").write_text(BACKEND.replace("MARK", str(mark)))
    (app.parent / "requirements.txt").write_text("./evil\n")
    app.write_text(TENANT_APP)
    deployed = tenant.cli("deploy", str(app), "--name", "built")
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    with tenant.platform.client(tenant.token, timeout=240) as client:
        answer = client.post("/mallory--built--environ/", json={})
    assert answer.status_code >= 500 and "built nothing" in answer.text, answer.text
    _no_root_mark(mark)


def test_ld_preload_in_env_never_loads_into_a_root_process(
    tenant: Tenant, mark: Path, tmp_path: Path
) -> None:
    library = tenant.plant("taken.so", _compiled(PRELOAD_SOURCE, mark, tmp_path))
    tenant.deploy("preloaded", TENANT_APP, env={"LD_PRELOAD": library})
    seen = tenant.call("preloaded--environ")  # a cold start of the new version
    assert seen["LD_PRELOAD"] == library  # the tenant's variable is the replica's
    _no_root_mark(mark)


def test_path_in_a_secret_never_picks_what_the_agent_runs_as_root(
    platform: Platform, tenant: Tenant, mark: Path
) -> None:
    setsid = tenant.plant("setsid", SETSID_SOURCE.replace("MARK", str(mark)).encode())
    folder = os.path.dirname(setsid)
    secret = tenant.cli("secret", "set", "paths", f"PATH={folder}:/usr/bin:/bin")
    assert secret.returncode == 0, secret.stderr
    tenant.deploy(
        "pathed", TENANT_APP.replace("snapshot=False", "snapshot=False, secrets=['paths']")
    )
    assert tenant.call("pathed--environ")["PATH"].startswith(folder)
    listed = json.loads(tenant.cli("replica", "ls", "pathed", "--json").stdout)
    replica = next(row["id"] for row in listed if row["label"].endswith("--environ"))
    main, far = pty.openpty()
    fcntl.ioctl(far, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = platform.tenant_env(tenant.token)
    cli = subprocess.Popen(
        [*EMBER, "replica", "exec", replica, "-t", "--", "sh", "-c", "echo ran-$((6*7))"],
        stdin=far,
        stdout=far,
        stderr=far,
        env=env,
        start_new_session=True,
    )
    os.close(far)
    output = b""
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if select.select([main], [], [], 0.1)[0]:
                try:
                    chunk = os.read(main, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                output += chunk
            elif cli.poll() is not None:
                break
        cli.wait(30)
    finally:
        if cli.poll() is None:
            cli.kill()
        os.close(main)
    assert b"ran-42" in output, output  # the command ran, with a terminal
    _no_root_mark(mark)
