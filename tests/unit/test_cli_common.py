"""Command-line keyword arguments given as JSON, and a server that is not there."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
from pathlib import Path

import pytest

import ember
from ember.calling.client import Endpoint, error_from_response
from ember.cli.common import duration, json_object, table
from ember.cli.main import main
from ember.config import ClientConfig
from ember.errors import InvalidError, RemoteError, ServerUnreachableError, UserCodeError


def test_a_json_object_is_returned() -> None:
    assert json_object('{"text": "hi", "n": 2}', "the arguments", "{}") == {"text": "hi", "n": 2}


@pytest.mark.parametrize(
    ("text", "message"),
    [("{oops", "--args must be JSON"), ("[1, 2]", "--args must be a JSON object, e.g. '{}'")],
)
def test_anything_else_is_a_clear_error(text: str, message: str) -> None:
    with pytest.raises(InvalidError) as info:
        json_object(text, "--args", "{}")
    assert str(info.value).startswith(message)


def test_a_server_that_is_not_running_is_named_in_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as sock:  # a port nothing listens on once this closes
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"https://127.0.0.1:{port}"
    endpoint = Endpoint("app--echo", ClientConfig(url, "emb_token"))
    with pytest.raises(ServerUnreachableError, match=f"cannot reach the Ember server at {url}"):
        endpoint.call(text="hi")
    with pytest.raises(ServerUnreachableError, match=f"cannot reach the Ember server at {url}"):
        asyncio.run(endpoint.acall(text="hi"))
    # The CLI says the same in one line, without a traceback.
    monkeypatch.setenv("EMBER_CONFIG", str(tmp_path / "no-config.json"))
    monkeypatch.delenv("EMBER_CA_CERT", raising=False)
    monkeypatch.setenv("EMBER_SERVER_URL", url)
    monkeypatch.setenv("EMBER_TOKEN", "emb_token")
    assert main(["ls"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ember: cannot reach the Ember server at {url}")
    assert "Traceback" not in err and "is `ember server` running there?" in err


def _body(error_type: str) -> bytes:
    return json.dumps({"error": {"type": error_type, "message": "m"}}).encode()


def test_platform_errors_are_told_apart_from_the_endpoints_own() -> None:
    raised = error_from_response(500, _body("ValueError"))
    assert isinstance(raised, UserCodeError) and raised.error_type == "ValueError"
    for error_type, status in [("result_too_large", 500), ("insufficient_storage", 507)]:
        raised = error_from_response(status, _body(error_type))
        assert type(raised) is RemoteError
        assert (raised.status, raised.error_type) == (status, error_type)
    # A 500 without a JSON error is a server's (or a proxy's) own page, not the code's.
    plain = error_from_response(500, b"Internal Server Error")
    assert type(plain) is RemoteError and plain.error_type == "http_error"
    # A cancelled call, and only that 499, is its own error.
    assert type(error_from_response(499, _body("cancelled"))) is ember.CallCancelledError
    assert type(error_from_response(499, _body("other"))) is RemoteError


def test_durations_read_as_seconds() -> None:
    assert [duration(t) for t in ("30s", "10m", "2h", "1d", "45")] == [30, 600, 7200, 86400, 45]
    for bad in ("soon", "-1m", "m", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            duration(bad)


def test_tables_line_up_wide_characters_and_escape_control_ones() -> None:
    shown = table([["模型", "a"], ["x\n\x1b[31mred", "b"]], ["NAME", "ID"])
    lines = shown.splitlines()
    assert lines == ["NAME            ID", "模型            a", "x\\n\\x1b[31mred  b"]
    assert "\x1b" not in shown
