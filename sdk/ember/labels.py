"""Endpoint labels (`{app}--{endpoint}`) and how request URLs map onto them."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ember.errors import InvalidError
from ember.settings import NAME_PATTERN
from ember.spec import FUNCTION_METHOD

SEPARATOR = "--"
# Set by the worker in every replica process: the label of the endpoint it serves.
REPLICA_LABEL_ENV = "EMBER_REPLICA_LABEL"


def make_label(app: str, endpoint: str) -> str:
    return f"{app}{SEPARATOR}{endpoint}"


def split_label(label: str) -> tuple[str, str] | None:
    """Return (app, endpoint) for a well-formed label, else None."""
    app, sep, endpoint = label.partition(SEPARATOR)
    if not sep or not NAME_PATTERN.match(app) or not NAME_PATTERN.match(endpoint):
        return None
    if SEPARATOR in endpoint:
        return None
    return app, endpoint


def current_app() -> str | None:
    """The app whose replica this process is; None outside a replica."""
    parts = split_label(os.environ.get(REPLICA_LABEL_ENV, ""))
    return parts[0] if parts else None


def checked_label(text: str) -> tuple[str, str]:
    """(app, endpoint) of a label typed by a user, or InvalidError saying what a label is:
    names are lower case, so `class Snap` is endpoint `snap`."""
    parts = split_label(text)
    if parts is not None:
        return parts
    hint = ""
    if text != text.lower() and split_label(text.lower()) is not None:
        hint = f" (names are lower case: {text.lower()!r})"
    raise InvalidError(f"{text!r} is not a label; labels look like APP--ENDPOINT{hint}")


def app_here(what: str) -> str:
    """The replica's app, for `what` (e.g. "ember.Dict('results')") made without app=;
    InvalidError outside a replica, where no app is known."""
    app = current_app()
    if app is None:
        raise InvalidError(f"{what} outside a replica needs app= (the app it belongs to)")
    return app


@dataclass(frozen=True)
class Route:
    label: str
    # A method's name or its `path` ("v1/chat/completions"); FUNCTION_METHOD when the URL
    # names no method.
    method: str
    explicit_method: bool
    # The part of the path that named the endpoint ("/app--echo"; "" when the host did):
    # a web app's root path.
    root_path: str = ""


def _strip_port(host: str) -> str:
    if host.startswith("["):  # IPv6 literal
        return host.split("]")[0] + "]"
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def route_request(host: str, path: str, domain: str | None) -> Route | None:
    """Map a request's Host header and path onto an endpoint label and method.

    What follows the label is the method, one segment for its name or several for its
    `path`. `https://{label}.{domain}/{method}` wins when a wildcard domain is configured and the
    host matches it; otherwise `https://{host}:{port}/{label}/{method}`.
    """
    parts = [p for p in path.split("/") if p]
    hostname = _strip_port(host).lower().rstrip(".")
    if domain:
        suffix = "." + domain.lower().rstrip(".")
        if hostname.endswith(suffix):
            sub = hostname[: -len(suffix)]
            if sub and "." not in sub and split_label(sub):
                if parts:
                    return Route(sub, "/".join(parts), True)
                return Route(sub, FUNCTION_METHOD, False)
    if not parts or not split_label(parts[0]):
        return None
    root_path = "/" + parts[0]
    if len(parts) > 1:
        return Route(parts[0], "/".join(parts[1:]), True, root_path)
    return Route(parts[0], FUNCTION_METHOD, False, root_path)


def endpoint_urls(label: str, base_url: str, domain: str | None) -> list[str]:
    """The URLs an endpoint answers at, the wildcard-domain form first when configured."""
    base = base_url.rstrip("/")
    urls = []
    if domain:
        scheme, _, rest = base.partition("://")
        port = ""
        host_port = rest.split("/")[0]
        if ":" in host_port and not host_port.endswith("]"):
            port = ":" + host_port.rsplit(":", 1)[1]
        urls.append(f"{scheme}://{label}.{domain}{port}/")
    urls.append(f"{base}/{label}/")
    return urls
