"""An OpenTelemetry collector for the e2e tests: a real OTLP/HTTP server on loopback that
takes JSON trace exports and keeps their spans."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Collector:
    url: str
    spans: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def start_collector(port: int = 0) -> Collector:
    lock = threading.Lock()
    collector: Collector

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/json":
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            export = json.loads(body)
            with lock:
                collector.headers.append(dict(self.headers))
                for resource in export["resourceSpans"]:
                    for scope in resource["scopeSpans"]:
                        collector.spans.extend(scope["spans"])
            answer = b"{}"
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            return  # quiet

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    collector = Collector(f"http://127.0.0.1:{server.server_address[1]}")
    collector.server = server
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return collector
