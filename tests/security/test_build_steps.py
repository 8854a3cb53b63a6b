"""Issue 47's image build attacks, by a tenant with a deploy token of its own workspace:

- the textbook chroot escape in a `run_commands` step (chroot into a subfolder, chdir
  past it, chroot("."): a static program the tenant ships in its registry image) then
  writing a file on the node and printing the platform's admin token into the build
  output that `ember deploy` streams back;
- a step that writes the node's kernel settings through /proc/sys (its NIS domain name,
  put back after the test if it changed);
- a step that opens a block device node its registry layer carries (the node's disk);
- a `sleep` step that never ends: it fails at the step timeout, saying so, and another
  workspace's build on the same node finishes meanwhile.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import EMBER, Platform, running_platform, wait_for
from machine_needs import need
from oci_registry import check_tools, push_layers, running_registry

STEP_TIMEOUT = 20  # seconds: the platform's --build-step-timeout here

# Static, so that it runs on an image with nothing else: escapes the chroot if it can,
# then writes MARK and prints the admin token it finds at TOKEN.
ESCAPE_SOURCE = r"""
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

int main(void) {
    mkdir("/jail", 0755);
    if (chroot("/jail") != 0) { perror("chroot into /jail"); }
    for (int i = 0; i < 64; i++) chdir("..");
    if (chroot(".") != 0) { perror("chroot(.)"); }
    int mark = open("MARK", O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (mark >= 0) { (void)!write(mark, "escaped\n", 8); close(mark); }
    else perror("writing the mark");
    char token[256] = {0};
    int fd = open("TOKEN", O_RDONLY);
    if (fd >= 0 && read(fd, token, sizeof token - 1) > 0) printf("stolen: %s\n", token);
    else perror("reading the token");
    int sys = open("/proc/sys/kernel/domainname", O_WRONLY);
    if (sys >= 0 && write(sys, "pwned", 5) == 5) printf("wrote /proc/sys\n");
    else perror("writing /proc/sys");
    int disk = open("/disk", O_RDONLY);
    char block[512];
    if (disk >= 0 && read(disk, block, sizeof block) == sizeof block) printf("read the disk\n");
    else perror("reading /disk");
    printf("escape-tried\n");
    return 0;
}
"""


def _layer(work: Path, escape: bytes, disk: tuple[int, int]) -> Path:
    """One OCI layer: busybox, the escape program, and a block device node `disk`."""
    archive = work / "layer.tar"
    with tarfile.open(archive, "w") as tar:

        def add(
            name: str,
            data: bytes = b"",
            mode: int = 0o755,
            kind: bytes = tarfile.REGTYPE,
            link: str = "",
        ) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.size, info.linkname = kind, mode, len(data), link
            tar.addfile(info, io.BytesIO(data) if data else None)

        add("bin", kind=tarfile.DIRTYPE)
        add("tmp", kind=tarfile.DIRTYPE, mode=0o1777)
        add("proc", kind=tarfile.DIRTYPE)  # where the step's /proc is mounted
        add("bin/busybox", Path(shutil.which("busybox") or "busybox").read_bytes())
        for tool in ("sh", "sleep", "echo", "cat"):
            add(f"bin/{tool}", kind=tarfile.SYMTYPE, link="busybox")
        add("bin/escape", escape)
        device = tarfile.TarInfo("disk")
        device.type, device.mode = tarfile.BLKTYPE, 0o666
        device.devmajor, device.devminor = disk
        tar.addfile(device)
    return archive


def _a_step_sleeps() -> bool:
    """Whether the stuck step's `sleep 100000` runs on the node."""
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and (entry / "cmdline").read_bytes() == b"sleep\x00100000\x00":
                return True
    return False


def _node_disk() -> tuple[int, int]:
    """The block device the node's root file system is on."""
    device = Path("/").stat().st_dev
    return (device >> 8) & 0xFFF, (device & 0xFF) | ((device >> 12) & 0xFFF00)


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    extra = ("--build-step-timeout", str(STEP_TIMEOUT))
    with running_platform(tmp_path_factory.mktemp("platform"), extra=extra) as running:
        yield running


def _tenant(platform: Platform, workspace: str) -> dict[str, str]:
    platform.ember("workspace", "create", workspace)
    token = platform.ember("token", "create", "--workspace", workspace, "--scope", "deploy")
    return platform.tenant_env(token.stdout.strip())


def _deploy(
    env: dict[str, str], folder: Path, name: str, image: str
) -> subprocess.CompletedProcess[str]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "app.py").write_text(
        f"import ember\n\nimage = {image}\n\n\n"
        "@ember.endpoint(image=image)\ndef boxed() -> str:\n    return 'never runs'\n"
    )
    return subprocess.run(
        [*EMBER, "deploy", str(folder / "app.py"), "--name", name],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_build_step_cannot_escape_to_the_node(
    platform: Platform, tmp_path: Path, replica_writable: Path
) -> None:
    check_tools()
    if shutil.which("cc") is None:
        need("packages", "no C compiler (cc) to build the tenant's program with")
    mark = replica_writable / "escaped"
    token_file = platform.state_dir / "admin-token"
    source = ESCAPE_SOURCE.replace("MARK", str(mark)).replace("TOKEN", str(token_file))
    (tmp_path / "escape.c").write_text(source)
    subprocess.run(
        ["cc", "-static", "-O1", "-o", str(tmp_path / "escape"), str(tmp_path / "escape.c")],
        check=True,
    )
    layer = _layer(tmp_path, (tmp_path / "escape").read_bytes(), _node_disk())
    domain = Path("/proc/sys/kernel/domainname")
    before = domain.read_text()
    env = _tenant(platform, "mallory")
    with running_registry(tmp_path / "registry") as registry:
        push_layers(registry, "tools/jail", "v1", [layer])
        image = f"ember.Image.from_registry('{registry}/tools/jail:v1').run_commands('/bin/escape')"
        try:
            deployed = _deploy(env, tmp_path / "app", "jail", image)
        finally:
            if domain.read_text() != before:
                domain.write_text(before)
    output = deployed.stdout + deployed.stderr
    assert "escape-tried" in output, output  # the step ran, its output streamed back
    assert platform.token not in output, "the build printed the platform's admin token"
    assert not mark.exists(), f"the step wrote {mark} on the node as uid {mark.stat().st_uid}"
    assert "wrote /proc/sys" not in output, output
    assert "read the disk" not in output, output


def test_a_step_that_never_ends_fails_at_its_timeout_and_blocks_no_other_build(
    platform: Platform, tmp_path: Path
) -> None:
    check_tools()
    layer = _layer(tmp_path, b"", (1, 3))
    stuck_env, other_env = _tenant(platform, "sleepy"), _tenant(platform, "busy")
    with running_registry(tmp_path / "registry") as registry:
        push_layers(registry, "tools/box", "v1", [layer])
        base = f"ember.Image.from_registry('{registry}/tools/box:v1')"
        stuck: dict[str, subprocess.CompletedProcess[str]] = {}
        hanging = threading.Thread(
            target=lambda: stuck.update(
                done=_deploy(
                    stuck_env, tmp_path / "stuck", "stuck", f"{base}.run_commands('sleep 100000')"
                )
            )
        )
        hanging.start()
        wait_for(_a_step_sleeps, 120)  # the stuck step runs
        other = _deploy(
            other_env, tmp_path / "other", "other", f"{base}.run_commands('echo other-built')"
        )
        still_stuck = "done" not in stuck  # the other did not wait for its timeout
        hanging.join(300)
    assert other.returncode == 0 and "other-built" in other.stdout + other.stderr, other.stderr
    assert still_stuck, "the other workspace's build waited for the stuck step to end"
    done = stuck["done"]
    said = done.stdout + done.stderr
    assert done.returncode != 0, said
    assert f"ran past its timeout of {STEP_TIMEOUT} s" in said, said
