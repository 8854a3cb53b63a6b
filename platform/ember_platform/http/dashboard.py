"""`GET /dashboard`: one static page that shows endpoints, workers and logs.

The page holds no data: its script asks the API with an admin token the user types in
(kept in the tab's sessionStorage), every 2 s. Its Content-Security-Policy allows
exactly its own inline script and style (by hash), and requests to this server only.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response

DASHBOARD_PATH = "/dashboard"


def _hash_source(block: str) -> str:
    digest = hashlib.sha256(block.encode()).digest()
    return "'sha256-" + base64.b64encode(digest).decode() + "'"


@functools.cache
def page() -> tuple[bytes, str]:
    """The page and its Content-Security-Policy."""
    html = resources.files("ember_platform.http").joinpath("static/dashboard.html").read_text()
    scripts = re.findall(r"<script>(.*?)</script>", html, re.DOTALL)
    styles = re.findall(r"<style>(.*?)</style>", html, re.DOTALL)
    policy = "; ".join(
        [
            "default-src 'none'",
            "script-src " + " ".join(_hash_source(s) for s in scripts),
            "style-src " + " ".join(_hash_source(s) for s in styles),
            "connect-src 'self'",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )
    return html.encode(), policy


async def dashboard(request: Request) -> Response:
    body, policy = page()
    return Response(
        body,
        media_type="text/html; charset=utf-8",
        headers={
            "Content-Security-Policy": policy,
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-cache",
        },
    )
