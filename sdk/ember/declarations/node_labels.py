"""Node labels: `ember worker --label zone=eu-west` describes a node, and an endpoint's
`node_labels={"zone": "eu-west"}` keeps its replicas on nodes that carry all of them
(Kubernetes' nodeSelector)."""

from __future__ import annotations

import re
from typing import Any

from ember.errors import InvalidError

LABEL_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?\Z")
MAX_LABELS = 32


def check_node_labels(what: str, labels: Any) -> dict[str, str]:
    """`labels` if they can be a node's labels, else InvalidError naming `what`."""
    if not isinstance(labels, dict):
        raise InvalidError(f"{what} must map label names to values, e.g. {{'zone': 'eu-west'}}")
    if len(labels) > MAX_LABELS:
        raise InvalidError(f"{what} has {len(labels)} labels; at most {MAX_LABELS}")
    for key, value in labels.items():
        for part, text in (("name", key), ("value", value)):
            if not isinstance(text, str) or not LABEL_PART.match(text):
                raise InvalidError(
                    f"{what}: the label {part} {text!r} is not allowed: use 1-63 letters, "
                    "digits, '.', '_', '-' or '/', starting and ending with a letter or digit"
                )
    return dict(labels)


def parse_node_label(text: str) -> tuple[str, str]:
    """One `KEY=VALUE` of the command line."""
    key, equals, value = text.partition("=")
    if not equals:
        raise InvalidError(f"{text!r} is not KEY=VALUE, e.g. zone=eu-west")
    check_node_labels(f"label {text!r}", {key: value})
    return key, value


def format_labels(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
