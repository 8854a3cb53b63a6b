"""examples/llm/openai_chat.py: OpenAI chat requests checked, text decoded as tokens come,
stop sequences, and the chunks a stream is made of."""

from __future__ import annotations

import pytest
from llm_example import example_module

from ember import InputError

chat = example_module("openai_chat")


class ByteTokenizer:
    """Token id i is byte i, as byte-level BPE tokens can end mid-character."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def ids(text: str) -> list[int]:
    return list(text.encode())


MESSAGES = [{"role": "user", "content": "Hi"}]


def test_a_minimal_request_gets_the_defaults() -> None:
    request = chat.parse_chat_request({"messages": MESSAGES})
    assert request.messages == MESSAGES
    assert (request.max_tokens, request.stream, request.include_usage) == (None, False, False)
    assert (request.temperature, request.top_p, request.seed, request.stop) == (1.0, 1.0, None, ())


def test_a_full_request() -> None:
    request = chat.parse_chat_request(
        {
            "model": "smollm2",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            "max_completion_tokens": 5,
            "max_tokens": 9,  # the older name loses to the newer one
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
            "top_p": 0.5,
            "seed": 7,
            "stop": "\n\n",
            "n": 1,
            "presence_penalty": 0.0,
            "tools": [],
            "tool_choice": "none",
            "logprobs": False,
            "logit_bias": {},
            "user": "someone",  # fields without effect here are accepted
        }
    )
    assert request.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "ab"},
    ]
    assert (request.model, request.max_tokens, request.stream, request.include_usage) == (
        "smollm2",
        5,
        True,
        True,
    )
    assert (request.temperature, request.top_p, request.seed, request.stop) == (
        0.0,
        0.5,
        7,
        ("\n\n",),
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"messages": []}, "non-empty list"),
        ({"messages": "hi"}, "non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, r"messages\[0\].role"),
        ({"messages": [{"role": "user"}]}, r"messages\[0\].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text"),
        ({"max_tokens": 0}, "at least 1"),
        ({"max_tokens": True}, "must be int"),
        ({"temperature": 3}, r"temperature must be in \[0.0, 2.0\]"),
        ({"temperature": "hot"}, "must be a number"),
        ({"top_p": 0}, r"top_p must be in \(0.0, 1.0\]"),
        ({"stream": "yes"}, "stream must be bool"),
        ({"stream_options": {"include_usage": True}}, "only allowed when stream is true"),
        (
            {"stream": True, "stream_options": {"include_usage": "yes"}},
            "include_usage must be bool",
        ),
        ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
        ({"stop": [""]}, "non-empty string"),
        ({"n": 2}, "n=2 is not supported"),
        ({"tools": [{"type": "function"}]}, "tools=.* is not supported"),
        ({"logprobs": True}, "logprobs=True is not supported"),
        ({"n": True}, "n=True is not supported"),
        ({"tool_choice": "auto"}, "tool_choice='auto' is not supported"),
        ({"frequency_penalty": 0.5}, "frequency_penalty=0.5 is not supported"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_bad_requests_say_what_is_wrong(fields: dict, message: str) -> None:
    with pytest.raises(InputError, match=message):
        chat.parse_chat_request({"messages": MESSAGES, **fields})


def test_text_waits_for_the_rest_of_a_character() -> None:
    stream = chat.TextStream(ByteTokenizer())
    snowman = ids("☃")  # three bytes
    assert [stream.push(b) for b in ids("a") + snowman] == ["a", "", "", "☃"]
    assert stream.finish() == ""
    assert stream.text == "a☃"


def test_a_stop_sequence_ends_the_text_before_it() -> None:
    stream = chat.TextStream(ByteTokenizer(), stops=["END", "\n\n"])
    out = [stream.push(b) for b in ids("abEN")]
    assert out == ["a", "b", "", ""]  # "EN" might begin "END": held back
    assert stream.push(ids("D")[0]) == ""
    assert stream.stopped and stream.text == "ab"
    assert stream.push(ids("x")[0]) == "" and stream.finish() == ""


def test_held_back_text_that_was_no_stop_comes_out() -> None:
    stream = chat.TextStream(ByteTokenizer(), stops=["END"])
    out = [stream.push(b) for b in ids("aENx")]
    assert out == ["a", "", "", "ENx"]
    stream.push(ids("E")[0])
    assert stream.finish() == "E" and stream.text == "aENxE" and not stream.stopped


def test_pieces_end_on_the_stop_token_with_its_reason() -> None:
    eos = 0
    stream = chat.TextStream(ByteTokenizer())
    got = list(chat.pieces([*ids("hi"), eos, *ids("ignored")], stream, frozenset({eos})))
    assert [(p.text, p.ids, p.finish_reason) for p in got] == [
        ("h", ids("h"), None),
        ("i", ids("i"), None),
        ("", [], "stop"),
    ]
    stream = chat.TextStream(ByteTokenizer())
    *_, last = chat.pieces(ids("abc"), stream, frozenset({eos}))
    assert last.finish_reason == "length" and stream.text == "abc"


def test_chunks_carry_role_first_finish_reason_last_and_usage_when_asked() -> None:
    request = chat.parse_chat_request(
        {
            "messages": MESSAGES,
            "model": "m",
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    stream = chat.TextStream(ByteTokenizer(), stops=["!"])
    prompt = [5, 6, 7]
    decoded = chat.pieces(ids("ok!more"), stream, frozenset())
    got = list(chat.chunks(request, prompt, decoded, stream))
    deltas = [c["choices"][0]["delta"] for c in got[:-1]]
    assert deltas == [{"role": "assistant", "content": "o"}, {"content": "k"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in got[:-1]] == [None, None, "stop"]
    assert got[0]["prompt_token_ids"] == prompt and "prompt_token_ids" not in got[1]
    assert [i for c in got for i in c.get("token_ids", [])] == ids("ok!")
    assert {c["id"] for c in got} == {got[0]["id"]} and got[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "m" for c in got)
    assert got[-1]["choices"] == []
    assert got[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_a_whole_completion() -> None:
    request = chat.parse_chat_request({"messages": MESSAGES, "model": "m"})
    stream = chat.TextStream(ByteTokenizer())
    *_, last = chat.pieces(ids("yes"), stream, frozenset())
    body = chat.completion(request, [1, 2], stream, last.finish_reason)
    assert body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "yes"},
            "finish_reason": "length",
            "logprobs": None,
        }
    ]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert body["prompt_token_ids"] == [1, 2] and body["token_ids"] == ids("yes")


def test_completion_tokens_count_the_end_of_turn_token() -> None:
    eos = 0
    request = chat.parse_chat_request({"messages": MESSAGES, "model": "m"})
    stream = chat.TextStream(ByteTokenizer())
    *_, last = chat.pieces([*ids("yes"), eos], stream, frozenset({eos}))
    body = chat.completion(request, [1, 2], stream, last.finish_reason)
    # As vLLM counts (its output token ids end with the end-of-turn token): 3 + 1.
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    assert body["token_ids"] == ids("yes")  # the text's own tokens


def test_an_unknown_model_is_a_404_in_openais_shape() -> None:
    chat.check_model("smollm2", ("smollm2-135m-instruct", "smollm2"))
    chat.check_model("", ("smollm2-135m-instruct",))  # none named: the one served
    with pytest.raises(InputError) as missing:
        chat.check_model("gpt-4o", ("smollm2-135m-instruct",))
    error = missing.value
    assert (error.status, error.error_type, error.param, error.code) == (
        404,
        "invalid_request_error",
        "model",
        "model_not_found",
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"messages": MESSAGES, "temperature": 3}, "temperature"),
        ({"messages": MESSAGES, "n": 2}, "n"),
        ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        ({"messages": MESSAGES, "stop": 5}, "stop"),
    ],
)
def test_errors_name_the_field_at_fault(fields: dict, param: str) -> None:
    with pytest.raises(InputError) as refused:
        chat.parse_chat_request(fields)
    assert (refused.value.status, refused.value.param) == (400, param)
    assert refused.value.error_type == "invalid_request_error"
