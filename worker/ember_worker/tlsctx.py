"""TLS client contexts that trust the platform's CA."""

from __future__ import annotations

import ssl


def client_context(ca_cert: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context()
    if ca_cert:
        context.load_verify_locations(ca_cert)
    return context


def websocket_url(server_url: str, path: str) -> str:
    base = server_url.rstrip("/")
    if base.startswith("https://"):
        base = "wss://" + base.removeprefix("https://")
    elif base.startswith("http://"):
        base = "ws://" + base.removeprefix("http://")
    return base + path
