"""examples/llm/app.py's chat_completions with a stand-in engine: a stream takes no
engine slot until it is read, so one closed unread leaves none behind."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from llm_example import EXAMPLE, example_module


class FakeHandle:
    def __init__(self) -> None:
        self.cancelled = False

    def tokens(self) -> Iterator[int]:
        yield from (5, 6, 7)

    def cancel(self) -> None:
        self.cancelled = True


class FakeEngine:
    def __init__(self) -> None:
        self.handles: list[FakeHandle] = []

    def submit(self, prompt: list[int], max_new_tokens: int, **_: Any) -> FakeHandle:
        self.handles.append(FakeHandle())
        return self.handles[-1]


class FakeTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


class FakeTemplate:
    tokenizer = FakeTokenizer()

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return [1, 2, 3]


@pytest.fixture(autouse=True)
def siblings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE))  # app.py imports openai_chat, as a replica does


def fake_llm() -> Any:
    llm = object.__new__(example_module("app").LLM.target)
    llm.engine, llm.eos, llm.chat = FakeEngine(), 0, FakeTemplate()
    llm._count = lambda: None
    return llm


def test_stream_closed_unread_takes_no_slot() -> None:
    llm = fake_llm()
    stream = llm.chat_completions(messages=[{"role": "user", "content": "hi"}], stream=True)
    stream.close()  # the caller left before the first chunk
    assert all(handle.cancelled for handle in llm.engine.handles)


def test_stream_read_then_closed_frees_its_slot() -> None:
    llm = fake_llm()
    stream = llm.chat_completions(messages=[{"role": "user", "content": "hi"}], stream=True)
    first = next(stream)
    assert first["choices"][0]["delta"]["role"] == "assistant"
    stream.close()
    assert len(llm.engine.handles) == 1 and llm.engine.handles[0].cancelled
