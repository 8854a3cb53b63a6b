"""`GET /dashboard`: one page that plots each endpoint's last hour and lists endpoints,
replicas, snapshots, workers and logs.

The page holds no data: its script asks the API, through the session cookie its sign-in
set (`signin.py`). uPlot, the charting library `infra/uplot.sh` installs, is put inline
into the page as it is served: the page needs nothing from elsewhere, and its
Content-Security-Policy allows exactly its own inline scripts and styles (by hash), and
requests to this server only. Without uPlot the page says how to install it.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources
from importlib.resources.abc import Traversable

from starlette.requests import Request
from starlette.responses import Response

DASHBOARD_PATH = "/dashboard"
UPLOT_FOLDER = "static/vendor/uplot"
UPLOT_FILES = ("uPlot.iife.min.js", "uPlot.min.css")
UPLOT_MARK = "<!-- uPlot -->"  # where the library goes in the page

_cache: dict[tuple[object, ...], tuple[bytes, str]] = {}


def _hash_source(block: str) -> str:
    digest = hashlib.sha256(block.encode()).digest()
    return "'sha256-" + base64.b64encode(digest).decode() + "'"


def _static() -> Traversable:
    return resources.files("ember_platform.http").joinpath("static")


def uplot_files() -> tuple[str, str] | None:
    """uPlot's script and style sheet, if installed."""
    folder = resources.files("ember_platform.http").joinpath(UPLOT_FOLDER)
    try:
        script, style = (folder.joinpath(name).read_text() for name in UPLOT_FILES)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return script, style


def page() -> tuple[bytes, str]:
    """The page, uPlot inside it when installed, and its Content-Security-Policy."""
    html = _static().joinpath("dashboard.html").read_text()
    library = uplot_files()
    key = (html, library)
    cached = _cache.get(key)
    if cached is None:
        _cache.clear()  # one version at a time: uPlot installed while serving replaces it
        cached = _cache[key] = assemble(html, library)
    return cached


def assemble(html: str, library: tuple[str, str] | None) -> tuple[bytes, str]:
    """The page with uPlot's (script, style sheet) inline, if given, and its policy."""
    if library is not None:
        script, style = library
        html = html.replace(UPLOT_MARK, f"<style>{style}</style>\n<script>{script}</script>", 1)
    scripts = re.findall(r"<script>(.*?)</script>", html, re.DOTALL)
    styles = re.findall(r"<style>(.*?)</style>", html, re.DOTALL)
    policy = "; ".join(
        [
            "default-src 'none'",
            "script-src " + " ".join(_hash_source(s) for s in scripts),
            "style-src " + " ".join(_hash_source(s) for s in styles),
            "img-src data:",  # the plots' legend markers
            "connect-src 'self'",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )
    return html.encode(), policy


def page_headers(policy: str) -> dict[str, str]:
    return {
        "Content-Security-Policy": policy,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-store",
    }


async def dashboard(request: Request) -> Response:
    body, policy = page()
    return Response(body, media_type="text/html; charset=utf-8", headers=page_headers(policy))
