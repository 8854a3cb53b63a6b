"""The deploy path checks its input, against a real server and its local worker: hostile
bundles are refused at upload naming the member (and not stored), a manifest entry
outside the bundle is refused at deploy, a bundle folder changed on the node is extracted
again before the next cold start, and unused folders go past the disk budget."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Platform, running_platform, wait_for

import ember
from ember.bundle import build_bundle
from ember.wire.bundle_rules import MAX_EXPANDED_BYTES

BUDGET_BYTES = 1_000_000  # --bundle-cache-gb=0.001

APP = """
import ember


@ember.endpoint(snapshot=False)
def which() -> str:
    return {answer!r}
"""


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    root = tmp_path_factory.mktemp("platform")
    extra = ("--bundle-cache-gb", f"{BUDGET_BYTES / 1e9:g}")
    with running_platform(root, extra=extra) as running:
        yield running


def _tar(*members: tarfile.TarInfo, zeros: int = 0) -> bytes:
    buf = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, compresslevel=9) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        app = tarfile.TarInfo("app.py")
        app.size = 1
        tar.addfile(app, io.BytesIO(b"\n"))
        for member in members:
            tar.addfile(member)
        if zeros:
            big = tarfile.TarInfo("zeros.bin")
            big.size = zeros
            with open("/dev/zero", "rb") as source:  # read as far as the size says
                tar.addfile(big, source)
    return buf.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    return info


def _stored(platform: Platform, digest: str) -> list[Path]:
    return list(platform.state_dir.rglob(f"*{digest.split(':')[1]}*"))


def _bundles_dir(platform: Platform) -> Path:
    return platform.state_dir / "worker" / "bundles"


def _write_app(folder: Path, answer: str, extra: dict[str, bytes] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "app.py").write_text(APP.format(answer=answer))
    for name, data in (extra or {}).items():
        (folder / name).write_bytes(data)
    return folder / "app.py"


def _which(platform: Platform, app: str) -> str:
    endpoint = ember.Endpoint.lookup(app, "which", config=platform.config())
    return str(endpoint.call())


def test_hostile_bundles_are_refused_at_upload_and_not_stored(platform: Platform) -> None:
    cases = [
        (_tar(_member("../x")), 400, "bundle member '../x' escapes the bundle folder"),
        (_tar(_member("/etc/x")), 400, "bundle member '/etc/x' is an absolute path"),
        (
            _tar(_member("evil", tarfile.SYMTYPE, "/etc/passwd")),
            400,
            "bundle member 'evil' is a symbolic link to '/etc/passwd'",
        ),
        (
            _tar(_member("again", tarfile.LNKTYPE, "app.py")),
            400,
            "bundle member 'again' is a hard link to 'app.py'",
        ),
        # Zeros past the server's cap: a small upload (gzip compresses them ~1000 times).
        (
            _tar(zeros=MAX_EXPANDED_BYTES),
            413,
            f"bundle member 'zeros.bin' takes the bundle over {MAX_EXPANDED_BYTES} bytes",
        ),
    ]
    with platform.client() as client:
        for data, status, message in cases:
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            began = time.monotonic()
            response = client.put(f"/v1/bundles/{digest}", content=data)
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert error["type"] == ("payload_too_large" if status == 413 else "invalid_request")
            assert message in error["message"]
            assert time.monotonic() - began < 10
            assert _stored(platform, digest) == []
            if status == 413:
                assert len(data) < 1_000_000


def test_a_manifest_entry_outside_the_bundle_is_refused(platform: Platform, tmp_path: Path) -> None:
    bundle = build_bundle(_write_app(tmp_path / "entry", "fine").parent)
    with platform.client() as client:
        put = client.put(f"/v1/bundles/{bundle.digest}", content=bundle.data)
        assert put.status_code == 201, put.text
        for entry in ("../x.py", "/abs.py"):
            manifest: dict[str, object] = {"entry": entry, "endpoints": []}
            deploy = {"manifest": manifest, "bundle_digest": bundle.digest}
            response = client.post("/v1/apps/escaping/deployments", json=deploy)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["type"] == "invalid_request"
            assert f"entry '{entry}'" in error["message"]
    assert not [e for e in platform.status()["endpoints"] if e["label"].startswith("escaping--")]


def test_a_bundle_changed_on_the_node_is_extracted_again_before_a_cold_start(
    platform: Platform, tmp_path: Path
) -> None:
    file = _write_app(tmp_path / "guarded", "original")
    digest = build_bundle(file.parent).digest
    platform.deploy(file, "guarded")
    assert _which(platform, "guarded") == "original"
    folder = _bundles_dir(platform) / digest.replace(":", "-")
    on_node = folder / "app.py"
    on_node.write_text(APP.format(answer="tampered"))  # as an attacker on the node would
    platform.ember("stop", "guarded")
    platform.deploy(file, "guarded")  # the same bundle: a cold start from the same folder
    assert _which(platform, "guarded") == "original"
    assert "original" in on_node.read_text()
    said = f"bundle {digest}: its extracted folder has 'app.py' changed; moved aside and removed"
    assert any(said in line for line in platform.output), "\n".join(platform.output[-30:])
    platform.ember("stop", "guarded")


def test_unused_bundle_folders_go_past_the_budget(platform: Platform, tmp_path: Path) -> None:
    small = _write_app(tmp_path / "small", "small")
    small_digest = build_bundle(small.parent).digest
    small_folder = _bundles_dir(platform) / small_digest.replace(":", "-")
    platform.deploy(small, "small")
    assert _which(platform, "small") == "small"
    platform.ember("stop", "small")  # its replica ends: the folder is unused, but fits
    time.sleep(1)
    assert small_folder.is_dir()
    # Random bytes do not compress: this bundle alone is past the budget.
    big = _write_app(tmp_path / "big", "big", {"weights.bin": os.urandom(BUDGET_BYTES + 1)})
    big_folder = _bundles_dir(platform) / build_bundle(big.parent).digest.replace(":", "-")
    platform.deploy(big, "big")
    assert _which(platform, "big") == "big"
    wait_for(lambda: not small_folder.exists(), 30)
    assert big_folder.is_dir()  # over the budget too, but its replica runs from it
    said = [line for line in platform.output if "extracted bundle(s) no replica uses" in line]
    assert any(small_digest in line for line in said), said
    platform.ember("stop", "big")
