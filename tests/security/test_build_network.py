"""Issue 48's network attacks from an image build step, by a tenant with a deploy token
of its own workspace whose image's `run_commands` step probes the node (a static
program the tenant ships in its registry image, its findings printed into the build
output that `ember deploy` streams back):

- a service on the node's loopback (an operator's database) connected to, and one on
  the node's own address;
- an abstract Unix socket of the node's looked for in `/proc/net/unix` and connected to.

Each must be refused at once (a failed connection, not a hang of the step); and the
step still reaches out (apt and pip download packages in build steps): a server in a
network namespace of the test's own, routed from the node as the internet would be,
answers it. Its network ends with it: no pasta of the builds' network uid is left
running once its namespace's holder is gone.
"""

from __future__ import annotations

import io
import os
import re
import secrets
import shutil
import socket
import subprocess
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import EMBER, Platform, running_platform
from machine_needs import need
from oci_registry import check_tools, push_layers, running_registry
from test_network import _node_address, internet_stand_in

from ember_worker.networks.namespaces import NET_UIDS

# Static, so that it runs on an image holding busybox alone. `probe tcp HOST PORT` and
# `probe abstract NAME` print "WHAT answered: LINE (S s)" or "WHAT failed: WHY (S s)".
PROBE_SOURCE = r"""
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    double began = now();
    struct timeval limit = {10, 0};  /* connect and read give up past it */
    int fd = -1, connected = -1;
    if (argc == 4 && strcmp(argv[1], "tcp") == 0) {
        struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[3]))};
        inet_pton(AF_INET, argv[2], &to.sin_addr);
        fd = socket(AF_INET, SOCK_STREAM, 0);
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit);
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
        connected = connect(fd, (struct sockaddr *)&to, sizeof to);
    } else if (argc == 3 && strcmp(argv[1], "abstract") == 0) {
        struct sockaddr_un to = {.sun_family = AF_UNIX};
        size_t length = strlen(argv[2]);
        memcpy(to.sun_path + 1, argv[2], length);
        fd = socket(AF_UNIX, SOCK_STREAM, 0);
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
        connected = connect(
            fd, (struct sockaddr *)&to, offsetof(struct sockaddr_un, sun_path) + 1 + length);
    } else {
        fprintf(stderr, "usage: probe tcp HOST PORT | probe abstract NAME\n");
        return 2;
    }
    char got[128] = {0};
    if (connected == 0 && read(fd, got, sizeof got - 1) > 0) {
        got[strcspn(got, "\n")] = 0;
        printf("%s %s answered: %s (%.1f s)\n", argv[1], argv[2], got, now() - began);
    } else {
        printf("%s %s failed: %s (%.1f s)\n", argv[1], argv[2], strerror(errno), now() - began);
    }
    return 0;
}
"""
IMAGE = "tools/probe"
OUTCOME = re.compile(r"(\w+) (\S+) (answered|failed): (.*) \(([\d.]+) s\)")


def _layer(work: Path, probe: bytes) -> Path:
    """One OCI layer: busybox and the probe."""
    archive = work / "layer.tar"
    with tarfile.open(archive, "w") as tar:

        def add(
            name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = ""
        ) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.size, info.linkname = kind, len(data), link
            info.mode = 0o1777 if name == "tmp" else 0o755
            tar.addfile(info, io.BytesIO(data) if data else None)

        for folder in ("bin", "tmp", "proc"):  # the step's /proc is mounted on its own
            add(folder, kind=tarfile.DIRTYPE)
        add("bin/busybox", Path(shutil.which("busybox") or "busybox").read_bytes())
        for tool in ("sh", "echo", "grep", "mkdir"):
            add(f"bin/{tool}", kind=tarfile.SYMTYPE, link="busybox")
        add("bin/probe", probe)
    return archive


def _serve_line(listener: socket.socket, line: bytes) -> None:
    """Answer every connection with `line`, until the listener is closed."""

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.sendall(line)

    threading.Thread(target=serve, daemon=True).start()


class Registry:
    """The tenant's registry, holding the probe's image."""

    def __init__(self, address: str) -> None:
        self.address = address

    def image(self, *commands: str) -> str:
        steps = ", ".join(repr(command) for command in commands)
        return f"ember.Image.from_registry('{self.address}/{IMAGE}:v1').run_commands({steps})"


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    if os.geteuid() != 0:
        need("root", "image build steps run in namespaces of their own, made by a root worker")
    with running_platform(tmp_path_factory.mktemp("build-network")) as running:
        yield running


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    check_tools()
    if shutil.which("cc") is None:
        need("packages", "no C compiler (cc) to build the tenant's probe with")
    work = tmp_path_factory.mktemp("probe")
    (work / "probe.c").write_text(PROBE_SOURCE)
    subprocess.run(
        ["cc", "-static", "-O1", "-o", str(work / "probe"), str(work / "probe.c")], check=True
    )
    with running_registry(work / "registry") as address:
        push_layers(address, IMAGE, "v1", [_layer(work, (work / "probe").read_bytes())])
        yield Registry(address)


@pytest.fixture(scope="module")
def mallory(platform: Platform) -> dict[str, str]:
    """The tenant's environment for `ember`: a deploy token of its own workspace."""
    platform.ember("workspace", "create", "mallory")
    token = platform.ember("token", "create", "--workspace", "mallory", "--scope", "deploy")
    return platform.tenant_env(token.stdout.strip())


def _build(env: dict[str, str], folder: Path, image: str) -> str:
    """Deploy an app on `image` (its build runs the probes): the deploy's output."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "app.py").write_text(
        f"import ember\n\nimage = {image}\n\n\n"
        "@ember.endpoint(image=image)\ndef probed() -> str:\n    return 'never runs'\n"
    )
    deployed = subprocess.run(
        [*EMBER, "deploy", str(folder / "app.py"), "--name", folder.name],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    said = deployed.stdout + deployed.stderr
    assert deployed.returncode == 0, said  # the step ran, its output streamed back
    return said


def _outcomes(said: str) -> dict[str, tuple[str, str, float]]:
    """The probes' outcomes by what they tried ("tcp 127.0.0.1"): (answered or failed,
    the line or why, seconds)."""
    found = OUTCOME.findall(said)
    return {f"{kind} {target}": (how, what, float(s)) for kind, target, how, what, s in found}


def _refused_at_once(outcome: tuple[str, str, float], what: str) -> None:
    how, said, seconds = outcome
    assert how == "failed", f"the build step reached {what}: {said}"
    assert seconds < 5, f"{what} hung the build step for {seconds:.1f} s ({said})"


def test_a_build_step_cannot_reach_a_service_on_the_node(
    mallory: dict[str, str], registry: Registry, tmp_path: Path
) -> None:
    loopback = socket.create_server(("127.0.0.1", 0))
    _serve_line(loopback, b"node-database\n")
    probes = [f"/bin/probe tcp 127.0.0.1 {loopback.getsockname()[1]}"]
    node_address = _node_address()
    own: socket.socket | None = None
    if node_address is not None:  # a service on the node's own address, through egress
        own = socket.create_server((node_address, 0))
        _serve_line(own, b"node-service\n")
        probes.append(f"/bin/probe tcp {node_address} {own.getsockname()[1]}")
    try:
        said = _build(mallory, tmp_path / "tcp", registry.image(" && ".join(probes)))
    finally:
        loopback.close()
        if own is not None:
            own.close()
    outcomes = _outcomes(said)
    assert "tcp 127.0.0.1" in outcomes, said
    _refused_at_once(outcomes["tcp 127.0.0.1"], "the node's loopback service")
    if node_address is not None:
        _refused_at_once(outcomes[f"tcp {node_address}"], f"the node's address {node_address}")


def test_a_build_step_neither_sees_nor_reaches_the_nodes_abstract_sockets(
    mallory: dict[str, str], registry: Registry, tmp_path: Path
) -> None:
    name = f"ember-node-{secrets.token_hex(4)}"
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind("\0" + name)
    abstract.listen()
    _serve_line(abstract, b"node-abstract\n")
    listing = f'echo "listed: $(grep -c {name} /proc/net/unix)"'
    try:
        said = _build(
            mallory, tmp_path / "unix", registry.image(f"{listing} && /bin/probe abstract {name}")
        )
    finally:
        abstract.close()
    assert "listed: 0" in said, f"the node's abstract socket is listed:\n{said}"
    outcomes = _outcomes(said)
    assert f"abstract {name}" in outcomes, said
    _refused_at_once(outcomes[f"abstract {name}"], "the node's abstract socket")


def test_a_build_step_still_reaches_the_internet(
    mallory: dict[str, str], registry: Registry, tmp_path: Path
) -> None:
    """A server in a network namespace of the test's own, routed from the node over a
    veth pair: what a package mirror is to the node."""
    with internet_stand_in() as (address, port):
        said = _build(mallory, tmp_path / "out", registry.image(f"/bin/probe tcp {address} {port}"))
    outcome = _outcomes(said).get(f"tcp {address}")
    assert outcome is not None and outcome[:2] == ("answered", "from-the-internet"), said


def _pastas_left(uid: int) -> dict[str, str]:
    """pasta processes of `uid` whose namespace's holder (the pid they were given, last
    on their command line) has ended, by pid: what nobody will end."""
    left = {}
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or entry.stat().st_uid != uid:
                continue
            words = (entry / "cmdline").read_bytes().decode().split("\0")[:-1]
        except OSError:
            continue
        pasta = bool(words) and "pasta" in words[0] and words[-1].isdigit()
        if pasta and not Path(f"/proc/{words[-1]}").exists():
            left[entry.name] = " ".join(words)
    return left


def test_a_build_steps_network_ends_with_it(
    mallory: dict[str, str], registry: Registry, tmp_path: Path
) -> None:
    before = _pastas_left(NET_UIDS.build)  # an earlier worker's, if any
    _build(mallory, tmp_path / "ends", registry.image("echo one", "echo two"))
    left = [cmd for pid, cmd in _pastas_left(NET_UIDS.build).items() if pid not in before]
    assert not left, f"{len(left)} build network(s) outlived their step: {left[:3]}"
