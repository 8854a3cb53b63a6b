"""Real servers for the weights tests: a range-capable HTTP file server with failure hooks,
and moto's S3 server, both on 127.0.0.1 in threads of the test process."""

from __future__ import annotations

import email.utils
import json
import threading
import time
import urllib.request
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit


@dataclass(frozen=True)
class Recorded:
    method: str
    name: str
    range: str | None


@dataclass(frozen=True)
class _Plan:
    """How to answer one request: a forced status, or the file cut after some bytes."""

    status: int | None = None
    cut_after: int | None = None


class RangeServer(ThreadingHTTPServer):
    """Serves the files of a folder with GET and HEAD, `Range: bytes=a-b` -> 206, an ETag
    from size and mtime, and Last-Modified. Records every request; can be told to fail."""

    daemon_threads = True

    def __init__(self, root: Path) -> None:
        super().__init__(("127.0.0.1", 0), _RangeHandler)
        self.root = root
        self.delay_seconds = 0.0  # before each GET, to make concurrent readers overlap
        self._lock = threading.Lock()
        self._recorded: list[Recorded] = []
        self._failures: deque[int] = deque()
        self._cuts: deque[int] = deque()
        self._forced: dict[str, int] = {}
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def url(self, name: str) -> str:
        return f"{self.base_url}/{name}"

    def start(self) -> None:
        # A short poll interval: shutdown() waits for the next poll.
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join()

    # -- hooks ---------------------------------------------------------------------------------

    def fail_next(self, count: int, status: int = 503) -> None:
        """Answer the next `count` GETs with `status`."""
        with self._lock:
            self._failures.extend([status] * count)

    def cut_next(self, count: int, after_bytes: int) -> None:
        """Cut the next `count` GET bodies short after `after_bytes` bytes (the connection
        closes with fewer bytes than its Content-Length said)."""
        with self._lock:
            self._cuts.extend([after_bytes] * count)

    def force(self, name: str, status: int) -> None:
        """Answer every request for `name` with `status`."""
        with self._lock:
            self._forced[name] = status

    # -- records -------------------------------------------------------------------------------

    def recorded(self, name: str | None = None, method: str = "GET") -> list[Recorded]:
        with self._lock:
            return [
                record
                for record in self._recorded
                if record.method == method and (name is None or record.name == name)
            ]

    def gets(self, name: str) -> int:
        return len(self.recorded(name))

    def plan(self, method: str, name: str, range_header: str | None) -> _Plan:
        with self._lock:
            self._recorded.append(Recorded(method, name, range_header))
            if name in self._forced:
                return _Plan(status=self._forced[name])
            if method != "GET":
                return _Plan()
            if self._failures:
                return _Plan(status=self._failures.popleft())
            if self._cuts:
                return _Plan(cut_after=self._cuts.popleft())
            return _Plan()


def _parse_range(header: str | None, size: int) -> tuple[int, int] | str | None:
    """(first, last) inclusive; None to serve it all; "unsatisfiable" for a 416."""
    if header is None or not header.startswith("bytes=") or "," in header:
        return None
    first_text, _, last_text = header[len("bytes=") :].partition("-")
    try:
        if first_text == "":
            suffix = int(last_text)
            return (max(size - suffix, 0), size - 1) if size else "unsatisfiable"
        first = int(first_text)
        last = int(last_text) if last_text else size - 1
    except ValueError:
        return None
    if first >= size or last < first:
        return "unsatisfiable"
    return first, min(last, size - 1)


class _RangeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: RangeServer

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests read the recorded requests instead."""

    def do_HEAD(self) -> None:
        self._serve(send_body=False)

    def do_GET(self) -> None:
        self._serve(send_body=True)

    def _serve(self, *, send_body: bool) -> None:
        name = unquote(urlsplit(self.path).path).lstrip("/")
        plan = self.server.plan(self.command, name, self.headers.get("Range"))
        if send_body and self.server.delay_seconds:
            time.sleep(self.server.delay_seconds)
        if plan.status is not None:
            self._empty(plan.status)
            return
        root = self.server.root.resolve()
        path = (root / name).resolve()
        if not path.is_relative_to(root) or not path.is_file():
            self._empty(404)
            return
        status = path.stat()
        size = status.st_size
        span = _parse_range(self.headers.get("Range"), size)
        if span == "unsatisfiable":
            self._empty(416, {"Content-Range": f"bytes */{size}"})
            return
        headers = {
            "ETag": f'"{size:x}-{status.st_mtime_ns:x}"',
            "Last-Modified": email.utils.formatdate(status.st_mtime, usegmt=True),
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if isinstance(span, tuple):
            first, last = span
            headers["Content-Range"] = f"bytes {first}-{last}/{size}"
            code = 206
        else:
            first, last = 0, size - 1
            code = 200
        with open(path, "rb") as file:
            file.seek(first)
            body = file.read(last - first + 1)
        self.send_response(code)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not send_body:
            return
        if plan.cut_after is not None:
            self.wfile.write(body[: plan.cut_after])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)

    def _empty(self, status: int, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", "0")
        self.end_headers()


class S3Server:
    """moto's S3 server (real HTTP, real boto3 on the other side) on a free local port."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.endpoint_url = ""

    def start(self) -> None:
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"

    def stop(self) -> None:
        self._server.stop()

    def require_credentials(self, required: bool) -> None:
        """moto checks credentials only when told to (IAM: unknown keys are refused)."""
        count = "0" if required else "inf"
        request = urllib.request.Request(
            f"{self.endpoint_url}/moto-api/reset-auth",
            data=count.encode(),
            # Not a form: moto reads the raw body, which Flask empties for form posts.
            headers={"Content-Type": "text/plain"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            json.loads(response.read())
