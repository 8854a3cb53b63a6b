"""A headless Chromium (Debian's `chromium`) driven over the DevTools protocol: open a
page, run script in it, read its cookies, take a screenshot. Just what the dashboard's
tests need, over one WebSocket (the `websockets` package the platform has already)."""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

STARTUP_SECONDS = 30


class BrowserError(RuntimeError):
    """The page threw, or Chromium answered a command with an error."""


class HeadlessChromium:
    def __init__(self, executable: str, width: int = 1400, height: int = 1000) -> None:
        self.profile = Path(tempfile.mkdtemp(prefix="ember-chromium-"))
        # Root (as in CI) needs --no-sandbox; the server's certificate is the test's own CA.
        self.process = subprocess.Popen(
            [
                executable,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--hide-scrollbars",
                "--ignore-certificate-errors",
                f"--window-size={width},{height}",
                "--remote-debugging-port=0",
                f"--user-data-dir={self.profile}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._ids = itertools.count(1)
        self.socket: ClientConnection = connect(self._page_socket(), max_size=None)

    def _page_socket(self) -> str:
        """The first page's DevTools WebSocket, once Chromium listens."""
        marker = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BrowserError(f"chromium exited with {self.process.returncode}")
            lines = marker.read_text().splitlines() if marker.exists() else []
            if len(lines) >= 2:
                with urllib.request.urlopen(f"http://127.0.0.1:{lines[0]}/json/list") as answer:
                    targets = json.load(answer)
                pages = [t for t in targets if t.get("type") == "page"]
                if pages:
                    return str(pages[0]["webSocketDebuggerUrl"])
            time.sleep(0.1)
        raise BrowserError("chromium did not open its DevTools port")

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command's result (events meanwhile are dropped)."""
        ident = next(self._ids)
        self.socket.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=60))
            if message.get("id") != ident:
                continue
            if "error" in message:
                raise BrowserError(f"{method}: {message['error']}")
            result: dict[str, Any] = message["result"]
            return result

    def evaluate(self, expression: str) -> Any:
        """The value of a script in the page (awaited if it is a promise)."""
        result = self.send(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str) -> None:
        """Go to `url` and wait until its document (and its redirects) have loaded."""
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    def wait_for(self, condition: str, timeout: float = 30.0) -> Any:
        """The first truthy value of `condition`, tried until `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(condition)
            except BrowserError:
                value = None  # a page between two documents
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"still false after {timeout} s: {condition}")
            time.sleep(0.1)

    def cookies(self, url: str) -> list[dict[str, Any]]:
        """The cookies the browser would send to `url`."""
        cookies: list[dict[str, Any]] = self.send("Network.getCookies", urls=[url])["cookies"]
        return cookies

    def screenshot(self, path: Path) -> bytes:
        png = base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"])
        path.write_bytes(png)
        return png

    def close(self) -> None:
        try:
            self.socket.close()
        finally:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            shutil.rmtree(self.profile, ignore_errors=True)
