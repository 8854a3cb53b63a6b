"""Endpoint labels and how request URLs map onto them.

An endpoint of the `main` workspace is labelled `{app}--{endpoint}`; one of another
workspace `{workspace}--{app}--{endpoint}`. Names never hold `--`, so the two forms never
collide, and inside the platform an app is named by its key: `{app}` in main,
`{workspace}--{app}` elsewhere (every table keyed by app is then per workspace)."""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from ember.declarations.settings import NAME_PATTERN, check_name, normalize_name
from ember.errors import InvalidError
from ember.wire.spec import FUNCTION_METHOD

SEPARATOR = "--"
# Set by the worker in every replica process: the label of the endpoint it serves.
REPLICA_LABEL_ENV = "EMBER_REPLICA_LABEL"


MAIN_WORKSPACE = "main"  # exists from the first start; keeps the two-part labels


def make_label(app: str, endpoint: str) -> str:
    """The label of `endpoint` of the app whose key is `app` (see app_key)."""
    return f"{app}{SEPARATOR}{endpoint}"


def app_key(workspace: str, app: str) -> str:
    """How the platform names `app` of `workspace` inside: the app's own name in main."""
    return app if workspace == MAIN_WORKSPACE else f"{workspace}{SEPARATOR}{app}"


def split_app_key(key: str) -> tuple[str, str]:
    """(workspace, app) of an app key."""
    workspace, sep, app = key.partition(SEPARATOR)
    return (workspace, app) if sep else (MAIN_WORKSPACE, key)


def checked_app_key(text: str) -> tuple[str | None, str] | None:
    """(workspace or None when unnamed, app) of `app` or `workspace--app`, else None."""
    parts = text.split(SEPARATOR)
    if len(parts) > 2 or not all(NAME_PATTERN.match(part) for part in parts):
        return None
    return (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0])


def label_in(workspace: str | None, label: str) -> str:
    """The whole label of `label` as typed in `workspace` (None: main): `app--endpoint`
    there is `workspace--app--endpoint`. One that names its workspace stays as it is."""
    if workspace and workspace != MAIN_WORKSPACE and label.count(SEPARATOR) == 1:
        return f"{workspace}{SEPARATOR}{label}"
    return label


def check_app(text: str) -> str:
    """`text` if it names an app (`app`, or `workspace--app`), else InvalidError."""
    if not isinstance(text, str) or checked_app_key(text) is None:
        check_name("app", text)  # says what a name may be
        raise InvalidError(f"app {text!r} is neither APP nor WORKSPACE--APP")
    return text


def split_label(label: str) -> tuple[str, str] | None:
    """(app key, endpoint) of a well-formed label, else None. A label of main's has two
    parts: `main--app--endpoint` is not one (one endpoint, one label)."""
    parts = label.split(SEPARATOR)
    if len(parts) not in (2, 3) or not all(NAME_PATTERN.match(part) for part in parts):
        return None
    if len(parts) == 3 and parts[0] == MAIN_WORKSPACE:
        return None
    return SEPARATOR.join(parts[:-1]), parts[-1]


def label_names(label: str) -> tuple[str, str, str] | None:
    """(workspace, app, endpoint) of a well-formed label, else None: `team--shop--fn` is
    app `shop` of `team`, never app `team` of main."""
    parts = split_label(label)
    if parts is None:
        return None
    workspace, app = split_app_key(parts[0])
    return workspace, app, parts[1]


def current_app() -> str | None:
    """The key of the app whose replica this process is (`workspace--app` outside the
    main workspace); None outside a replica."""
    parts = split_label(os.environ.get(REPLICA_LABEL_ENV, ""))
    return parts[0] if parts else None


# A name as Python spells it (`round_trip`, `MyModel`), which deploy makes label-safe.
_PYTHON_NAME = re.compile(r"[A-Za-z0-9_-]+\Z")


def label_as_deployed(text: str) -> str | None:
    """The label `text` means when it spells names as Python does (`audio--round_trip`,
    `app--MyModel`): each name normalized as deploy names apps and endpoints
    (`audio--round-trip`, `app--mymodel`). None when that is no label either. A name
    with `_` or capitals is never a label itself, so this meaning is the only one."""
    parts = text.split(SEPARATOR)
    if not all(_PYTHON_NAME.match(part) for part in parts):
        return None
    normalized = SEPARATOR.join(normalize_name(part) for part in parts)
    return normalized if split_label(normalized) is not None else None


def meant_label(text: str) -> str:
    """The label a user typed: `text` itself, or the label it means with names spelt as
    Python spells them (label_as_deployed); else checked_label's InvalidError."""
    if split_label(text) is not None:
        return text
    return label_as_deployed(text) or SEPARATOR.join(checked_label(text))


def nearest_label(label: str, labels: Iterable[str]) -> str | None:
    """Of `labels`, the one `label` most likely misspells (`app--echos`: `app--echo`), or
    None when none is close: for a 404 to name."""
    candidates = list(labels)
    meant = label_as_deployed(label) or label
    if meant in candidates:
        return meant
    close = difflib.get_close_matches(meant, candidates, n=1, cutoff=0.75)
    return close[0] if close else None


def checked_label(text: str) -> tuple[str, str]:
    """(app, endpoint) of a label typed by a user, or InvalidError saying what a label is:
    names are lower case, so `class Snap` is endpoint `snap`."""
    parts = split_label(text)
    if parts is not None:
        return parts
    hint = ""
    meant = label_as_deployed(text)
    if meant is not None:
        spelt = "lower case" if meant == text.lower() else "lower case, with hyphens"
        hint = f" (names are {spelt}: {meant!r})"
    raise InvalidError(
        f"{text!r} is not a label; labels look like APP--ENDPOINT, or "
        f"WORKSPACE--APP--ENDPOINT outside the main workspace{hint}"
    )


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


# One label of a host name in its ASCII form: letters, digits and inner hyphens.
_HOST_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
# Where IDNA 2003 (Python's codec, the certificate's) and browsers' UTS 46 part ways:
# 'ß' is 'ss' to one and 'xn--…' to the other, so a name with one would never route.
_IDNA_DEVIATIONS = frozenset("\u00df\u03c2\u200c\u200d")


def checked_domain(text: str) -> str:
    """The wildcard domain `--domain` names, spelt as Host headers and certificates spell
    it: lower case, an internationalised name as its IDNA A-labels (`bücher.test` is
    `xn--bcher-kva.test`), no trailing dot. InvalidError for what can never be a host's
    suffix: a port, a URL, an IP address, a wildcard, characters no host name has."""
    name = text.strip()
    example = "e.g. --domain ember.example.com"
    if "/" in name:
        raise InvalidError(f"domain {text!r} is not a host name: give the name alone, {example}")
    name = name.removesuffix(".")
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        pass
    else:
        raise InvalidError(f"domain {text!r} is an IP address, which has no subdomains; {example}")
    if ":" in name:
        host = name.rsplit(":", 1)[0]
        raise InvalidError(
            f"domain {text!r} has a port: give the host name alone ({host!r}); endpoints are "
            "served on the server's --port"
        )
    if name.startswith("*."):
        raise InvalidError(
            f"domain {text!r} is a wildcard: give the domain itself ({name[2:]!r}), whose "
            "subdomains serve the endpoints"
        )
    if _IDNA_DEVIATIONS.intersection(name):
        raise InvalidError(
            f"domain {text!r} has a character that browsers and certificates spell "
            "differently in IDNA (ß, ς or a zero-width joiner): give its A-label (xn--…) form"
        )
    try:
        ascii_name = name.encode("idna").decode("ascii").lower()
    except UnicodeError:
        ascii_name = ""  # an empty label, one too long, a character IDNA refuses
    labels = ascii_name.split(".")
    if (
        len(ascii_name) > 253
        or not all(_HOST_LABEL.fullmatch(label) for label in labels)
        or labels[-1].isdigit()
    ):
        raise InvalidError(
            f"domain {text!r} is not a host name: dot-separated labels of letters, digits "
            f"and inner hyphens (1 to 63 each), {example}"
        )
    return ascii_name


@lru_cache(maxsize=16)
def _domain_suffix(domain: str) -> str | None:
    """The ".{domain}" Host headers end with, None for a domain no host can have."""
    try:
        return "." + checked_domain(domain)
    except InvalidError:
        return None


def _strip_port(host: str) -> str:
    if host.startswith("["):  # IPv6 literal
        return host.split("]")[0] + "]"
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def route_request(host: str, path: str, domain: str | None) -> Route | None:
    """Map a request's Host header and path onto an endpoint label and method.

    What follows the label is the method, one segment for its name or several for its
    `path`. `https://{label}.{domain}/{method}` wins when a wildcard domain is configured and the
    host matches it (the domain in `checked_domain`'s form, as Host headers spell it);
    otherwise `https://{host}:{port}/{label}/{method}`.
    """
    parts = [p for p in path.split("/") if p]
    hostname = _strip_port(host).lower().rstrip(".")
    suffix = _domain_suffix(domain) if domain else None
    if suffix is not None and hostname.endswith(suffix):
        sub = hostname[: -len(suffix)]
        if sub and "." not in sub and split_label(sub):
            if parts:
                return Route(sub, "/".join(parts), True)
            return Route(sub, FUNCTION_METHOD, False)
    if not parts:
        return None
    label = parts[0]
    if not split_label(label):
        # `/audio--round_trip/`: the function's own name reaches `audio--round-trip`.
        meant = label_as_deployed(label)
        if meant is None:
            return None
        label = meant
    root_path = "/" + parts[0]
    if len(parts) > 1:
        return Route(label, "/".join(parts[1:]), True, root_path)
    return Route(label, FUNCTION_METHOD, False, root_path)


def endpoint_urls(label: str, base_url: str, domain: str | None) -> list[str]:
    """The URLs an endpoint answers at, the wildcard-domain form (its host in
    `checked_domain`'s form) first when configured."""
    base = base_url.rstrip("/")
    urls = []
    suffix = _domain_suffix(domain) if domain else None
    if suffix is not None:
        scheme, _, rest = base.partition("://")
        port = ""
        host_port = rest.split("/")[0]
        if ":" in host_port and not host_port.endswith("]"):
            port = ":" + host_port.rsplit(":", 1)[1]
        urls.append(f"{scheme}://{label}{suffix}{port}/")
    urls.append(f"{base}/{label}/")
    return urls
