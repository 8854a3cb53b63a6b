"""Where the CLI writes results (-o PATH, opened before a call is sent) and what it reads
arguments from: paths that cannot be written and bytes that are not text are clear
errors, not tracebacks after the call ran."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest

from ember.cli.calling.call import argument_text, write_stream
from ember.cli.common import output_file, write_result
from ember.cli.main import build_parser, main
from ember.errors import InvalidError


@pytest.mark.parametrize("where", ["missing/out.bin", "."])
def test_an_output_that_cannot_be_opened_fails_before_anything_is_sent(
    tmp_path: Path, where: str
) -> None:
    target = tmp_path / where
    with pytest.raises(InvalidError, match=f"cannot write {target}: "), output_file(target):
        raise AssertionError("the command went on")


def test_ember_call_checks_its_output_before_it_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # No server is configured at all: the output's error comes first.
    monkeypatch.setenv("EMBER_CONFIG", str(tmp_path / "no-config.json"))
    monkeypatch.setenv("EMBER_SERVER_URL", "https://127.0.0.1:1")
    monkeypatch.setenv("EMBER_TOKEN", "emb_token")
    monkeypatch.delenv("EMBER_CA_CERT", raising=False)
    for stream in ([], ["--stream"]):
        assert main(["call", "app--echo", *stream, "-o", str(tmp_path / "no/such/dir")]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"ember: cannot write {tmp_path}/no/such/dir: No such file")
        assert "Traceback" not in err


def test_a_result_replaces_the_file_and_a_failure_leaves_it_alone(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    target.write_bytes(b"an older and much longer result\n")
    with pytest.raises(RuntimeError), output_file(target):
        raise RuntimeError("the call failed")
    assert target.read_bytes() == b"an older and much longer result\n"
    with output_file(target) as output:
        write_result({"ok": True}, output)
    assert target.read_bytes() == b'{"ok": true}\n'


def test_a_file_made_for_a_call_that_failed_is_removed(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    with pytest.raises(RuntimeError), output_file(target):
        raise RuntimeError("the call failed")
    assert not target.exists()


def test_a_stream_cut_short_keeps_what_came(tmp_path: Path) -> None:
    def chunks() -> Iterator[bytes]:
        yield b"abc"
        raise RuntimeError("cut short")

    target = tmp_path / "out.bin"
    target.write_bytes(b"0123456789")
    with pytest.raises(RuntimeError), output_file(target) as output:
        write_stream(chunks(), output)
    assert target.read_bytes() == b"abc"


@pytest.mark.parametrize("source", ["file", "stdin"])
def test_arguments_that_are_not_utf8_are_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    data = b'{"text": "\xff\xfe"}'
    if source == "file":
        (tmp_path / "args.json").write_bytes(data)
        given = f"@{tmp_path / 'args.json'}"
    else:
        stdin = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="strict")
        monkeypatch.setattr("sys.stdin", stdin)
        given = "-"
    with pytest.raises(InvalidError, match=r"are not UTF-8 text.*-f NAME=PATH"):
        argument_text(given)


@pytest.mark.parametrize("text", ["70000", "-1", "http", "65536"])
def test_a_port_out_of_range_is_a_usage_error(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["server", "--port", text])
    assert info.value.code == 2
    assert f"argument --port: {text!r} is not a port number" in capsys.readouterr().err
    for port in (0, 65535):
        assert build_parser().parse_args(["server", "--port", str(port)]).port == port
