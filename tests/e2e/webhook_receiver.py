"""A webhook receiver for the e2e tests: a real HTTPS server on loopback, with a
certificate from a CA of its own (which the platform is told to trust), recording each
delivery and answering with the statuses it is told to, or in the manners it is told to
misbehave in: a body far too large to read, an answer dripped a byte at a time."""

from __future__ import annotations

import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ember_platform.security.tls import ensure_tls


@dataclass
class Delivery:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float = field(default_factory=time.monotonic)


HUGE = 400 * 1024 * 1024  # what a "huge" answer says its body holds
CHUNK = 64 * 1024
DRIP_PAUSE = 0.5  # seconds between two bytes of a dripped answer
DRIP_FOR = 60.0  # seconds a drip goes on at most, should the platform listen for ever


@dataclass
class Receiver:
    ca_cert: Path
    url: str
    deliveries: list[Delivery] = field(default_factory=list)
    # Statuses to answer with, in order; 200 once they are used up.
    answers: list[int] = field(default_factory=list)
    # How to answer, in order, before the plain way: "huge" (200 and a 400 MiB body),
    # "drip_head" (the status line and headers a byte at a time), "drip_body" (200 at
    # once, then the body a byte at a time). Each goes on until the platform hangs up.
    manners: list[str] = field(default_factory=list)
    bytes_sent: int = 0  # by misbehaving answers
    hung_up: list[float] = field(default_factory=list)  # when the platform left one
    server: ThreadingHTTPServer | None = None

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def start_receiver(root: Path, port: int = 0) -> Receiver:
    tls = ensure_tls(root, hosts=["127.0.0.1"])
    lock = threading.Lock()
    receiver: Receiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            with lock:
                receiver.deliveries.append(Delivery(self.path, dict(self.headers), body))
                manner = receiver.manners.pop(0) if receiver.manners else None
                status = receiver.answers.pop(0) if receiver.answers and not manner else 200
            if manner is not None:
                self.close_connection = True
                try:
                    self.misbehave(manner)
                except OSError:  # the platform hung up, as it should
                    receiver.hung_up.append(time.monotonic())
                return
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def send(self, data: bytes) -> None:
            self.wfile.write(data)
            with lock:
                receiver.bytes_sent += len(data)

        def misbehave(self, manner: str) -> None:
            if manner == "huge":
                self.send(f"HTTP/1.1 200 OK\r\nContent-Length: {HUGE}\r\n\r\n".encode())
                for _ in range(HUGE // CHUNK):
                    self.send(b"x" * CHUNK)
                return
            head = b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n"
            if manner == "drip_body":
                self.send(head)
                dripped = b"x" * 100000
            else:
                dripped = head.replace(b"OK\r\n", b"OK\r\n" + b"X-Slow: yes\r\n" * 1000)
            until = time.monotonic() + DRIP_FOR
            for byte in dripped:
                if time.monotonic() > until:
                    return
                self.send(bytes([byte]))
                time.sleep(DRIP_PAUSE)

        def log_message(self, *args: object) -> None:
            return  # quiet

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(tls.server_cert), str(tls.server_key))
    server.socket = context.wrap_socket(server.socket, server_side=True)
    receiver = Receiver(tls.ca_cert, f"https://127.0.0.1:{server.server_address[1]}")
    receiver.server = server
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return receiver
