"""Images between this node and the control plane's blob store: an image packed (a zstd
tar, CRIU's logs left out) and uploaded for every other node (`publish`); downloaded,
straight from the bucket when the control plane gives its URL, and unpacked into the node
cache (`fetch`), on demand or ahead of a replica that will need it (`fetch_ahead`)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tarfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx

from ember.calling.tlsclient import client_context
from ember.wire.blob_downloads import DIRECT_HEADER
from ember_worker.snapshots.criu_images import image_meta
from ember_worker.snapshots.errors import SnapshotError
from ember_worker.snapshots.node_cache import ImageCache

log = logging.getLogger("ember.worker")


class ImageTransfer:
    """Publishes this node's images and fetches others' into its cache."""

    def __init__(self, cache: ImageCache, server_url: str, token: str, ca_cert: str | None) -> None:
        self.cache = cache
        self.server_url = server_url.rstrip("/")
        self.token = token
        self.ca_cert = ca_cert
        self._fetching: dict[str, asyncio.Lock] = {}
        self._fetching_ahead = asyncio.Lock()

    async def publish(self, key: str, image_id: str) -> dict[str, Any]:
        """Compress this node's image `image_id` of `key` and upload it to the control
        plane's blob store, for every other node; returns its metadata with the
        compressed size."""
        folder = self.cache.folder(key, image_id)
        images = folder / "images"
        meta = json.loads((images / "meta.json").read_text())
        started = time.monotonic()
        work = self.cache.work_dir(f".publish-{key[:12]}-")
        self.cache.hold(folder.name)  # not collected while read
        try:
            archive = work / "image.tar.zst"
            await asyncio.to_thread(pack_image, images, archive)
            meta["size"] = archive.stat().st_size
            await self._upload(key, archive)
        except OSError as exc:
            raise SnapshotError(f"snapshot {key} could not be packed: {exc}") from None
        finally:
            self.cache.release(folder.name)
            shutil.rmtree(work, ignore_errors=True)
        meta["publish_seconds"] = time.monotonic() - started
        return meta

    async def _upload(self, key: str, archive: Path) -> None:
        def chunks() -> Iterator[bytes]:
            with archive.open("rb") as handle:
                while chunk := handle.read(4 * 1024 * 1024):
                    yield chunk

        try:
            async with httpx.AsyncClient(
                verify=client_context(self.ca_cert), timeout=600
            ) as client:
                response = await client.put(
                    f"{self.server_url}/v1/snapshots/{key}",
                    content=_aiter(chunks()),
                    headers={"Authorization": f"Bearer {self.token}"},
                )
        except httpx.HTTPError as exc:
            raise SnapshotError(f"upload of snapshot {key} failed: {exc}") from None
        if response.status_code != 201:
            raise SnapshotError(f"upload of snapshot {key} failed: HTTP {response.status_code}")

    async def fetch(self, key: str, image_id: str | None) -> Path:
        """The folder of image `image_id` of `key` on this node: from the node cache, or
        downloaded once (the blob store holds the key's current image)."""
        folder = self.cache.folder(key, image_id)
        images = folder / "images"
        if (images / "meta.json").exists():
            os.utime(folder)  # recently used: the last to be collected
            return images
        lock = self._fetching.setdefault(folder.name, asyncio.Lock())
        async with lock:
            if (images / "meta.json").exists():
                return images
            work = self.cache.work_dir(f".fetch-{key[:12]}-")
            try:
                archive = work / "image.tar.zst"
                await self._download(key, archive)
                (work / "images").mkdir()
                await asyncio.to_thread(unpack_image, archive, work / "images")
                archive.unlink()
                fetched = image_meta(work / "images")
                if image_id and fetched.get("image_id") != image_id:
                    # Dropped and taken again since the replica was planned: restoring the
                    # newer image would be right, but under the old one's folder it would
                    # be wrong for the next replica.
                    raise SnapshotError(
                        f"snapshot {key} is image {fetched.get('image_id')} now, not {image_id}"
                    )
                shutil.rmtree(folder, ignore_errors=True)
                os.replace(work, folder)
            except (OSError, tarfile.TarError, ValueError) as exc:
                raise SnapshotError(f"snapshot {key} is unreadable: {exc}") from None
            finally:
                shutil.rmtree(work, ignore_errors=True)
        self.cache.collect_garbage()
        return images

    async def _download(self, key: str, archive: Path) -> None:
        """The key's packed image into `archive`: from the blob store itself when the
        control plane gives its URL (a bucket), else, or should that fail, through the
        control plane."""
        url = f"{self.server_url}/v1/snapshots/{key}"
        auth = {"Authorization": f"Bearer {self.token}"}
        headers = {**auth, DIRECT_HEADER: "1"}
        direct = await _get(url, headers, self.ca_cert, key, archive, redirect_ok=True)
        if direct is None:
            return
        began = time.monotonic()
        try:
            # The bucket's own TLS: the system's trust, not the platform's CA.
            await _get(direct, {}, None, key, archive)
        except (httpx.HTTPError, SnapshotError) as exc:
            log.warning(
                "snapshot %s: the blob store's URL failed (%s); through the control plane",
                key[:12],
                exc,
            )
        else:
            log.info(
                "snapshot %s downloaded from the blob store directly (%.0f MB in %.2f s)",
                key[:12],
                archive.stat().st_size / 1e6,
                time.monotonic() - began,
            )
            return
        await _get(url, auth, self.ca_cert, key, archive)

    async def fetch_ahead(self, key: str, image_id: str | None, size: int) -> float | None:
        """Fetch an image before a replica here needs it, if it fits in the cache beside
        what it holds (evicting nothing), one at a time so each sees the room the last
        left; the seconds it took, or None when it was not fetched (a failure costs only
        the head start: a restore fetches it then)."""
        async with self._fetching_ahead:
            if self.cache.has(key, image_id):
                return None
            if not await asyncio.to_thread(self.cache.room_for, size):
                log.info(
                    "not fetching snapshot %s ahead (%.0f MB): the node's snapshot cache has "
                    "no room for it without evicting others (--snapshot-cache-gb)",
                    key[:12],
                    size / 1e6,
                )
                return None
            began = time.monotonic()
            try:
                await self.fetch(key, image_id)
            except SnapshotError as exc:
                log.warning("fetching snapshot %s ahead failed: %s", key[:12], exc)
                return None
            return time.monotonic() - began


async def _aiter(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


def pack_image(images: Path, archive: Path) -> None:
    """The image folder's files, CRIU's logs left out, into a zstd-compressed tar."""
    import zstandard

    compressor = zstandard.ZstdCompressor(level=3, threads=-1)
    with (
        archive.open("wb") as raw,
        compressor.stream_writer(raw) as stream,
        tarfile.open(fileobj=stream, mode="w|") as tar,
    ):
        for path in sorted(images.iterdir()):
            if not path.name.endswith(".log"):
                tar.add(path, arcname=path.name)
    # Each TarInfo points back at its TarFile: left alone, that cycle keeps the compressor
    # and its worker threads until some garbage collection, in whatever thread runs it.
    tar.members.clear()  # type: ignore[attr-defined]  # (not in typeshed)


def unpack_image(archive: Path, images: Path) -> None:
    """A packed image's files into the folder `images`."""
    import zstandard

    with (
        archive.open("rb") as raw,
        zstandard.ZstdDecompressor().stream_reader(raw) as stream,
        tarfile.open(fileobj=stream, mode="r|") as tar,
    ):
        tar.extractall(images, filter="data")


async def _get(
    url: str,
    headers: dict[str, str],
    ca_cert: str | None,
    key: str,
    archive: Path,
    redirect_ok: bool = False,
) -> str | None:
    """The packed image at `url` into `archive`; or, with `redirect_ok`, the URL a 307
    sends it to, and nothing written."""
    async with (
        httpx.AsyncClient(verify=client_context(ca_cert), timeout=600) as client,
        client.stream("GET", url, headers=headers) as response,
    ):
        if redirect_ok and response.status_code == 307 and "location" in response.headers:
            return str(response.headers["location"])
        if response.status_code != 200:
            raise SnapshotError(f"snapshot {key} is not available: HTTP {response.status_code}")
        with archive.open("wb") as handle:
            async for chunk in response.aiter_bytes(4 * 1024 * 1024):
                handle.write(chunk)
    return None
