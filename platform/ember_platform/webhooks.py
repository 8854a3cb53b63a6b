"""Delivering spawned calls' webhooks: when a call made with `X-Ember-Webhook: URL` ends,
POST what became of it to URL, signed with the platform's webhook secret
(`ember.webhooks`), and try again on a growing schedule until the receiver answers 2xx.

A delivery's state is kept in the call's record (pending, delivered, failed), so one
still pending when the control plane stops is sent after it starts again. The body is
the same on every attempt; the result is in it when it is JSON of at most 256 KiB, and
otherwise fetched from the call's status URL."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from ember.errors import ConfigError
from ember.labels import split_label
from ember.webhooks import SECRET_PREFIX, secret_key, signature
from ember_platform.errors import HttpError
from ember_platform.inputs import JSON_MEDIA_TYPE
from ember_platform.logs import LogSink
from ember_platform.metrics import PlatformMetrics
from ember_platform.records import WEBHOOK_DELIVERED, WEBHOOK_FAILED, CallRecord, CallStatus
from ember_platform.state_files import kept_secret

log = logging.getLogger("ember.webhooks")

SECRET_FILE = "webhook-secret"
MAX_URL_CHARS = 2000
MAX_INLINE_RESULT = 256 * 1024
ATTEMPT_TIMEOUT_SECONDS = 15.0
GONE = 410  # the receiver says it wants no more: no retry


def check_webhook_url(url: str, allow_http: bool) -> str:
    """The URL a caller gave, or a 400 that says what is wrong with it."""

    def bad(why: str) -> HttpError:
        return HttpError(400, "invalid_request", f"X-Ember-Webhook: {why}")

    if len(url) > MAX_URL_CHARS or not url.isascii() or not url.isprintable() or " " in url:
        raise bad(f"a URL of at most {MAX_URL_CHARS} printable ASCII characters")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  # raises for a port out of range or not a number
    except ValueError as exc:  # "https://[::1/": an unclosed IPv6 address, and the like
        raise bad(f"{url!r} is not a URL ({exc})") from None
    schemes = ("https", "http") if allow_http else ("https",)
    if parts.scheme not in schemes or not parts.hostname:
        allowed = "an http(s)" if allow_http else "an https"
        raise bad(f"{url!r} is not {allowed} URL with a host")
    if parts.fragment:
        raise bad("a URL without a #fragment")
    return url


def load_secret(state_dir: Path) -> str:
    """The platform's webhook secret, made once and kept in the state dir (mode 0600)."""
    return kept_secret(
        state_dir / SECRET_FILE,
        lambda: SECRET_PREFIX + base64.b64encode(os.urandom(32)).decode(),
    )


def payload(record: CallRecord, status_url: str) -> bytes:
    """What the receiver is told of an ended call."""
    app, endpoint = split_label(record.label) or ("", record.label)
    body: dict[str, Any] = {
        "type": "call.ended",
        "call_id": record.id,
        "app": app,
        "endpoint": endpoint,
        "label": record.label,
        "method": record.method,
        "status": record.status.value,
        "http_status": record.http_status,
        "created_at": record.created_at,
        "finished_at": record.finished_at,
        "status_url": status_url,
    }
    result = record.result or b""
    is_json = record.media_type in (None, JSON_MEDIA_TYPE) and record.filename is None
    if record.status is CallStatus.FAILED and is_json:
        with contextlib.suppress(ValueError, AttributeError):  # left out, not fatal
            body["error"] = json.loads(result).get("error")
    elif is_json and len(result) <= MAX_INLINE_RESULT:
        with contextlib.suppress(ValueError, AttributeError):  # left out, not fatal
            body["result"] = json.loads(result) if result else None
    else:
        body["result_omitted"] = (
            f"a file ({record.media_type}, {len(result)} bytes)"
            if not is_json
            else f"{len(result)} bytes, over {MAX_INLINE_RESULT // 1024} KiB"
        )
    return json.dumps(body).encode()


def receivers_context(ca_cert: Path | None, option: str = "--webhook-ca-cert") -> ssl.SSLContext:
    """The system's CAs, and the one given (by `option`) for receivers inside a private
    network."""
    context = ssl.create_default_context()
    if ca_cert is not None:
        try:
            context.load_verify_locations(cafile=str(ca_cert))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"{option} {ca_cert}: {exc}") from None
    return context


class WebhookSender:
    """Sends each ended call's webhook in a task of its own; `ended` reports the outcome
    (delivered or failed), which the cluster writes into the call's record."""

    def __init__(
        self,
        secret: str,
        base_url: str,
        logs: LogSink,
        metrics: PlatformMetrics,
        ended: Callable[[CallRecord, str], None],
        *,
        retry_delays: tuple[float, ...],
        ca_cert: Path | None = None,
    ) -> None:
        self.secret = secret
        self.key = secret_key(secret)
        self.base_url = base_url.rstrip("/")
        self.logs = logs
        self.metrics = metrics
        self.ended = ended
        self.retry_delays = retry_delays
        self.client = httpx.AsyncClient(
            verify=receivers_context(ca_cert),
            timeout=ATTEMPT_TIMEOUT_SECONDS,
            follow_redirects=False,  # a redirect could point a signed body anywhere
            headers={"User-Agent": "ember-webhooks"},
        )
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def deliver(self, record: CallRecord) -> None:
        if record.webhook is None or record.id in self._tasks:
            return
        task = asyncio.ensure_future(self._deliver(record, record.webhook))
        self._tasks[record.id] = task
        task.add_done_callback(lambda _t: self._tasks.pop(record.id, None))

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await self.client.aclose()

    async def _deliver(self, record: CallRecord, url: str) -> None:
        body = payload(record, f"{self.base_url}/v1/calls/{record.id}")
        app, endpoint = split_label(record.label) or ("", record.label)
        attempts = 1 + len(self.retry_delays)
        for attempt, delay in enumerate((0.0, *self.retry_delays), start=1):
            if delay:
                await asyncio.sleep(delay)
            began = time.monotonic()
            problem, status = await self._post(url, record.id, body)
            if problem is None:
                self.metrics.webhook_delivery(app, endpoint, "delivered")
                self._say(
                    record,
                    f"webhook of call {record.id} delivered ({status}) in "
                    f"{time.monotonic() - began:.2f} s",
                )
                self.ended(record, WEBHOOK_DELIVERED)
                return
            last = attempt == attempts or status == GONE
            self.metrics.webhook_delivery(app, endpoint, "failed" if last else "retried")
            if last:
                self._say(
                    record,
                    f"webhook of call {record.id} not delivered after {attempt} attempt(s), "
                    f"giving up: {problem}",
                )
                self.ended(record, WEBHOOK_FAILED)
                return
            self._say(
                record,
                f"webhook of call {record.id} failed (attempt {attempt} of {attempts}): "
                f"{problem}; again in {self.retry_delays[attempt - 1]:g} s",
            )

    async def _post(self, url: str, message_id: str, body: bytes) -> tuple[str | None, int | None]:
        """None and the status when the receiver took it; else why not, and its status."""
        timestamp = int(time.time())
        headers = {
            "Content-Type": "application/json",
            "webhook-id": message_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": signature(self.key, message_id, timestamp, body),
        }
        try:
            response = await self.client.post(url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, None
        if 200 <= response.status_code < 300:
            return None, response.status_code
        return f"the receiver answered {response.status_code}", response.status_code

    def _say(self, record: CallRecord, text: str) -> None:
        app, endpoint = split_label(record.label) or ("", record.label)
        self.logs.system(app, endpoint, text)
