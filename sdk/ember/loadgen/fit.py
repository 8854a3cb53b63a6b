"""What a method takes, read from its arguments' schema: the synthetic load is shaped to
fit it (OpenAI chat `messages` for a chat method), and requests it cannot take are
refused before any is sent."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ember.errors import InvalidError
from ember.wire.spec import MethodSpec

# The names a method may give its output bound, in the order they are preferred; OpenAI's
# newer max_completion_tokens wins over max_tokens in its API, so a line's own is replaced.
MAX_TOKENS_NAMES = ("max_tokens", "max_completion_tokens", "max_new_tokens")
CHAT_PATH = "chat/completions"


@dataclass(frozen=True)
class Accepts:
    """The keyword arguments one method takes."""

    where: str  # how messages name the method, e.g. "hello--greet"
    properties: tuple[str, ...]  # in the signature's order
    required: frozenset[str]
    open_ended: bool  # **kwargs: any name is taken
    chat: bool  # OpenAI's chat completions: a list of `messages`
    # A value for each parameter that a suggested --body may show: its default, or one
    # of its type.
    examples: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def max_tokens_name(self) -> str | None:
        """The argument that bounds the output's length; None if the method has none."""
        for name in MAX_TOKENS_NAMES:
            if name in self.properties:
                return name
        return MAX_TOKENS_NAMES[0] if self.open_ended else None

    def describe(self) -> str:
        if not self.properties:
            return "takes any arguments" if self.open_ended else "takes no arguments"
        names = [
            f"{name} (required)" if name in self.required else name for name in self.properties
        ]
        more = " and any other" if self.open_ended else ""
        return f"takes {', '.join(names)}{more}"


def accepts_of(where: str, spec: MethodSpec | None, path: str | None) -> Accepts | None:
    """What the method takes; None when nothing is known (a web app's route is only known
    to be a chat one by its path)."""
    by_path = path is not None and path.strip("/").endswith(CHAT_PATH)
    if spec is None or spec.arguments_schema is None:
        if not by_path:
            return None
        return Accepts(where, ("messages",), frozenset({"messages"}), True, True)
    schema = spec.arguments_schema
    properties = tuple(schema.get("properties", {}))
    examples = {name: _example(each) for name, each in schema.get("properties", {}).items()}
    required = frozenset(schema.get("required", ()))
    chat = "messages" in properties or by_path or (spec.path or "").endswith(CHAT_PATH)
    if chat:
        required |= {"messages"}  # an OpenAI method reads its body itself (**request)
    open_ended = schema.get("additionalProperties") is not False
    return Accepts(where, properties, required, open_ended, chat, examples)


_TYPE_EXAMPLES: dict[str, Any] = {
    "integer": 1,
    "number": 1.0,
    "boolean": False,
    "array": [],
    "object": {},
}


def _example(schema: dict[str, Any]) -> Any:
    if "default" in schema:
        return schema["default"]
    return _TYPE_EXAMPLES.get(schema.get("type", ""), "...")


def synthetic_template(accepts: Accepts | None, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One synthetic request: a chat's messages, or a prompt; with the output bound under
    the name the method gives it (none when it takes none)."""
    if accepts is not None and accepts.chat:
        template: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]}
    else:
        template = {"prompt": prompt}
    name = accepts.max_tokens_name if accepts is not None else MAX_TOKENS_NAMES[0]
    if name is not None:
        template[name] = max_tokens
    return template


def with_max_tokens(arguments: dict[str, Any], name: str, max_tokens: int) -> dict[str, Any]:
    """A request's arguments bounded by --max-tokens: the method's own name set, the
    others (which may take precedence, as OpenAI's max_completion_tokens does) left out."""
    kept = {key: value for key, value in arguments.items() if key not in MAX_TOKENS_NAMES}
    return {**kept, name: max_tokens}


def check_requests(
    accepts: Accepts | None, requests: Sequence[dict[str, Any]], source: str, how: str
) -> None:
    """Refuse requests the method cannot take: unknown names (unless it takes **kwargs) or
    a required one missing. `how` says what to pass instead."""
    if accepts is None:
        return
    for number, request in enumerate(requests, start=1):
        unknown = [] if accepts.open_ended else sorted(set(request) - set(accepts.properties))
        missing = sorted(accepts.required - set(request))
        if not unknown and not missing:
            continue
        where = source if len(requests) == 1 else f"{source}, request {number}"
        problems = []
        if unknown:
            problems.append(f"sends {', '.join(unknown)}, which it does not take")
        if missing:
            problems.append(f"lacks {', '.join(missing)}, which it needs")
        raise InvalidError(
            f"{accepts.where} {accepts.describe()}; {where} {' and '.join(problems)}: {how}"
        )


def example_body(accepts: Accepts) -> str:
    """A --body to suggest: the method's parameters with placeholder values."""
    if accepts.chat:
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "..."}]}
    else:
        names = [name for name in accepts.properties if name in accepts.required]
        body = {name: accepts.examples.get(name, "...") for name in names or accepts.properties[:1]}
    return json.dumps(body)
