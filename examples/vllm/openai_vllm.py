"""OpenAI's chat completions and completions over vLLM's engine: requests checked by
vLLM's own request models (so a bad parameter gets vLLM's message), answers and stream
chunks shaped as OpenAI's clients read them, errors in OpenAI's shape through
`ember.InputError`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from http import HTTPStatus
from typing import Any

from ember import InputError


def vllm_error(error: Exception) -> InputError:
    """What vLLM's server answers for `error` (its status, type, param and message), as
    an error Ember sends in OpenAI's shape."""
    from pydantic import ValidationError

    if isinstance(error, ValidationError):
        errors = error.errors(include_url=False)
        loc = errors[0]["loc"] if errors else ()
        param = ".".join(str(p) for p in loc) or None
        label = "error" if len(errors) == 1 else "errors"
        lines = "".join(f"\n  {_brief(e)}" for e in errors[:10])
        return InputError(
            f"{len(errors)} validation {label}:{lines}",
            error_type=HTTPStatus.BAD_REQUEST.phrase,
            param=param,
            code=str(int(HTTPStatus.BAD_REQUEST)),
        )
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response  # type: ignore[import-not-found, unused-ignore]

    answer = create_error_response(error).error
    return InputError(
        answer.message,
        status=int(answer.code) if 400 <= int(answer.code) < 500 else 400,
        error_type=answer.type,
        param=answer.param,
        code=str(answer.code),
    )


def _brief(error: Any) -> str:
    shown = {k: error[k] for k in ("type", "loc", "msg") if k in error}
    return str(shown)


def check_model(model: Any, served: str) -> None:
    """vLLM's answer to a model it does not serve: a 404 NotFoundError. No model at all
    (Ember's own callers) means the one served."""
    if model and model != served:
        raise InputError(
            f"The model `{model}` does not exist.",
            status=404,
            error_type="NotFoundError",
            param="model",
            code="404",
        )


def parse(request_class: Any, body: dict[str, Any], served: str) -> Any:
    """The request as vLLM's model of it (`ChatCompletionRequest`, `CompletionRequest`)."""
    from pydantic import ValidationError

    check_model(body.get("model"), served)
    try:
        return request_class.model_validate({"model": served, **body})
    except ValidationError as error:
        raise vllm_error(error) from None


def sampling(request: Any, room: int) -> Any:
    """vLLM's SamplingParams for the request (its own defaults and checks), at most `room`
    new tokens."""
    wanted = getattr(request, "max_completion_tokens", None) or request.max_tokens
    if wanted is not None and wanted > room:
        raise InputError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {wanted}. This model's "
            f"maximum context length is {room} tokens after the prompt.",
            error_type="BadRequestError",
            param="max_tokens",
            code="400",
        )
    try:
        params = request.to_sampling_params(wanted or room, {})
    except Exception as error:
        raise vllm_error(error) from None
    if params.n != 1:
        raise InputError("n must be 1 here", error_type="BadRequestError", param="n", code="400")
    return params


class Answer:
    """One request's answer as it streams: ids, the text so far, token counts."""

    def __init__(self, kind: str, model: str, prompt_tokens: int) -> None:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id = f"{prefix}-{secrets.token_hex(12)}"
        self.kind = kind
        self.model = model
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.text: list[str] = []
        self.finish_reason: str | None = None

    def add(self, output: Any) -> str:
        """Take in one delta `RequestOutput`; the text it adds."""
        choice = output.outputs[0]
        self.completion_tokens += len(choice.token_ids)
        self.text.append(choice.text)
        if choice.finish_reason is not None:
            self.finish_reason = choice.finish_reason
        return str(choice.text)

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def whole(self) -> dict[str, Any]:
        text = "".join(self.text)
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish_reason or "length"}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = None
        else:
            choice["text"] = text
            choice["logprobs"] = None
        return {
            "id": self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(),
        }

    def chunk(self, text: str | None, finish_reason: str | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.kind == "chat":
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice["text"] = text or ""
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def usage_chunk(self) -> dict[str, Any]:
        return {**self.chunk(None), "choices": [], "usage": self.usage()}


def stream(answer: Answer, outputs: Iterator[Any], include_usage: bool) -> Iterator[dict[str, Any]]:
    """OpenAI's chunks for a streamed answer, as vLLM's server sends them: the role once
    the first output is there (chat), a chunk per step's text, the last one with the
    finish reason, then the usage when asked for."""
    first = True
    for output in outputs:
        if first and answer.kind == "chat":
            role = answer.chunk("")
            role["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield role
        first = False
        text = answer.add(output)
        if text or output.finished:
            yield answer.chunk(text, answer.finish_reason if output.finished else None)
    if include_usage:
        yield answer.usage_chunk()


def invalid_prompt() -> InputError:
    return InputError(
        "prompt must be a string or a non-empty list of token ids (one prompt)",
        error_type="BadRequestError",
        param="prompt",
        code="400",
    )
