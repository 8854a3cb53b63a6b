"""What OpenAI's clients rely on, through the platform: a method with `stream_done=True`
ends its streams with `data: [DONE]` (Ember's own clients skip it), and an
ember.InputError may carry a 4xx status, a type, `param` and `code` into the error body."""

from __future__ import annotations

import textwrap

import pytest
from harness import Platform

import ember

APP = "wire"
SOURCE = textwrap.dedent(
    """
    import ember


    @ember.endpoint()
    class Api:
        @ember.method(path="v1/chat/completions", stream_flag="stream", stream_done=True)
        def chat(self, model: str = "m", stream: bool = False, count: int = 2):
            if model != "m":
                raise ember.InputError(
                    f"The model {model!r} does not exist",
                    status=404,
                    error_type="invalid_request_error",
                    param="model",
                    code="model_not_found",
                )
            if not stream:
                return {"n": count}
            return ({"n": n} for n in range(count))

        @ember.method
        def ticks(self, count: int = 2):
            yield from ({"n": n} for n in range(count))

        @ember.method
        def plain(self):
            raise ember.InputError("no good")
    """
)


@pytest.fixture(scope="module")
def deployed(platform: Platform, tmp_path_factory: pytest.TempPathFactory) -> Platform:
    source = tmp_path_factory.mktemp("wire") / "wire.py"
    source.write_text(SOURCE)
    assert f"{APP}--api" in platform.deploy(source, APP)
    return platform


def test_a_stream_done_method_ends_its_stream_with_done(deployed: Platform) -> None:
    with deployed.client() as client:
        answer = client.post(f"/{APP}--api/v1/chat/completions", json={"stream": True, "count": 3})
        plain = client.post(f"/{APP}--api/ticks", json={"count": 3})
    assert answer.status_code == 200
    assert answer.text.endswith("data: [DONE]\n\n"), answer.text
    events = [line for line in answer.text.splitlines() if line]
    assert events == ['data: {"n": 0}', 'data: {"n": 1}', 'data: {"n": 2}', "data: [DONE]"]
    assert plain.status_code == 200 and "[DONE]" not in plain.text  # only when asked


def test_embers_clients_skip_done(deployed: Platform) -> None:
    api = ember.Endpoint.lookup(APP, "api", config=deployed.config())
    assert list(api.chat.stream(stream=True, count=3)) == [{"n": 0}, {"n": 1}, {"n": 2}]
    result = deployed.ember("call", f"{APP}--api/chat", '{"stream": true, "count": 2}')
    assert "DONE" not in result.stdout and '"n": 1' in result.stdout


def test_an_input_error_carries_status_type_param_and_code(deployed: Platform) -> None:
    with deployed.client() as client:
        missing = client.post(f"/{APP}--api/v1/chat/completions", json={"model": "gpt-4o"})
        plain = client.post(f"/{APP}--api/plain", json={})
    assert missing.status_code == 404
    assert missing.json() == {
        "error": {
            "type": "invalid_request_error",
            "message": "The model 'gpt-4o' does not exist",
            "param": "model",
            "code": "model_not_found",
        }
    }
    # Without them, the error is Ember's as before: a 400, no param or code.
    assert plain.status_code == 400
    assert plain.json() == {"error": {"type": "invalid_input", "message": "no good"}}


def test_an_input_error_is_a_client_error_whatever_status_it_asks() -> None:
    assert ember.InputError("x", status=503).status == 400
    assert ember.InputError("x", status=422).status == 422
