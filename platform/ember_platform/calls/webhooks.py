"""Delivering spawned calls' webhooks: when a call made with `X-Ember-Webhook: URL` ends,
POST what became of it to URL, signed with its workspace's webhook secret
(`ember.calling.webhooks`), and try again on a growing schedule until the receiver answers 2xx.

A delivery's state is kept in the call's record (pending, delivered, failed), so one
still pending when the control plane stops is sent after it starts again. The body is
the same on every attempt; the result is in it when it is JSON of at most 256 KiB, and
otherwise fetched from the call's status URL."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import ipaddress
import json
import logging
import math
import os
import socket
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from ember.calling.webhooks import SECRET_PREFIX, WEBHOOK_HEADER, secret_key, signature
from ember.calling.webhooks import check_webhook_url as check_url_form
from ember.errors import ConfigError, InvalidError
from ember.wire.labels import MAIN_WORKSPACE, split_app_key, split_label
from ember_platform.errors import InvalidRequest
from ember_platform.observability.logs import LogSink
from ember_platform.observability.metrics import PlatformMetrics
from ember_platform.runtime.inputs import JSON_MEDIA_TYPE
from ember_platform.security.state_files import kept_secret
from ember_platform.storage.records import WEBHOOK_DELIVERED, WEBHOOK_FAILED, CallRecord, CallStatus

log = logging.getLogger("ember.calling.webhooks")

SECRET_FILE = "webhook-secret"
MAX_INLINE_RESULT = 256 * 1024
# All of one attempt: resolving, connecting, sending and the answer's status line and
# headers. httpx's own timeouts count each read anew, so a receiver sending a byte now
# and then would hold a delivery (and a pooled connection) for ever. The server's
# environment may set another (1 to 300 s): receivers known to be quick, tests.
ATTEMPT_TIMEOUT_SECONDS = 15.0
ATTEMPT_TIMEOUT_ENV = "EMBER_WEBHOOK_ATTEMPT_SECONDS"
GONE = 410  # the receiver says it wants no more: no retry

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# Metadata services outside the link-local ranges (AWS's IPv6 one).
METADATA_ADDRESSES = frozenset({ipaddress.ip_address("fd00:ec2::254")})
NAT64_PREFIX = ipaddress.ip_network("64:ff9b::/96")


def attempt_seconds(environ: Mapping[str, str]) -> float:
    """The limit of one attempt `environ` asks for (1 to 300 s), else the default."""
    try:
        asked = float(environ.get(ATTEMPT_TIMEOUT_ENV, ""))
    except ValueError:
        return ATTEMPT_TIMEOUT_SECONDS
    return min(max(asked, 1.0), 300.0) if math.isfinite(asked) else ATTEMPT_TIMEOUT_SECONDS


class ReceiverRefused(Exception):
    """The receiver's address is one no webhook is sent to; trying again will not help."""


@dataclass(frozen=True)
class Attempt:
    """What became of one attempt: `problem` is None when the receiver took it."""

    problem: str | None
    status: int | None = None
    final: bool = False  # no point trying again


def check_webhook_url(url: str, allow_http: bool) -> str:
    """The URL a caller gave, or InvalidRequest saying what is wrong with it."""

    def bad(why: str) -> InvalidRequest:
        return InvalidRequest(f"{WEBHOOK_HEADER}: {why}")

    try:
        check_url_form(url)
    except InvalidError as exc:
        raise InvalidRequest(str(exc)) from None
    parts = urlsplit(url)
    if parts.scheme != "https" and not allow_http:
        raise bad(f"{url!r} is not an https URL (this server takes no http webhooks)")
    literal = literal_address(parts.hostname or "")
    refusal = literal and refused_address(literal)
    if refusal:
        raise bad(refusal)
    return url


def literal_address(host: str) -> IPAddress | None:
    """The address a host names by itself, in any spelling the resolver takes
    ("169.254.169.254", "[fe80::1]", "2852039166"); None for a name."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:  # the old spellings (a decimal number, hex parts) that connect all the same
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def refused_address(address: IPAddress) -> str | None:
    """Why no webhook goes to `address`, or None. Link-local addresses reach the
    platform's own network segment, where clouds serve instance metadata (credentials
    among it); loopback and private networks stay open to receivers of one's own."""
    embedded = _embedded_ipv4(address)
    if embedded is not None:
        address = embedded
    if address in METADATA_ADDRESSES:
        return f"{address} is a cloud metadata address, not a webhook receiver"
    if address.is_link_local:
        return f"{address} is a link-local address (cloud metadata lives there), not a receiver"
    return None


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (::ffff:a.b.c.d, NAT64's 64:ff9b::a.b.c.d)."""
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in NAT64_PREFIX:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


async def receiver_addresses(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to now, checked: DNS can point a name anywhere,
    whatever the URL looked like when the call was made. ReceiverRefused if any of them
    is refused; httpx.ConnectError if the name does not resolve."""
    try:
        found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise httpx.ConnectError(f"cannot resolve {host!r}: {exc}") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in found))
    for text in addresses:
        refusal = refused_address(ipaddress.ip_address(text))
        if refusal:
            where = "" if host == text else f"{host} resolves to {text}; "
            raise ReceiverRefused(f"refused: {where}{refusal}")
    return addresses


def load_secret(state_dir: Path) -> str:
    """The platform's webhook secret, made once and kept in the state dir (mode 0600)."""
    return kept_secret(
        state_dir / SECRET_FILE,
        lambda: SECRET_PREFIX + base64.b64encode(os.urandom(32)).decode(),
    )


def workspace_secret(secret: str, workspace: str) -> str:
    """A workspace's own webhook secret: the platform's for main, and for another one
    derived from it (HMAC of the workspace's name), so that no tenant's secret signs
    another's deliveries and none needs storing."""
    if workspace == MAIN_WORKSPACE:
        return secret
    derived = hmac.new(secret_key(secret), b"workspace:" + workspace.encode(), "sha256")
    return SECRET_PREFIX + base64.b64encode(derived.digest()).decode()


def payload(record: CallRecord, status_url: str) -> bytes:
    """What the receiver is told of an ended call."""
    key, endpoint = split_label(record.label) or ("", record.label)
    workspace, app = split_app_key(key)
    body: dict[str, Any] = {
        "type": "call.ended",
        "call_id": record.id,
        "workspace": workspace,
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
        attempt_timeout: float | None = None,  # None: attempt_seconds(os.environ)
    ) -> None:
        if attempt_timeout is None:
            attempt_timeout = attempt_seconds(os.environ)
        self.secret = secret
        self.key = secret_key(secret)
        self.base_url = base_url.rstrip("/")
        self.logs = logs
        self.metrics = metrics
        self.ended = ended
        self.retry_delays = retry_delays
        self.attempt_timeout = attempt_timeout
        self.client = httpx.AsyncClient(
            verify=receivers_context(ca_cert),
            timeout=attempt_timeout,
            follow_redirects=False,  # a redirect could point a signed body anywhere
            headers={"User-Agent": "ember-webhooks"},
            # Each connection goes to an address checked for its delivery and is
            # verified for that delivery's host name: none is reused for another. A
            # proxy from the environment would reach addresses unchecked.
            limits=httpx.Limits(max_keepalive_connections=0),
            trust_env=False,
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
            outcome = await self._post(url, record.id, body, self._key_of(record))
            if outcome.problem is None:
                self.metrics.webhook_delivery(app, endpoint, "delivered")
                self._say(
                    record,
                    f"webhook of call {record.id} delivered ({outcome.status}) in "
                    f"{time.monotonic() - began:.2f} s",
                )
                self.ended(record, WEBHOOK_DELIVERED)
                return
            last = attempt == attempts or outcome.final
            self.metrics.webhook_delivery(app, endpoint, "failed" if last else "retried")
            if last:
                self._say(
                    record,
                    f"webhook of call {record.id} not delivered after {attempt} attempt(s), "
                    f"giving up: {outcome.problem}",
                )
                self.ended(record, WEBHOOK_FAILED)
                return
            self._say(
                record,
                f"webhook of call {record.id} failed (attempt {attempt} of {attempts}): "
                f"{outcome.problem}; again in {self.retry_delays[attempt - 1]:g} s",
            )

    def secret_for(self, workspace: str) -> str:
        """The secret a workspace's receivers check its deliveries with."""
        return workspace_secret(self.secret, workspace)

    def _key_of(self, record: CallRecord) -> bytes:
        key, _ = split_label(record.label) or (record.label, "")
        return secret_key(self.secret_for(split_app_key(key)[0]))

    async def _post(self, url: str, message_id: str, body: bytes, key: bytes) -> Attempt:
        """One attempt, over within `attempt_timeout` whatever the receiver does."""
        timestamp = int(time.time())
        headers = {
            "Content-Type": "application/json",
            "webhook-id": message_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": signature(key, message_id, timestamp, body),
        }
        try:
            async with asyncio.timeout(self.attempt_timeout):
                status = await self._status_of(httpx.URL(url), headers, body)
        except ReceiverRefused as exc:
            return Attempt(str(exc), final=True)
        except TimeoutError:
            return Attempt(f"no answer within {self.attempt_timeout:g} s")
        except httpx.HTTPError as exc:
            return Attempt(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        if 200 <= status < 300:
            return Attempt(None, status)
        return Attempt(f"the receiver answered {status}", status, final=status == GONE)

    async def _status_of(self, url: httpx.URL, headers: dict[str, str], body: bytes) -> int:
        """The status the receiver answers with, sent to the addresses its host resolves
        to now (once checked) in turn until one connects."""
        host = url.raw_host.decode("ascii")
        port = url.port or (443 if url.scheme == "https" else 80)
        addresses = await receiver_addresses(host, port)
        for address in addresses[:-1]:
            with contextlib.suppress(httpx.ConnectError):  # the next one may listen
                return await self._status_from(url, address, headers, body)
        return await self._status_from(url, addresses[-1], headers, body)

    async def _status_from(
        self, url: httpx.URL, address: str, headers: dict[str, str], body: bytes
    ) -> int:
        """The answer's status from one address. Its body is never read: nothing needs
        it, and a receiver could send gigabytes; closing the response drops the
        connection instead."""
        async with self.client.stream(
            "POST",
            url.copy_with(host=address),
            content=body,
            headers={**headers, "Host": url.netloc.decode("ascii")},
            # The certificate is checked for the URL's host, not for the address.
            extensions={"sni_hostname": url.raw_host.decode("ascii")},
        ) as response:
            return response.status_code

    def _say(self, record: CallRecord, text: str) -> None:
        app, endpoint = split_label(record.label) or ("", record.label)
        self.logs.system(app, endpoint, text)
