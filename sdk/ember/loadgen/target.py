"""What to load: `APP/ENDPOINT[/METHOD]`, `APP--ENDPOINT[/METHOD]` or a full URL.

For a web app (`@ember.asgi_app()`, `@ember.wsgi_app()`) METHOD is any path its routes
serve, such as v1/chat/completions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from urllib.parse import urlsplit

import httpx

from ember.calling.client import error_from_response
from ember.calling.tlsclient import client_context
from ember.config import ClientConfig
from ember.errors import EmberError, InvalidError
from ember.wire.labels import make_label, route_request, split_label
from ember.wire.spec import FUNCTION_METHOD, MethodSpec, method_at


@dataclass(frozen=True)
class Target:
    url: str
    label: str
    method: str | None  # a name or a path ("v1/chat/completions"); None: the URL names none
    streaming: bool | None = None  # known once checked against the platform
    # The argument that makes a call stream, for a method that decides per call (OpenAI's
    # "stream"); the load sets it to true.
    stream_flag: str | None = None
    web_app: bool = False  # every path under the endpoint's URL is the app's own
    # The method as the platform describes it (its arguments' schema among the rest);
    # None for a web app, whose routes say nothing of what they take.
    spec: MethodSpec | None = None


# The kind a web app endpoint is deployed as (ASGI and WSGI alike).
WEB_APP_KIND = "asgi"


def parse_target(text: str, config: ClientConfig) -> Target:
    if text.startswith(("https://", "http://")):
        parts = urlsplit(text)
        route = route_request(parts.netloc, parts.path, config.domain)
        if route is None:
            raise InvalidError(f"{text} is not an endpoint URL (see `ember ls`)")
        return Target(text, route.label, route.method if route.explicit_method else None)
    if "--" in text:
        label, _, method = text.partition("/")
    else:
        app, _, rest = text.partition("/")
        endpoint, _, method = rest.partition("/")
        label = make_label(app, endpoint)
    if split_label(label) is None:
        raise InvalidError(
            f"{text!r} names no endpoint; write APP/ENDPOINT[/METHOD], "
            "APP--ENDPOINT[/METHOD] or the endpoint's URL"
        )
    method = "/".join(part for part in method.split("/") if part)  # a name or a path
    url = f"{config.server_url.rstrip('/')}/{label}/{method}"
    return Target(url, label, method or None)


def check_target(target: Target, config: ClientConfig) -> Target:
    """Ask the platform whether the endpoint (and method) exist and the token may call it.

    Raises an EmberError with a one-line message; returns the target with `streaming` set.
    """
    try:
        with httpx.Client(
            verify=client_context(config.ca_cert),
            headers={"Authorization": f"Bearer {config.token}"},
            timeout=httpx.Timeout(30.0, connect=10.0),
        ) as client:
            response = client.get(f"{config.server_url.rstrip('/')}/v1/endpoints/{target.label}")
    except httpx.HTTPError as exc:
        raise EmberError(
            f"cannot reach the Ember server at {config.server_url}: {exc or type(exc).__name__}"
        ) from None
    if response.status_code != 200:
        raise error_from_response(response.status_code, response.content)
    info = response.json()
    if info.get("kind") == WEB_APP_KIND:
        # No methods to check: the app routes the path itself, and each answer shows
        # whether it streams.
        return replace(target, web_app=True)
    methods = {m.name: m for m in map(MethodSpec.from_dict, info.get("methods", []))}
    if info.get("kind") == "function":
        if target.method is not None:
            raise InvalidError(f"{target.label} is a function endpoint; it has no methods")
        found = methods.get(FUNCTION_METHOD)
        return Target(
            target.url, target.label, None, found.streaming if found else None, spec=found
        )
    if target.method is None:
        if len(methods) != 1:
            listed = ", ".join(f"{target.label}/{name}" for name in sorted(methods))
            raise InvalidError(f"{target.label} is a class endpoint; name a method: {listed}")
        (found,) = methods.values()
    else:
        found = method_at(methods, target.method)
        if found is None:
            listed = ", ".join(sorted(methods))
            raise InvalidError(f"{target.label} has no method {target.method!r} (it has: {listed})")
    streaming = found.streaming or found.stream_flag is not None
    return Target(target.url, target.label, found.name, streaming, found.stream_flag, spec=found)
