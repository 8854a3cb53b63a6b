"""An image's steps as data, and each one's layer digest: the hash of the step's
definition and of its parent layer's digest, so that a layer is the same wherever the
same steps led to it, and every layer above a changed step changes too.

A step is a dict with a "kind" and the fields of that kind; this is what travels in the
manifest (`EndpointSettings.image`) and what a worker's builder reads. Fields that do
not decide what the layer holds stay out of its digest: where a copied folder was on
the deploying machine (its contents count), and the secret a registry is read with."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from ember.errors import InvalidError
from ember.images import checks
from ember.images.references import parse_reference

# Python versions `debian_slim` offers: each is the python3 of one Debian release.
DEBIAN_SUITES = {"3.11": "bookworm", "3.13": "trixie"}
BASE_KINDS = ("debian_slim", "registry")
LAYER_KINDS = ("apt", "pip", "run", "env", "workdir", "local_dir", "local_file")
# Steps that change only the image's configuration: they have a digest but no files.
CONFIG_KINDS = ("env", "workdir")
NOT_IN_DIGEST = {"local", "secret", "digest"}
MAX_STEPS = 128
DIGEST = re.compile(r"sha256:[0-9a-f]{64}\Z")
CONTENTS = re.compile(r"[-x]? ?[0-9a-f]{64}\Z")


def layer_digest(parent: str | None, step: dict[str, Any]) -> str:
    definition = {k: v for k, v in step.items() if k not in NOT_IN_DIGEST}
    text = json.dumps({"parent": parent or "", "step": definition}, sort_keys=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def suite_for(python: Any) -> str:
    if python not in DEBIAN_SUITES:
        raise InvalidError(
            f"debian_slim(python={python!r}): choose one of {', '.join(DEBIAN_SUITES)} "
            "(each is Debian's own python3 of one release)"
        )
    return DEBIAN_SUITES[python]


def check_step(step: Any, first: bool) -> dict[str, Any]:
    """A step read back from a manifest, checked as when it was declared (the files of a
    copy step aside: only their recorded digest can be checked)."""
    if not isinstance(step, dict) or not isinstance(step.get("kind"), str):
        raise InvalidError(f"image step {step!r} is not a step")
    kind = step["kind"]
    if first != (kind in BASE_KINDS):
        raise InvalidError(
            "an image starts with Image.debian_slim() or Image.from_registry(), and only "
            f"its first step may; found {kind!r} " + ("first" if first else "later")
        )
    if kind == "debian_slim":
        if step.get("suite") != suite_for(step.get("python")):
            raise InvalidError(f"image step {step!r}: its suite does not match its python")
        return {"kind": kind, "python": step["python"], "suite": step["suite"]}
    if kind == "registry":
        parse_reference(step.get("reference"))
        secret = checks.check_secret_name(step.get("secret"))
        return {"kind": kind, "reference": step["reference"], "secret": secret}
    if kind == "apt":
        return {"kind": kind, "packages": checks.check_apt_packages(step.get("packages") or [])}
    if kind == "pip":
        return {
            "kind": kind,
            "packages": checks.check_pip_packages(step.get("packages") or []),
            "index_url": checks.check_index_url(step.get("index_url")),
        }
    if kind == "run":
        return {"kind": kind, "commands": checks.check_commands(step.get("commands") or [])}
    if kind == "env":
        return {"kind": kind, "env": checks.check_env(step.get("env"))}
    if kind == "workdir":
        return {"kind": kind, "path": checks.check_remote_path("workdir", step.get("path"))}
    if kind in ("local_dir", "local_file"):
        contents = step.get("contents")
        if not isinstance(contents, str) or not CONTENTS.match(contents):
            raise InvalidError(f"image step {kind}: {contents!r} is not a contents digest")
        local = step.get("local")
        if not isinstance(local, str) or not local:
            raise InvalidError(f"image step {kind}: {local!r} is not a local path")
        return {
            "kind": kind,
            "local": local,
            "remote": checks.check_remote_path(kind, step.get("remote")),
            "contents": contents,
        }
    raise InvalidError(f"image step kind {kind!r} is unknown")
