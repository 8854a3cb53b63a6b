"""The rules an image's steps follow, checked when the step is declared so that a
mistake is an InvalidError at the line that made it, not a failed build on a worker."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from ember.errors import InvalidError

# Debian's package names (Policy 5.6.7), an optional ":arch" and "=version".
APT_PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.-]+(:[a-z0-9-]+)?(=[A-Za-z0-9.+~:-]+)?\Z")
# A pip requirement's project name (PEP 508), then whatever may follow it on one line:
# extras, a version specifier, markers. pip itself checks the rest.
PIP_REQUIREMENT = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?(\s*[\[<>=!~;@ (].*)?\Z")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
RESERVED_ENV_PREFIX = "EMBER_"
# A secret's name, as `ember secret set` allows it (ember.declarations.settings.check_name).
SECRET_NAME = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,46}[a-z0-9])?\Z")
MAX_ITEMS = 200  # packages or commands in one step
MAX_TEXT = 4096  # characters of one package, command, path or value


def flatten(what: str, items: Iterable[Any]) -> list[str]:
    """`("a", ["b", "c"])` as ["a", "b", "c"]: a step takes names and lists of names."""
    flat: list[str] = []
    for item in items:
        if isinstance(item, list | tuple):
            flat.extend(item)
        else:
            flat.append(item)
    if not flat:
        raise InvalidError(f"{what}() needs at least one argument")
    if len(flat) > MAX_ITEMS:
        raise InvalidError(f"{what}() takes at most {MAX_ITEMS} items, not {len(flat)}")
    for item in flat:
        if not isinstance(item, str):
            raise InvalidError(f"{what}(): {item!r} is not a string")
    return flat


def _one_line(what: str, text: str) -> None:
    if not text.strip() or len(text) > MAX_TEXT or any(c in text for c in "\r\n\0"):
        raise InvalidError(
            f"{what}: {text[:80]!r} must be one line of at most {MAX_TEXT} characters, not empty"
        )


def check_apt_packages(packages: Iterable[Any]) -> list[str]:
    names = flatten("apt_install", packages)
    for name in names:
        if not APT_PACKAGE.match(name):
            raise InvalidError(
                f"apt_install: {name!r} is not a Debian package name (lower-case letters, "
                "digits, '+', '-' and '.', at least 2 characters, optionally ':arch' and "
                "'=version'), e.g. apt_install('ffmpeg', 'libgl1')"
            )
    return names


def check_pip_packages(packages: Iterable[Any]) -> list[str]:
    requirements = flatten("pip_install", packages)
    for line in requirements:
        _one_line("pip_install", line)
        if line.lstrip().startswith("-"):
            raise InvalidError(
                f"pip_install: {line!r} is an option, not a requirement; pass the index "
                "as pip_install(..., index_url='https://...')"
            )
        if not PIP_REQUIREMENT.match(line.strip()):
            raise InvalidError(
                f"pip_install: {line!r} is not a requirement such as 'numpy>=2' or 'torch==2.5.1'"
            )
    return [line.strip() for line in requirements]


def check_index_url(url: Any) -> str | None:
    if url is None:
        return None
    if not isinstance(url, str):
        raise InvalidError(f"index_url={url!r} must be a URL")
    _one_line("index_url", url)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or " " in url:
        raise InvalidError(f"index_url={url!r}: use an http:// or https:// URL")
    return url


def check_commands(commands: Iterable[Any]) -> list[str]:
    lines = flatten("run_commands", commands)
    for line in lines:
        if not line.strip() or len(line) > 64 * 1024 or "\0" in line:
            raise InvalidError(
                f"run_commands: {line[:80]!r} must be a shell command, not empty, without "
                "NUL characters, at most 64 KiB"
            )
    return lines


def check_env(values: Any) -> dict[str, str]:
    if not isinstance(values, dict) or not values:
        raise InvalidError("env() takes a dict of variable names to values, e.g. env({'A': '1'})")
    if len(values) > MAX_ITEMS:
        raise InvalidError(f"env() takes at most {MAX_ITEMS} variables, not {len(values)}")
    for key, value in values.items():
        if not isinstance(key, str) or not ENV_NAME.match(key):
            raise InvalidError(
                f"env(): {key!r} is not an environment variable name: use letters, digits "
                "and underscores, not starting with a digit"
            )
        if key.upper().startswith(RESERVED_ENV_PREFIX):
            raise InvalidError(
                f"env(): {key}: names starting with {RESERVED_ENV_PREFIX} are Ember's"
            )
        if not isinstance(value, str) or "\0" in value or len(value) > 64 * 1024:
            raise InvalidError(
                f"env(): the value of {key} must be text without NUL characters, at most 64 KiB"
            )
    return {key: values[key] for key in sorted(values)}


def check_remote_path(what: str, path: Any) -> str:
    """An absolute POSIX path inside the image, normalised (no '..', no '.', no '//')."""
    if not isinstance(path, str):
        raise InvalidError(f"{what}: {path!r} must be a path in the image, e.g. '/app'")
    _one_line(what, path)
    pure = PurePosixPath(path)
    if not pure.is_absolute():
        raise InvalidError(f"{what}: {path!r} must be an absolute path in the image, e.g. '/app'")
    if ".." in pure.parts:
        raise InvalidError(f"{what}: {path!r} may not contain '..'")
    return str(pure)


def check_secret_name(secret: Any) -> str | None:
    if secret is None:
        return None
    if not isinstance(secret, str) or not SECRET_NAME.match(secret) or "--" in secret:
        raise InvalidError(
            f"from_registry: secret={secret!r} must be a secret's name (`ember secret set "
            "NAME REGISTRY_USERNAME=... REGISTRY_PASSWORD=...`)"
        )
    return secret
