"""Where images live in the blob store: layer tars (and file indexes) by their sha256,
layer entries and image records by their digest, uploaded local files by their sha256,
and which workspaces may use a registry layer (grants.py) by its digest and theirs."""

from __future__ import annotations

import re

HEX = re.compile(r"[0-9a-f]{64}\Z")
BLOBS = "image-blobs/"
LAYERS = "image-layers/"
RECORDS = "images/"
FILES = "image-files/"
GRANTS = "image-grants/"


def blob_key(hex_digest: str) -> str:
    return BLOBS + hex_digest


def layer_key(hex_digest: str) -> str:
    return LAYERS + hex_digest + ".json"


def record_key(hex_digest: str) -> str:
    return RECORDS + hex_digest + ".json"


def files_key(hex_digest: str) -> str:
    return FILES + hex_digest


def grant_key(hex_digest: str, workspace: str) -> str:
    return f"{GRANTS}{hex_digest}/{workspace}.json"
