"""`ember bench` shapes its synthetic requests to the method's parameters and refuses,
before sending anything, requests the method cannot take."""

from __future__ import annotations

from itertools import islice
from typing import Any

import pytest

from ember.endpoints.schemas import arguments_schema
from ember.errors import InvalidError
from ember.loadgen.fit import (
    accepts_of,
    check_requests,
    example_body,
    synthetic_template,
    with_max_tokens,
)
from ember.loadgen.prompts import argument_stream
from ember.wire.spec import MethodSpec


def greet(name: str = "world", excited: bool = False) -> dict:
    return {}


def generate(prompt_ids: list[int], max_new_tokens: int = 64) -> Any:
    return None


def chat_completions(**request: Any) -> Any:
    return None


def spec_of(func: Any, path: str | None = None) -> MethodSpec:
    return MethodSpec(
        name=func.__name__,
        streaming=False,
        is_async=False,
        path=path,
        arguments_schema=arguments_schema(func),
    )


def test_a_chat_method_gets_messages_and_max_tokens() -> None:
    accepts = accepts_of("llm--llm", spec_of(chat_completions, "v1/chat/completions"), None)
    assert accepts is not None and accepts.chat
    (request,) = islice(
        argument_stream(prompts=None, input_len=4, max_tokens=7, extra={}, seed=0, accepts=accepts),
        1,
    )
    assert set(request) == {"messages", "max_tokens"}
    assert request["messages"][0]["role"] == "user"
    assert len(request["messages"][0]["content"].split()) == 4
    assert request["max_tokens"] == 7
    check_requests(accepts, [request], "the synthetic load", "")


def test_a_web_apps_chat_route_is_known_by_its_path() -> None:
    accepts = accepts_of("web--api", None, "v1/chat/completions")
    assert accepts is not None and accepts.chat
    assert accepts_of("web--api", None, "v1/completions") is None


def test_a_method_without_prompt_is_refused_with_what_it_takes() -> None:
    accepts = accepts_of("hello--greet", spec_of(greet), None)
    assert accepts is not None and not accepts.chat
    assert accepts.max_tokens_name is None
    template = synthetic_template(accepts, "a b c", 9)
    assert template == {"prompt": "a b c"}  # no max_tokens for a method that has none
    with pytest.raises(InvalidError) as refused:
        check_requests(accepts, [template], "the synthetic load", "pass --body")
    message = str(refused.value)
    assert message.startswith("hello--greet takes name, excited;")
    assert "the synthetic load sends prompt, which it does not take: pass --body" in message
    assert example_body(accepts) == '{"name": "world"}'
    check_requests(accepts, [{"name": "Ada"}], "--body", "")


def test_a_missing_required_argument_is_named() -> None:
    accepts = accepts_of("llm--llm/generate", spec_of(generate), "generate")
    assert accepts is not None
    assert accepts.max_tokens_name == "max_new_tokens"
    assert synthetic_template(accepts, "hi", 5) == {"prompt": "hi", "max_new_tokens": 5}
    with pytest.raises(InvalidError, match="lacks prompt_ids, which it needs"):
        check_requests(accepts, [{"max_new_tokens": 3}], "--prompts", "")
    assert "prompt_ids (required)" in accepts.describe()


def test_a_chat_request_without_messages_is_refused() -> None:
    accepts = accepts_of("llm--llm", spec_of(chat_completions, "v1/chat/completions"), None)
    with pytest.raises(InvalidError, match=r"request 2 lacks messages"):
        check_requests(accepts, [{"messages": []}, {"prompt": "hi"}], "--prompts", "use messages")


def test_max_tokens_replaces_every_other_bound() -> None:
    line = {"messages": [], "max_completion_tokens": 600, "max_tokens": 500, "seed": 1}
    assert with_max_tokens(line, "max_tokens", 8) == {
        "messages": [],
        "seed": 1,
        "max_tokens": 8,
    }
