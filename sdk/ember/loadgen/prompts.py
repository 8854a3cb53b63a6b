"""The keyword arguments each request sends: from a JSONL file, or a synthetic prompt."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from itertools import cycle
from pathlib import Path
from typing import Any

from ember.errors import InvalidError
from ember.loadgen.fit import Accepts, synthetic_template

# Short common words: a synthetic prompt of N words is roughly N tokens for most tokenizers.
_WORDS = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with",
    "be", "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which",
    "but", "have", "an", "they", "you", "were", "her", "she",
)  # fmt: skip


def strict_json(text: str) -> Any:
    """JSON as requests may carry it: NaN, Infinity and numbers past a float's range are
    refused (ValueError) here, since a request body cannot hold them."""
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of a float's range")
    return value


def parse_arguments(text: str, what: str) -> dict[str, Any]:
    """A JSON object of keyword arguments from the command line, or a one-line error."""
    try:
        value = strict_json(text)
    except ValueError as exc:
        raise InvalidError(f"{what} must be JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidError(f"{what} must be a JSON object, e.g. '{{\"temperature\": 0}}'")
    return value


def parse_prompt_lines(lines: list[str], source: str) -> list[dict[str, Any]]:
    """One JSON object per non-blank line; a bad line raises an error naming it."""
    arguments = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = strict_json(line)
        except ValueError as exc:
            raise InvalidError(f"{source}, line {number}: not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise InvalidError(
                f"{source}, line {number}: expected a JSON object of keyword arguments, "
                f'e.g. {{"prompt": "hi", "max_tokens": 64}}'
            )
        arguments.append(value)
    if not arguments:
        raise InvalidError(f"{source} holds no requests (one JSON object per line)")
    return arguments


def read_text_file(path: Path, what: str) -> str:
    """A file of JSON as text: UTF-8, as JSON is, whatever the locale."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidError(f"cannot read {what} {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise InvalidError(
            f"{what} {path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} "
            f"at offset {exc.start})"
        ) from None


def load_prompt_file(path: Path) -> list[dict[str, Any]]:
    text = read_text_file(path, "the prompts file")
    return parse_prompt_lines(text.splitlines(), str(path))


def synthetic_prompt(words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def argument_stream(
    *,
    prompts: list[dict[str, Any]] | None,
    input_len: int,
    max_tokens: int,
    extra: dict[str, Any],
    seed: int | None,
    accepts: Accepts | None = None,
) -> Iterator[dict[str, Any]]:
    """Endless request arguments: the file's lines in turn, or fresh synthetic prompts
    shaped as the method takes them (`accepts`: chat messages or a prompt).

    `extra` is merged last, so it adds to or overrides whatever the line or template says;
    a key it sets to None is left out, so endpoints without `prompt` can be driven too.
    """
    if prompts is not None:
        for arguments in cycle(prompts):
            yield merge_arguments(arguments, extra)
    rng = random.Random(seed)
    while True:
        template = synthetic_template(accepts, synthetic_prompt(input_len, rng), max_tokens)
        yield merge_arguments(template, extra)


def merge_arguments(arguments: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = {**arguments, **extra}
    return {key: value for key, value in merged.items() if value is not None}
