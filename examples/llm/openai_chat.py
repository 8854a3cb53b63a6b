"""OpenAI's chat completions API over the engine: requests checked, text decoded as it
comes, responses and stream chunks shaped as OpenAI clients read them.

The endpoint serves it at `/{label}/v1/chat/completions`, so a client pointed at the base
URL `https://host:port/llm--llm/v1` (and an Ember token as its API key) works unchanged:

    client = openai.OpenAI(base_url=f"{server}/llm--llm/v1", api_key=token, ...)
    client.chat.completions.create(model="smollm2", messages=[...], stream=True)

Beyond OpenAI's fields, every answer carries `prompt_token_ids` and each chunk the
`token_ids` it adds (like vLLM's `return_token_ids`), so the platform's request log shows
the token ids in and out.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ember import InputError

ROLES = ("system", "user", "assistant")
MAX_STOPS = 4  # OpenAI's limit on stop sequences
# Options this engine cannot honour, with the values that ask for nothing (null always
# does): any other value fails the call rather than get an answer that ignores it.
UNSUPPORTED_UNLESS: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
}


# OpenAI's error type for a request it will not serve as sent (400, and 404 for a model).
INVALID_REQUEST = "invalid_request_error"


def invalid(message: str, param: str | None, code: str | None = None) -> InputError:
    """An error as OpenAI's clients read it: `{"error": {"message", "type", "param",
    "code"}}`, `param` naming the request's field at fault."""
    return InputError(message, error_type=INVALID_REQUEST, param=param, code=code)


def check_model(model: str, served: tuple[str, ...]) -> None:
    """A model this endpoint does not serve is a 404, as OpenAI (and vLLM) answer it; a
    request that names none (Ember's own callers) gets the one it serves."""
    if model and model not in served:
        raise InputError(
            f"The model {model!r} does not exist: this endpoint serves {served[0]}",
            status=404,
            error_type=INVALID_REQUEST,
            param="model",
            code="model_not_found",
        )


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict[str, str]]
    max_tokens: int | None  # None: up to the context's room
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    temperature: float  # 0 is greedy
    top_p: float
    seed: int | None
    stop: tuple[str, ...]


def parse_chat_request(arguments: dict[str, Any]) -> ChatRequest:
    """The call's JSON fields checked; InputError (a 400 for the caller, with the field
    as its `param`) says what is wrong."""
    for name, harmless in UNSUPPORTED_UNLESS.items():
        value = arguments.get(name)
        if not _asks_nothing(value, harmless):
            raise invalid(f"{name}={value!r} is not supported by this endpoint", name)
    response_format = arguments.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise invalid("response_format: only {'type': 'text'} is supported", "response_format")
    stream = _optional(arguments, "stream", bool) or False
    stream_options = _optional(arguments, "stream_options", dict)
    if stream_options is not None and not stream:
        # As OpenAI answers: the options say how to stream, and nothing streams.
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    include_usage = _optional(stream_options or {}, "include_usage", bool)
    return ChatRequest(
        model=_optional(arguments, "model", str) or "",
        messages=parse_messages(arguments.get("messages")),
        max_tokens=_max_tokens(arguments),
        stream=stream,
        include_usage=include_usage is True,
        temperature=_number(arguments, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(arguments, "top_p", 1.0, 0.0, 1.0, open_low=True),
        seed=_optional(arguments, "seed", int),
        stop=_stops(arguments.get("stop")),
    )


def _asks_nothing(value: Any, harmless: tuple[Any, ...]) -> bool:
    if value is None:
        return True
    for candidate in harmless:
        if isinstance(candidate, bool) or isinstance(value, bool):
            if value is candidate:  # true is not 1, false is not 0
                return True
        elif value == candidate:  # 0 and 0.0 alike
            return True
    return False


def parse_messages(messages: Any) -> list[dict[str, str]]:
    """[{"role", "content"}] with text content; parts lists of text are joined."""
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list of {role, content} objects", "messages")
    parsed = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise invalid(f"{where} must be an object with role and content", where)
        role = message.get("role")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role not in ROLES:
            raise invalid(
                f"{where}.role must be one of {', '.join(ROLES)}, not {role!r}", f"{where}.role"
            )
        parsed.append({"role": role, "content": _text_content(message.get("content"), where)})
    return parsed


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise invalid(f"{where}.content: only text parts are supported", f"{where}.content")
            if not isinstance(part.get("text"), str):
                raise invalid(
                    f"{where}.content: a text part needs a string 'text'", f"{where}.content"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"{where}.content must be a string or a list of text parts", f"{where}.content")


def _optional(arguments: dict[str, Any], name: str, kind: type) -> Any:
    value = arguments.get(name)
    # bool is an int in Python; an int field must not take true.
    if value is not None and (not isinstance(value, kind) or (kind is int and value is True)):
        raise invalid(f"{name} must be {kind.__name__}, not {value!r}", name)
    return value


def _number(
    arguments: dict[str, Any],
    name: str,
    default: float,
    low: float,
    high: float,
    open_low: bool = False,
) -> float:
    value = arguments.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(f"{name} must be a number, not {value!r}", name)
    if not (low < value if open_low else low <= value) or value > high:
        bound = "(" if open_low else "["
        raise invalid(f"{name} must be in {bound}{low}, {high}], not {value}", name)
    return float(value)


def _max_tokens(arguments: dict[str, Any]) -> int | None:
    # max_completion_tokens replaced max_tokens in OpenAI's API; both are accepted.
    for name in ("max_completion_tokens", "max_tokens"):
        value = _optional(arguments, name, int)
        if value is not None:
            if value < 1:
                raise invalid(f"{name} must be at least 1, not {value}", name)
            return value
    return None


def _stops(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOPS:
        raise invalid(f"stop takes at most {MAX_STOPS} sequences", "stop")
    return tuple(stops)


class TextStream:
    """Generated token ids in, text out as soon as it is final.

    Text is held back while it ends inside a UTF-8 character (byte-level tokens split
    them) or could be the start of a stop sequence; a stop sequence found ends the text
    before it (`stopped`).
    """

    def __init__(self, tokenizer: Any, stops: Iterable[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.ids: list[int] = []
        self.text = ""  # all text given out so far
        self.stopped = False
        # The end-of-turn token came: generated, though it has no text (see `generated`).
        self.ended_by_token = False
        self._decoded = ""

    def push(self, token_id: int) -> str:
        """Take one more token; the text that became final (maybe "")."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        self._decoded = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if self._decoded.endswith("\ufffd"):
            return ""  # inside a character: its other bytes come with the next tokens
        return self._release(final=False)

    @property
    def generated(self) -> int:
        """Tokens the model generated for this answer, as OpenAI's `completion_tokens`
        counts them: the end-of-turn token too (vLLM's output token ids hold it and count
        towards max_tokens), though it adds no text and no `token_ids`."""
        return len(self.ids) + self.ended_by_token

    def finish(self) -> str:
        """The text still held back, once no more tokens come."""
        return "" if self.stopped else self._release(final=True)

    def _release(self, final: bool) -> str:
        decoded = self._decoded
        # A stop sequence may straddle what was given out and the new text.
        search_from = max(0, len(self.text) - max(map(len, self.stops), default=0))
        found = [i for i in (decoded.find(s, search_from) for s in self.stops) if i >= 0]
        if found:
            end = min(found)
            self.stopped = True
        elif final:
            end = len(decoded)
        else:
            end = len(decoded) - self._held_back(decoded)
        delta = decoded[len(self.text) : end]
        self.text += delta
        return delta

    def _held_back(self, decoded: str) -> int:
        """Length of the longest end of `decoded` that starts some stop sequence."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(decoded)), longest, -1):
                if decoded.endswith(stop[:size]):
                    longest = size
                    break
        return longest


def completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class Piece:
    """Text that became final, the token ids that made it, and why the answer ended (in
    the last piece only)."""

    text: str
    ids: list[int]
    finish_reason: str | None = None


def pieces(tokens: Iterable[int], stream: TextStream, stop_ids: frozenset[int]) -> Iterator[Piece]:
    """Decode `tokens` as they come; the caller stops the generation after the last piece
    (a stop sequence ends the answer before the engine knows)."""
    pending: list[int] = []  # ids whose text is held back
    finish_reason = "length"
    for token in tokens:
        if token in stop_ids:  # the end-of-turn token: not part of the text
            finish_reason = "stop"
            stream.ended_by_token = True
            break
        pending.append(token)
        text = stream.push(token)
        if stream.stopped:
            yield Piece(text, pending, "stop")
            return
        if text:
            yield Piece(text, pending)
            pending = []
    yield Piece(stream.finish(), pending, finish_reason)


def completion(
    request: ChatRequest, prompt_ids: list[int], stream: TextStream, finish_reason: str
) -> dict[str, Any]:
    """The whole answer as one `chat.completion` object."""
    return {
        "id": completion_id(),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": stream.text},
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": usage(len(prompt_ids), stream.generated),
        "prompt_token_ids": prompt_ids,
        "token_ids": stream.ids,
    }


def chunks(
    request: ChatRequest, prompt_ids: list[int], decoded: Iterable[Piece], stream: TextStream
) -> Iterator[dict[str, Any]]:
    """`chat.completion.chunk` objects: the first carries the role with the first text (so
    its arrival is the time to first token) and the prompt's ids, the last the finish
    reason, then one with the usage if the request asked for it."""
    ident, created = completion_id(), int(time.time())
    first = True
    for piece in decoded:
        delta: dict[str, str] = {}
        if first:
            delta["role"] = "assistant"
        if piece.text or first:
            delta["content"] = piece.text
        body: dict[str, Any] = {
            "id": ident,
            "object": "chat.completion.chunk",
            "created": created,
            "model": request.model,
            "choices": [
                {
                    "index": 0,
                    "delta": delta,
                    "finish_reason": piece.finish_reason,
                    "logprobs": None,
                }
            ],
            "token_ids": piece.ids,
        }
        if first:
            body["prompt_token_ids"] = prompt_ids
        first = False
        yield body
    if request.include_usage:
        yield {
            "id": ident,
            "object": "chat.completion.chunk",
            "created": created,
            "model": request.model,
            "choices": [],
            "usage": usage(len(prompt_ids), stream.generated),
        }
