"""A webhook receiver for the e2e tests: a real HTTPS server on loopback, with a
certificate from a CA of its own (which the platform is told to trust), recording each
delivery and answering with the statuses it is told to."""

from __future__ import annotations

import ssl
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ember_platform.tls import ensure_tls


@dataclass
class Delivery:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    ca_cert: Path
    url: str
    deliveries: list[Delivery] = field(default_factory=list)
    # Statuses to answer with, in order; 200 once they are used up.
    answers: list[int] = field(default_factory=list)
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
                status = receiver.answers.pop(0) if receiver.answers else 200
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

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
