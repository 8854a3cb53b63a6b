"""The worker's log: its own INFO lines, no per-request lines of the HTTP libraries
(those carry URLs, presigned blob-store ones among them)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import logging
from ember_worker.cli import configure_logging
configure_logging()
logging.getLogger("ember.worker").info("registered as w-1")
logging.getLogger("httpx").info('HTTP Request: GET https://blobs/x?X-Amz-Signature=abc')
logging.getLogger("botocore.credentials").info("Found credentials in environment")
logging.getLogger("httpcore.connection").warning("connection dropped")
"""


def test_worker_log_keeps_its_own_lines_and_drops_library_request_lines() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True
    )
    lines = done.stderr.splitlines()
    assert "ember worker: registered as w-1" in lines
    assert "ember worker: connection dropped" in lines  # warnings still show
    assert not any("X-Amz-Signature" in line or "credentials" in line for line in lines)
