"""A real OCI registry on loopback for the tests (Debian's docker-registry, the CNCF
distribution registry), with or without htpasswd's Basic auth, and a small image pushed
to it: a root file system made here (busybox, a file, and one the second layer deletes)
packed by umoci and copied in by skopeo; or layer tars made by a test, pushed with the
distribution API (`push_layers`)."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from machine_needs import need

TOOLS = ("docker-registry", "skopeo", "umoci", "htpasswd", "busybox")


def check_tools() -> None:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        need(
            "packages",
            f"{', '.join(missing)} missing: apt-get install docker-registry skopeo umoci "
            "apache2-utils busybox-static (bash infra/install.sh --test)",
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def running_registry(folder: Path, user: tuple[str, str] | None = None) -> Iterator[str]:
    """A registry storing under `folder`; yields its host:port."""
    folder.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    auth = ""
    if user is not None:
        passwords = subprocess.run(
            ["htpasswd", "-Bbn", *user], check=True, capture_output=True, text=True
        ).stdout
        (folder / "htpasswd").write_text(passwords)
        auth = f"auth:\n  htpasswd:\n    realm: ember-test\n    path: {folder / 'htpasswd'}\n"
    config = folder / "config.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: error\n"
        f"storage:\n  filesystem:\n    rootdirectory: {folder / 'data'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n{auth}"
    )
    log = (folder / "registry.log").open("w")
    process = subprocess.Popen(
        ["docker-registry", "serve", str(config)], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        "docker-registry did not start:\n" + (folder / "registry.log").read_text()
                    ) from None
                time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)
        log.close()


def push_small_image(work: Path, destinations: list[tuple[str, tuple[str, str] | None]]) -> str:
    """Build the image with umoci and copy it to each `repo:tag` (with its credentials);
    returns its manifest digest."""
    rootfs = work / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    (rootfs / "etc").mkdir()
    shutil.copy2(shutil.which("busybox") or "busybox", rootfs / "bin" / "busybox")
    for tool in ("sh", "cat", "test", "touch"):
        (rootfs / "bin" / tool).symlink_to("busybox")
    (rootfs / "hello.txt").write_text("hello from the registry\n")
    (rootfs / "etc" / "gone.txt").write_text("deleted by the second layer\n")
    layout = f"{work / 'oci'}:v1"

    def umoci(*args: str) -> None:
        subprocess.run(["umoci", *args], check=True, capture_output=True, text=True)

    umoci("init", "--layout", str(work / "oci"))
    umoci("new", "--image", layout)
    umoci("insert", "--image", layout, str(rootfs), "/")
    umoci("insert", "--image", layout, "--whiteout", "/etc/gone.txt")
    umoci(
        "config",
        "--image",
        layout,
        "--config.env",
        "GREETING=from-registry",
        "--config.workingdir",
        "/work",
    )
    digest = ""
    for destination, user in destinations:
        creds = ["--dest-creds", f"{user[0]}:{user[1]}"] if user else []
        subprocess.run(
            [
                "skopeo",
                "copy",
                "--quiet",
                "--dest-tls-verify=false",
                *creds,
                f"oci:{layout}",
                f"docker://{destination}",
                "--digestfile",
                str(work / "digest"),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        digest = (work / "digest").read_text().strip()
    return digest


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(4 * 1024 * 1024):
            digest.update(chunk)
    return digest.hexdigest()


def push_layers(
    registry: str,
    repository: str,
    tag: str,
    layers: list[Path],
    user: tuple[str, str] | None = None,
) -> str:
    """An OCI image of uncompressed `layers` pushed with the distribution API (with
    `user`'s credentials, for a registry that wants them); its manifest's digest."""
    base = f"http://{registry}/v2/{repository}"
    described = []
    with httpx.Client(timeout=120, auth=httpx.BasicAuth(*user) if user else None) as client:

        def blob(path: Path | None, data: bytes = b"") -> str:
            digest = "sha256:" + (_file_sha256(path) if path else hashlib.sha256(data).hexdigest())
            start = client.post(f"{base}/blobs/uploads/")
            assert start.status_code == 202, start.text
            where = start.headers["location"]
            joiner = "&" if "?" in where else "?"
            body = path.read_bytes() if path else data
            put = client.put(f"{where}{joiner}digest={digest}", content=body)
            assert put.status_code == 201, put.text
            return digest

        for layer in layers:
            digest = blob(layer)
            described.append(
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": digest,
                    "size": layer.stat().st_size,
                }
            )
        config = json.dumps(
            {
                "architecture": "amd64",
                "os": "linux",
                "config": {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"], "WorkingDir": "/"},
                "rootfs": {"type": "layers", "diff_ids": [d["digest"] for d in described]},
            }
        ).encode()
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {
                    "mediaType": "application/vnd.oci.image.config.v1+json",
                    "digest": blob(None, config),
                    "size": len(config),
                },
                "layers": described,
            }
        )
        put = client.put(
            f"{base}/manifests/{tag}",
            content=manifest,
            headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"},
        )
        assert put.status_code == 201, put.text
    return "sha256:" + hashlib.sha256(manifest.encode()).hexdigest()
