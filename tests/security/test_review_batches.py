"""A review of OpenAI's Batch API (833f443; run at 18643ff) by hostile tenants against a
real `ember server` (root, outside every sandbox): workspace team-a holds a deploy token
and an app of its own that serves v1/chat/completions, and attacks workspace team-b's
endpoint of the same name, main's, and the control plane; each test is the tenant's
action and an outcome another tenant or the operator would see.

Found:

- a replica's answer of JSON nested past Python's recursion limit (a file result: its
  bytes reach the control plane as they are) makes `documents.answered_line` raise
  RecursionError while the batch's output file is made (`runner._result_lines`), and
  `BatchRunner.tick` stops at the first batch that raises: the tenant's batch stays
  `finalizing` for ever, and every batch created after it, of any workspace, is never
  fed a request (and the same again after a restart, which takes the batch up);
- a line of an input file nested 1,000 deep raises RecursionError out of msgspec's
  decoder, which `decode_batch_line` does not catch: batches.create is a 500
  "internal_error" and the file's other lines are lost, where the line should fail alone;
  a POST v1/batches body nested as deep is a 500 as well (`BatchApi._create` catches
  ValueError only);
- a multipart filename holding a line break is a 500 (`call_arguments._header_params`
  raises the email package's ValueError, which `_upload` does not catch);
- a part's head is parsed by the email package on the event loop, in time that grows
  faster than its size: one upload of a head with 60,000 parameters (480 KB; an
  upload may be 64 MiB) stops every workspace's calls for seconds;
- an input file is read whole into LineErrors before the request count is checked: a
  3 MiB file of bad lines (1.5 million) is a correct 400, after some 430 MiB of the
  control plane's memory (a 64 MiB file: some 9 GiB);
- every unfinished batch holds its whole parsed input file in memory (`Running.input`)
  and nothing bounds how many batches an endpoint or a workspace may have: one 8 MiB
  file submitted 40 times holds some 350 MiB until the batches end (up to 24 h);
- the output file is made from every request's result at once (each up to 64 MiB, up to
  50,000 of them), parsed and serialized again in the control plane's memory: 12
  results of 8 MiB grow it by 170-270 MiB;
- metadata values are unbounded (OpenAI takes 512 characters at most): a listing of 100
  batches is then up to 800 MiB parsed and re-serialized on the event loop;
- a batch running when its workspace is removed (`workspace rm --force`) is finished
  by its runner after the workspace's rows were deleted: its output file and its record
  are written again under the old label, so a workspace made later with the same name
  (another tenant, deploying an app of the same name) lists the old tenant's batch and
  metadata and reads its results; the old input file's bytes stay in the blob store
  for ever (rows only are deleted).

Each was mended after this review (bounded reads and lines, each batch's step apart, the
workspace's batches stopped and blobs deleted before its rows, output files written a
line at a time, metadata bounded, multipart heads bounded and checked): the tests that
failed then pass since.

Held: another workspace's deploy token, an invoke token of another app, and no token
(on a public endpoint too) reach no file or batch, by path or wildcard host, and a
batch request's call; a file or batch id is found only under the label it was made at
(another label of the same workspace, another workspace's, main's); a batch cannot take
another label's file; path tricks (`..`, encoded slashes and dots, NUL, very long ids,
extra segments) are 4xx and reach no blob nor file; malformed multipart bodies are
400s and lose nothing; path separators in a filename are a name only; lines with huge
numbers, Infinity, non-UTF-8 bytes, lone surrogates or extra fields fail alone; 50,000
tiny lines are taken and cancelled while another workspace is served; a replica's
results with line breaks, forged JSON lines or non-JSON bytes stay one line each; many
cancels at once, and a cancel after the end, change nothing twice.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import Platform, running_platform, wait_for
from machine_needs import need

APP = r"""
import time
from typing import Any

import ember


def answer(request: dict) -> Any:
    mode = request.get("mode", "echo")
    if mode == "deep":  # a file result: its bytes reach the control plane as they are
        return b"[" * 100_000 + b"]" * 100_000
    if mode == "big":
        return "x" * int(request["size"])
    if mode == "inject":
        forged = '"}}\n{"id": "forged", "custom_id": "forged", "response": null}\n'
        return {"text": forged, "crlf": "\r\n\u2028\u2029", "nul": "\u0000"}
    if mode == "raw":
        return b'\xff\xfe not json\n{"custom_id": "forged"}\r\n{"custom_id": "forged2"}\n'
    time.sleep(float(request.get("delay", 0)))
    text = request["messages"][-1]["content"]
    return {
        "object": "chat.completion",
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text.upper()},
            "finish_reason": "stop",
        }],
    }


@ember.endpoint(snapshot=False, concurrency=8, max_replicas=1, min_replicas=1, timeout=120)
class Chat:
    @ember.method(path="v1/chat/completions")
    def chat(self, **request: Any) -> Any:
        return answer(request)


@ember.endpoint(snapshot=False, concurrency=2, max_replicas=1, timeout=120)
class Hold:
    @ember.method(path="v1/chat/completions")
    def chat(self, **request: Any) -> Any:
        return answer(request)


@ember.endpoint(snapshot=False, public=True, max_replicas=1)
class Open:
    @ember.method(path="v1/chat/completions")
    def chat(self, **request: Any) -> Any:
        return answer(request)
"""
HOLD_ONLY = r"""
import time
from typing import Any

import ember


@ember.endpoint(snapshot=False, concurrency=2, max_replicas=1, timeout=120)
class Hold:
    @ember.method(path="v1/chat/completions")
    def chat(self, **request: Any) -> Any:
        time.sleep(float(request.get("delay", 0)))
        return {"choices": [{"message": {"content": request["messages"][-1]["content"]}}]}
"""
NAME = "bapp"
A_CHAT, A_HOLD, A_OPEN = (f"team-a--{NAME}--{e}" for e in ("chat", "hold", "open"))
B_CHAT = f"team-b--{NAME}--chat"
MAIN_CHAT = f"{NAME}--chat"
CHAT = "/v1/chat/completions"
MIB = 1024 * 1024


# ----- the platform and its tenants -------------------------------------------------
class Tenants:
    def __init__(self, platform: Platform, tokens: dict[str, str]) -> None:
        self.platform = platform
        self.tokens = tokens

    def client(self, who: str | None, timeout: float = 120) -> httpx.Client:
        """A client holding `who`'s token (None: no token at all)."""
        client = self.platform.client(timeout=timeout)
        if who is None:
            del client.headers["authorization"]
        else:
            client.headers["authorization"] = f"Bearer {self.tokens[who]}"
        return client


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    if os.geteuid() != 0:
        need("root", "replicas are sandboxed by a root worker, as in production")
    root = tmp_path_factory.mktemp("batch-review")
    with running_platform(root / "platform", extra=("--domain", "ember.localhost")) as running:
        yield running


@pytest.fixture(scope="module")
def tenants(platform: Platform, tmp_path_factory: pytest.TempPathFactory) -> Tenants:
    source = tmp_path_factory.mktemp("batch-app") / "app.py"
    source.write_text(APP)
    tokens = {"admin": platform.token}
    for workspace in ("team-a", "team-b"):
        platform.ember("workspace", "create", workspace)
        token = platform.ember(
            "token", "create", "--workspace", workspace, "--scope", "deploy"
        ).stdout.strip()
        done = platform.ember_as(token, "deploy", str(source), "--name", NAME, "--wait")
        assert done.returncode == 0, done.stdout + done.stderr
        tokens[workspace] = token
    platform.ember("deploy", str(source), "--name", NAME, "--wait")  # main's bapp too
    return Tenants(platform, tokens)


def line(custom_id: str, content: str = "hi", **extra: Any) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], **extra}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body})


def upload(
    client: httpx.Client, label: str, data: bytes, filename: str = "in.jsonl"
) -> httpx.Response:
    return client.post(
        f"/{label}/v1/files",
        data={"purpose": "batch"},
        files={"file": (filename, data, "application/jsonl")},
    )


def uploaded(client: httpx.Client, label: str, data: bytes) -> str:
    answer = upload(client, label, data)
    assert answer.status_code == 200, answer.text
    file_id: str = answer.json()["id"]
    return file_id


def create(
    client: httpx.Client, label: str, file_id: str, metadata: dict[str, str] | None = None
) -> httpx.Response:
    asked: dict[str, Any] = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
    if metadata is not None:
        asked["metadata"] = metadata
    return client.post(f"/{label}/v1/batches", json=asked)


def created(client: httpx.Client, label: str, file_id: str, **kw: Any) -> dict[str, Any]:
    answer = create(client, label, file_id, **kw)
    assert answer.status_code == 200, answer.text
    batch: dict[str, Any] = answer.json()
    return batch


def batch_of(client: httpx.Client, label: str, batch_id: str) -> dict[str, Any]:
    answer = client.get(f"/{label}/v1/batches/{batch_id}")
    assert answer.status_code == 200, answer.text
    batch: dict[str, Any] = answer.json()
    return batch


ENDED = ("completed", "failed", "cancelled", "expired")


def ended(client: httpx.Client, label: str, batch_id: str, timeout: float = 60) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        batch = batch_of(client, label, batch_id)
        return batch if batch["status"] in ENDED else None

    found: dict[str, Any] = wait_for(done, timeout, interval=0.1)
    return found


def lines_of(client: httpx.Client, label: str, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    answer = client.get(f"/{label}/v1/files/{file_id}/content")
    assert answer.status_code == 200, answer.text
    return [json.loads(text) for text in answer.content.split(b"\n") if text]


def online(client: httpx.Client, label: str) -> float:
    """Seconds an online call of `label` took (it must answer)."""
    started = time.monotonic()
    answer = client.post(f"/{label}{CHAT}", json={"messages": [{"content": "ping"}]})
    assert answer.status_code == 200, answer.text
    return time.monotonic() - started


def status_kib(platform: Platform, field: str) -> int:
    assert platform.process is not None
    for text in Path(f"/proc/{platform.process.pid}/status").read_text().splitlines():
        if text.startswith(field + ":"):
            return int(text.split()[1])
    raise AssertionError(field)


def reset_peak(platform: Platform) -> int:
    """The control plane's peak RSS set to its RSS now (Linux's clear_refs 5); its RSS."""
    assert platform.process is not None
    Path(f"/proc/{platform.process.pid}/clear_refs").write_text("5")
    return status_kib(platform, "VmRSS")


def multipart(head: bytes, data: bytes = b"{}") -> tuple[bytes, dict[str, str]]:
    """A form of a purpose field and one part with `head` as its headers."""
    body = (
        b'--XX\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b"--XX\r\n" + head + b"\r\n\r\n" + data + b"\r\n--XX--\r\n"
    )
    return body, {"content-type": "multipart/form-data; boundary=XX"}


# ----- who reaches what --------------------------------------------------------------
def test_another_workspaces_token_reaches_no_file_or_batch(tenants: Tenants) -> None:
    with tenants.client("team-a") as a, tenants.client("team-b") as b:
        file_id = uploaded(a, A_CHAT, f"{line('secret', 'a-secret')}\n".encode())
        batch = created(a, A_CHAT, file_id)
        done = ended(a, A_CHAT, batch["id"])
        call_id = lines_of(a, A_CHAT, done["output_file_id"])[0]["response"]["request_id"]
        for method, path in (
            ("GET", "v1/files"),
            ("POST", "v1/files"),
            ("GET", f"v1/files/{file_id}"),
            ("GET", f"v1/files/{file_id}/content"),
            ("DELETE", f"v1/files/{file_id}"),
            ("GET", f"v1/files/{done['output_file_id']}/content"),
            ("GET", "v1/batches"),
            ("POST", "v1/batches"),
            ("GET", f"v1/batches/{batch['id']}"),
            ("POST", f"v1/batches/{batch['id']}/cancel"),
        ):
            asked = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
            answer = b.request(method, f"/{A_CHAT}/{path}", json=asked)
            assert answer.status_code == 403, (method, path, answer.text)
            assert "a-secret" not in answer.text.lower()
        # The batch's request is a spawned call of team-a's: its id reads nothing.
        assert b.get(f"/v1/calls/{call_id}").status_code in (403, 404)
        # Nothing of team-a's changed.
        assert a.get(f"/{A_CHAT}/v1/files/{file_id}/content").text.startswith('{"custom_id"')
        assert batch_of(a, A_CHAT, batch["id"])["status"] == "completed"


def test_ids_are_found_only_under_the_label_they_were_made_at(tenants: Tenants) -> None:
    platform = tenants.platform
    with tenants.client("team-a") as a, tenants.client("team-b") as b:
        a_file = uploaded(a, A_CHAT, f"{line('one')}\n".encode())
        a_batch = created(a, A_CHAT, a_file)["id"]
        b_file = uploaded(b, B_CHAT, f"{line('bee')}\n".encode())
        open_file = uploaded(a, A_OPEN, f"{line('open')}\n".encode())
        # team-b's token at its own label, with team-a's ids: absent.
        for method, path in (
            ("GET", f"v1/files/{a_file}"),
            ("GET", f"v1/files/{a_file}/content"),
            ("DELETE", f"v1/files/{a_file}"),
            ("GET", f"v1/batches/{a_batch}"),
            ("POST", f"v1/batches/{a_batch}/cancel"),
        ):
            answer = b.request(method, f"/{B_CHAT}/{path}")
            assert answer.status_code == 404, (method, path, answer.text)
        assert create(b, B_CHAT, a_file).status_code == 404
        # team-a at its own label, with team-b's file, or its own file of another label.
        assert create(a, A_CHAT, b_file).status_code == 404
        assert create(a, A_CHAT, open_file).status_code == 404
        assert a.get(f"/{A_CHAT}/v1/files/{open_file}").status_code == 404
        assert a_file not in {f["id"] for f in a.get(f"/{A_OPEN}/v1/files").json()["data"]}
        # The wildcard host form: the same label, the same refusals.
        port = platform.url.rsplit(":", 1)[1]
        for token, label, file_id, status in (
            ("team-b", A_CHAT, a_file, 403),
            ("team-b", B_CHAT, a_file, 404),
            ("team-a", A_CHAT, b_file, 404),
            ("team-a", A_CHAT, a_file, 200),
        ):
            with tenants.client(token) as client:
                answer = client.get(
                    f"/v1/files/{file_id}/content",
                    headers={"host": f"{label}.ember.localhost:{port}"},
                )
            assert answer.status_code == status, (token, label, answer.text)
        assert b.get(f"/{B_CHAT}/v1/files/{b_file}").status_code == 200  # untouched


def test_other_apps_tokens_and_no_token_are_refused(tenants: Tenants) -> None:
    platform = tenants.platform
    other = platform.ember(
        "token", "create", "--workspace", "team-a", "--scope", "invoke", "--app", "other"
    ).stdout.strip()
    own = platform.ember(
        "token", "create", "--workspace", "team-a", "--scope", "invoke", "--app", NAME
    ).stdout.strip()
    tenants.tokens["a-other"], tenants.tokens["a-invoke"] = other, own
    with tenants.client("team-a") as a:
        file_id = uploaded(a, A_CHAT, f"{line('x')}\n".encode())
        open_file = uploaded(a, A_OPEN, f"{line('x')}\n".encode())
    with tenants.client("a-other") as stranger:
        for path in ("v1/files", f"v1/files/{file_id}", f"v1/files/{file_id}/content"):
            assert stranger.get(f"/{A_CHAT}/{path}").status_code == 403, path
        assert create(stranger, A_CHAT, file_id).status_code == 403
    with tenants.client("a-invoke") as caller:  # a token that may call the app may
        assert caller.get(f"/{A_CHAT}/v1/files/{file_id}").status_code == 200
    # A public endpoint's files are not public.
    with tenants.client(None) as anonymous, tenants.client("team-b") as b:
        for client, status in ((anonymous, 401), (b, 403)):
            for method, path in (
                ("GET", "v1/files"),
                ("GET", f"v1/files/{open_file}/content"),
                ("DELETE", f"v1/files/{open_file}"),
                ("GET", "v1/batches"),
            ):
                answer = client.request(method, f"/{A_OPEN}/{path}")
                assert answer.status_code == status, (method, path, answer.text)
            assert upload(client, A_OPEN, b"{}\n").status_code == status
            assert create(client, A_OPEN, open_file).status_code == status
    with tenants.client("team-a") as a:
        assert a.get(f"/{A_OPEN}/v1/files/{open_file}").status_code == 200


def test_mains_label_form_is_mains(tenants: Tenants) -> None:
    with tenants.client("admin") as admin, tenants.client("team-a") as a:
        main_file = uploaded(admin, MAIN_CHAT, f"{line('main', 'main-secret')}\n".encode())
        a_file = uploaded(a, A_CHAT, f"{line('a')}\n".encode())
        for path in ("v1/files", f"v1/files/{main_file}/content", f"v1/files/{a_file}"):
            answer = a.get(f"/{MAIN_CHAT}/{path}")
            assert answer.status_code in (403, 404), (path, answer.text)
            assert "main-secret" not in answer.text
        assert a.get(f"/{A_CHAT}/v1/files/{main_file}/content").status_code == 404
        assert create(a, A_CHAT, main_file).status_code == 404
        assert admin.get(f"/{MAIN_CHAT}/v1/files/{a_file}").status_code == 404


def test_path_tricks_reach_no_blob_or_file(tenants: Tenants) -> None:
    platform = tenants.platform
    with tenants.client("team-a") as a, tenants.client("team-b") as b:
        a_file = uploaded(a, A_CHAT, f"{line('mine')}\n".encode())
        b_file = uploaded(b, B_CHAT, f"{line('theirs', 'b-secret')}\n".encode())
        b_batch = created(b, B_CHAT, b_file)["id"]
    secrets = ("b-secret", platform.token, tenants.tokens["team-b"], "BEGIN")
    attempts = [
        f"/{A_CHAT}/v1/files/../../../admin-token",
        f"/{A_CHAT}/v1/files/..%2F..%2F..%2Fadmin-token/content",
        f"/{A_CHAT}/v1/files/%2e%2e%2f%2e%2e%2fca-key.pem/content",
        f"/{A_CHAT}/v1/files/..%2Fopenai-files%2F{b_file}/content",
        f"/{A_CHAT}/v1/files/openai-files%2F{b_file}/content",
        f"/{A_CHAT}/v1/files/{a_file}%2F..%2F{b_file}/content",
        f"/{A_CHAT}/v1/files/{a_file}/content/../../{b_file}/content",
        f"/{A_CHAT}/v1/files/{a_file}/../{b_file}/content",
        f"/{A_CHAT}/v1/files/{b_file}/content",
        f"/{A_CHAT}/v1/files/{b_file}%00/content",
        f"/{A_CHAT}/v1/files/file-%0a%0d%00%ff/content",
        f"/{A_CHAT}/v1/files/%25%2A%3F'%22;--/content",
        f"/{A_CHAT}/v1/files/{'f' * 6000}/content",
        f"/{A_CHAT}/v1/files/{a_file}/content/extra/segments",
        f"/{B_CHAT}/../{A_CHAT}/v1/files/{b_file}/content",
        f"/{A_CHAT}/../{B_CHAT}/v1/files/{b_file}/content",
        f"/{A_CHAT}/v1/batches/{b_batch}/cancel",
        f"/{A_CHAT}/v1/batches/..%2F{b_batch}",
    ]
    for path in attempts:
        for method in ("GET", "POST", "DELETE"):
            done = platform.curl(
                "--path-as-is",
                "-X",
                method,
                "-H",
                f"Authorization: Bearer {tenants.tokens['team-a']}",
                "-w",
                "\n%{http_code}",
                platform.url + path,
            )
            body, _, code = done.stdout.rpartition("\n")
            assert code.isdigit() and 400 <= int(code) < 500, (method, path, code, body)
            assert not any(secret in body for secret in secrets), (method, path, body)
    with tenants.client("team-b") as b:
        assert b.get(f"/{B_CHAT}/v1/files/{b_file}/content").status_code == 200
        assert batch_of(b, B_CHAT, b_batch)["status"] != "cancelled"


# ----- uploads -------------------------------------------------------------------------
def test_malformed_multipart_bodies_get_a_400_and_lose_nothing(tenants: Tenants) -> None:
    many_parts = b"".join(
        b'--XX\r\nContent-Disposition: form-data; name="f%d"\r\n\r\nx\r\n' % n for n in range(1001)
    )
    with tenants.client("team-a") as a:
        before = {f["id"] for f in a.get(f"/{A_CHAT}/v1/files").json()["data"]}
        for body, content_type in (
            (b"--XX\r\n", "multipart/form-data"),  # no boundary
            (b"nothing here", "multipart/form-data; boundary=XX"),
            (
                b"--XX\r\nContent-Disposition: form-data; name=file",
                "multipart/form-data; boundary=XX",
            ),
            (b"--XXgarbage", "multipart/form-data; boundary=XX"),
            (b"--XX\r\nno-disposition: x\r\n\r\nx\r\n--XX--", "multipart/form-data; boundary=XX"),
            (
                b'--XX\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n{}'
                b"\r\n--XX--",
                "multipart/form-data; boundary=XX",
            ),  # no purpose
            (many_parts + b"--XX--", "multipart/form-data; boundary=XX"),
            (b"", "multipart/form-data; boundary=XX"),
            (b"--\xff\r\n", "multipart/form-data; boundary*=utf-8''%C3%A9"),
        ):
            answer = a.post(
                f"/{A_CHAT}/v1/files", content=body, headers={"content-type": content_type}
            )
            assert answer.status_code == 400, (body[:60], answer.text)
        body, headers = multipart(b'Content-Disposition: form-data; name="other"')
        assert a.post(f"/{A_CHAT}/v1/files", content=body, headers=headers).status_code == 400
        assert {f["id"] for f in a.get(f"/{A_CHAT}/v1/files").json()["data"]} == before


def test_a_filename_with_a_line_break_gets_a_clear_error(tenants: Tenants) -> None:
    # Failed before its mend: the email package's ValueError ("Header values may not contain
    # linefeed or carriage return characters") from call_arguments._header_params
    # reaches the gateway's catch-all: a 500 "internal_error" and a traceback in the
    # root process's log. A fix answers 400 (or takes the name, the line break replaced).
    with tenants.client("team-a") as a:
        for name in (b"a\nb.jsonl", b"a\rb.jsonl"):
            head = b'Content-Disposition: form-data; name="file"; filename="' + name + b'"'
            body, headers = multipart(head, f"{line('n')}\n".encode())
            answer = a.post(f"/{A_CHAT}/v1/files", content=body, headers=headers)
            assert answer.status_code in (200, 400), (name, answer.status_code, answer.text)


def test_path_separators_in_a_filename_are_a_name_only(tenants: Tenants) -> None:
    platform = tenants.platform
    with tenants.client("team-a") as a:
        for name in ("../../../../tmp/ember-review-escape", "/etc/ember-review", "a/b\\c"):
            answer = upload(a, A_CHAT, b"written-by-a\n", filename=name)
            assert answer.status_code == 200, answer.text
            made = answer.json()
            assert made["id"].startswith("file-") and "/" not in made["id"]
            content = a.get(f"/{A_CHAT}/v1/files/{made['id']}/content")
            assert content.content == b"written-by-a\n"
    assert not Path("/tmp/ember-review-escape").exists()
    assert not Path("/etc/ember-review").exists()
    for path in platform.state_dir.rglob("*"):  # blobs are named by id only
        assert "ember-review" not in path.name, path


def test_a_part_head_of_many_parameters_stalls_no_other_workspace(tenants: Tenants) -> None:
    # Failed before its mend: form_fields parses each part's head with the email package, on the
    # control plane's event loop (BatchApi._upload calls it inline), in time that grows
    # faster than the head: 60,000 parameters (480 KB, where an upload may be
    # 64 MiB) hold the loop for seconds, and team-b's online call waits them out. A fix
    # bounds a part's head (a few KiB, as the gateway bounds a request's) and parses
    # the form off the loop.
    head = b'Content-Disposition: form-data; name="file"; ' + b'x="\\\\"; ' * 60_000
    body, headers = multipart(head + b'filename="a.jsonl"')
    with tenants.client("team-b") as b:
        online(b, B_CHAT)  # warm
        outcome: list[int] = []

        def send() -> None:
            with tenants.client("team-a", timeout=300) as a:
                outcome.append(
                    a.post(f"/{A_CHAT}/v1/files", content=body, headers=headers).status_code
                )

        sender = threading.Thread(target=send)
        sender.start()
        time.sleep(0.5)  # its body is in; its head is being parsed
        try:
            seconds = online(b, B_CHAT)
        finally:
            sender.join()
    assert outcome and outcome[0] in (200, 400, 413, 431), outcome
    assert seconds < 1.5, f"team-b's call waited {seconds:.1f} s for team-a's upload"


# ----- input files -----------------------------------------------------------------------
def test_odd_lines_fail_alone(tenants: Tenants) -> None:
    good = line("good")
    odd = [
        line("huge-int").replace('"m"', "1" + "0" * 5000).encode(),
        line("infinite").replace('"m"', "1e999").encode(),
        line("nan").replace('"m"', "NaN").encode(),
        line("bad-utf8").encode().replace(b'"hi"', b'"\xff\xfe\xc0"'),
        line("surrogate").replace('"hi"', '"\\ud800"').encode(),
        line("extra")[:-1].encode() + b', "extra": 1}',
        b'{"custom_id": 1, "method": "POST", "url": "/v1/chat/completions", "body": {}}',
        b'{"custom_id": "list", "method": "POST", "url": "/v1/chat/completions", "body": []}',
        b"\x00\x01\x02",
        b"[" * 500 + b"]" * 500,
    ]
    data = b"\n".join([good.encode(), *odd, (line("crlf") + "\r").encode()]) + b"\n\n\n"
    with tenants.client("team-a") as a:
        batch = created(a, A_CHAT, uploaded(a, A_CHAT, data))
        done = ended(a, A_CHAT, batch["id"])
        assert done["status"] == "completed", done
        counts = done["request_counts"]
        assert counts == {"total": 12, "completed": 2, "failed": 10}, counts
        output = lines_of(a, A_CHAT, done["output_file_id"])
        assert sorted(o["custom_id"] for o in output) == ["crlf", "good"]
        errors = lines_of(a, A_CHAT, done["error_file_id"])
        assert len(errors) == 10 and all(e["response"] is None for e in errors), errors


def test_a_deeply_nested_line_fails_alone(tenants: Tenants) -> None:
    # Failed before its mend: msgspec raises RecursionError at 1,000 levels, which
    # batch_lines.decode_batch_line does not catch (ValidationError, DecodeError only),
    # nor read_input_file, nor BatchApi._create (LookupError, ValueError): a 500
    # "internal_error", the good line lost with the rest. A fix makes the line fail
    # alone (invalid_json_line in the error file), as the other malformed lines do.
    deep = line("deep").replace('"hi"', "[" * 5000 + "]" * 5000)
    data = f"{line('good')}\n{deep}\n".encode()
    with tenants.client("team-a") as a:
        answer = create(a, A_CHAT, uploaded(a, A_CHAT, data))
        assert answer.status_code == 200, (answer.status_code, answer.text)
        done = ended(a, A_CHAT, answer.json()["id"])
        assert done["request_counts"] == {"total": 2, "completed": 1, "failed": 1}, done


def test_a_deeply_nested_batch_body_gets_a_400(tenants: Tenants) -> None:
    # Failed before its mend: BatchApi._create's json.loads raises RecursionError, and only
    # ValueError is caught: a 500. A fix answers 400 invalid_json, as call bodies get
    # (call_arguments._json_object catches RecursionError).
    with tenants.client("team-a") as a:
        answer = a.post(
            f"/{A_CHAT}/v1/batches",
            content=b"[" * 100_000 + b"]" * 100_000,
            headers={"content-type": "application/json"},
        )
    assert answer.status_code == 400, (answer.status_code, answer.text)


def test_metadata_is_bounded(tenants: Tenants) -> None:
    # Failed before its mend: BatchApi._create checks 16 string pairs, not their length. Each
    # batch's document then carries up to the body limit (8 MiB) of metadata, written
    # again at each of its changes, and GET v1/batches answers 100 of them: some
    # 800 MiB parsed and serialized again on the event loop per request. A fix refuses
    # keys over 64 characters and values over 512, as OpenAI does.
    with tenants.client("team-a") as a:
        file_id = uploaded(a, A_CHAT, f"{line('meta')}\n".encode())
        answer = create(a, A_CHAT, file_id, metadata={"note": "m" * MIB})
        assert answer.status_code == 400, (answer.status_code, len(answer.content))


def test_fifty_thousand_tiny_lines_are_taken_and_cancelled(tenants: Tenants) -> None:
    tiny = b'{"custom_id":"%d","method":"POST","url":"/v1/chat/completions","body":{}}'
    data = b"\n".join(tiny % n for n in range(50_000))
    with tenants.client("team-a") as a, tenants.client("team-b") as b:
        online(b, B_CHAT)
        file_id = uploaded(a, A_HOLD, data)
        answer: list[httpx.Response] = []
        making = threading.Thread(target=lambda: answer.append(create(a, A_HOLD, file_id)))
        making.start()
        seconds = max(online(b, B_CHAT) for _ in range(3))
        making.join()
        assert answer[0].status_code == 200, answer[0].text
        batch = answer[0].json()
        assert batch["request_counts"]["total"] == 50_000
        cancelled = a.post(f"/{A_HOLD}/v1/batches/{batch['id']}/cancel")
        assert cancelled.json()["status"] in ("cancelling", "cancelled")
        done = ended(a, A_HOLD, batch["id"], timeout=90)
        assert done["status"] == "cancelled", done
    assert seconds < 2, f"team-b's calls took {seconds:.1f} s meanwhile"


# ----- the control plane's memory: held first, small objects' peak last -------------
def test_unfinished_batches_are_held_in_bounded_memory(tenants: Tenants) -> None:
    # Failed before its mend: BatchRunner.create keeps each batch's parsed input (Running.input:
    # every request's body) in memory until the batch ends, up to 24 h, and nothing
    # bounds the number of unfinished batches of an endpoint or a workspace (only one is
    # fed at a time; the others wait, held). One 8 MiB file made into 40 batches holds
    # some 330 MiB of the control plane's memory; 1,000 batches of a 64 MiB file, 70 GiB.
    # A fix bounds unfinished batches per endpoint or workspace (a 429 past it), or
    # reads a batch's input again when it is fed rather than holding it.
    platform = tenants.platform
    filler = "f" * 1600
    data = "\n".join(line(f"r{n}", filler, delay=60) for n in range(5000)).encode()
    assert 7 * MIB < len(data) < 9 * MIB
    with tenants.client("team-a") as a:
        file_id = uploaded(a, A_HOLD, data)
        made = [created(a, A_HOLD, file_id)["id"]]  # its parse's garbage counted before
        before = status_kib(platform, "VmRSS")
        refused = 0
        for _ in range(39):
            answer = create(a, A_HOLD, file_id)
            if answer.status_code == 200:
                made.append(answer.json()["id"])
            else:
                assert answer.status_code in (400, 429), answer.text
                refused += 1
        grown = (status_kib(platform, "VmRSS") - before) // 1024
        for batch_id in made:
            a.post(f"/{A_HOLD}/v1/batches/{batch_id}/cancel")
    assert grown < 100, f"{len(made)} batches ({refused} refused) held {grown} MiB more"


def test_an_output_file_is_made_in_bounded_memory(tenants: Tenants) -> None:
    # Failed before its mend: BatchRunner._result_lines reads every request's result from its call
    # record at once (each up to 64 MiB, up to 50,000 of them), json.loads each, and
    # documents.jsonl serializes them all again before one blob put: 12 results of
    # 8 MiB grow the control plane by several times their 96 MiB. A fix writes the
    # output file a line at a time (blobs.put_chunks) and bounds a batch's output.
    platform = tenants.platform
    lines = [line(f"big-{n}", mode="big", size=8 * MIB) for n in range(12)]
    lines.append(line("last", delay=4))
    with tenants.client("team-a") as a:
        batch = created(a, A_CHAT, uploaded(a, A_CHAT, "\n".join(lines).encode()))
        wait_for(
            lambda: batch_of(a, A_CHAT, batch["id"])["request_counts"]["completed"] >= 12,
            60,
            interval=0.1,
        )
        before = reset_peak(platform)  # the results are in; "last" runs on
        done = ended(a, A_CHAT, batch["id"])
        grown = (status_kib(platform, "VmHWM") - before) // 1024
        assert done["status"] == "completed" and done["request_counts"]["completed"] == 13
    assert grown < 96, f"the control plane grew {grown} MiB making a 96 MiB output file"


def test_a_file_of_bad_lines_is_read_in_bounded_memory(tenants: Tenants) -> None:
    # Failed before its mend: read_input_file (batches/input_files.py) keeps a LineError, its
    # message included, for every line before BatchRunner.create compares the count
    # with --batch-max-requests. 3 MiB of "x\n" (1.5 million lines) is a correct 400
    # after some 430 MiB of the root process's memory; a 64 MiB upload, some 9 GiB. A
    # fix stops reading past the limit (max_requests + 1 lines) and keeps errors lean.
    platform = tenants.platform
    with tenants.client("team-a") as a:
        file_id = uploaded(a, A_CHAT, b"x\n" * (3 * MIB // 2))
        before = reset_peak(platform)
        answer = create(a, A_CHAT, file_id)
        grown = (status_kib(platform, "VmHWM") - before) // 1024
    assert answer.status_code == 400 and "at most" in answer.text, answer.text
    assert grown < 128, f"the control plane grew {grown} MiB to refuse a 3 MiB file"


# ----- what the tenant's replica answers ---------------------------------------------
def test_replica_results_cannot_forge_output_lines(tenants: Tenants) -> None:
    data = "\n".join(
        [line("inject", mode="inject"), line("raw", mode="raw"), line("plain")]
    ).encode()
    with tenants.client("team-a") as a:
        done = ended(a, A_CHAT, created(a, A_CHAT, uploaded(a, A_CHAT, data))["id"])
        assert done["status"] == "completed", done
        every = lines_of(a, A_CHAT, done["output_file_id"]) + lines_of(
            a, A_CHAT, done["error_file_id"]
        )
    assert sorted(o["custom_id"] for o in every) == ["inject", "plain", "raw"], every
    inject = next(o for o in every if o["custom_id"] == "inject")
    assert "forged" in inject["response"]["body"]["text"]  # inside its string, escaped


def test_cancels_at_once_and_after_the_end_change_nothing_twice(tenants: Tenants) -> None:
    lines = [line(f"c{n}", delay=1) for n in range(24)]
    with tenants.client("team-a") as a:
        batch = created(a, A_CHAT, uploaded(a, A_CHAT, "\n".join(lines).encode()))
        wait_for(lambda: batch_of(a, A_CHAT, batch["id"])["request_counts"]["completed"] >= 1, 60)
        answers: list[int] = []

        def cancel() -> None:
            with tenants.client("team-a") as own:
                answers.append(own.post(f"/{A_CHAT}/v1/batches/{batch['id']}/cancel").status_code)

        threads = [threading.Thread(target=cancel) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert answers == [200] * 8
        done = ended(a, A_CHAT, batch["id"])
        assert done["status"] == "cancelled", done
        counts = done["request_counts"]
        output = lines_of(a, A_CHAT, done["output_file_id"])
        assert counts["failed"] == 0 and len(output) == counts["completed"] < 24, counts
        again = a.post(f"/{A_CHAT}/v1/batches/{batch['id']}/cancel").json()
        assert again["status"] == "cancelled" and again["request_counts"] == counts
        finished = created(a, A_CHAT, uploaded(a, A_CHAT, f"{line('f')}\n".encode()))
        finished = ended(a, A_CHAT, finished["id"])
        late = a.post(f"/{A_CHAT}/v1/batches/{finished['id']}/cancel").json()
        assert late["status"] == "completed" and late["cancelled_at"] is None


# ----- a workspace removed -----------------------------------------------------------------
def test_a_removed_workspace_leaves_nothing_to_the_next_of_its_name(
    tenants: Tenants, tmp_path: Path
) -> None:
    # Failed before its mend: workspace rm --force deletes the openai_files and openai_batches rows
    # (credentials.delete_workspace), but a batch of its that runs is still in
    # BatchRunner._running: its request, running on a replica being drained, ends, and
    # the runner's next tick makes its output file under the old label
    # (_finish → files.add) and writes the batch again (_write → put_batch). A workspace
    # made later with the same name (another tenant, deploying an app of the same name)
    # lists the old tenant's batch, its metadata and its output file, and reads the old
    # tenant's results. The input file's bytes (blob openai-files/{id}) stay in the blob
    # store for ever too: rows only are deleted. A fix drops the workspace's batches
    # from the runner before its rows go, makes no file nor record for a label whose
    # workspace is gone, and deletes the workspace's blobs.
    platform = tenants.platform
    source = tmp_path / "app.py"
    source.write_text(HOLD_ONLY)
    label = f"team-c--{NAME}--hold"

    def tenant() -> None:
        platform.ember("workspace", "create", "team-c")
        token = platform.ember(
            "token", "create", "--workspace", "team-c", "--scope", "deploy"
        ).stdout.strip()
        done = platform.ember_as(token, "deploy", str(source), "--name", NAME)
        assert done.returncode == 0, done.stdout + done.stderr
        tenants.tokens["team-c"] = token

    def running() -> bool:
        with tenants.client("admin") as admin:
            apps = admin.get("/v1/apps", headers={"Ember-Workspace": "team-c"}).json()
        return any(e["label"] == label and e["running"] for e in apps["endpoints"])

    tenant()
    with tenants.client("team-c") as old:
        asked = line("old", "old-tenants-prompt", delay=2)
        file_id = uploaded(old, label, f"{asked}\n".encode())
        batch = created(old, label, file_id, metadata={"client": "old-tenants-secret"})
    wait_for(running, 60, interval=0.1)  # its request runs on the old tenant's replica
    platform.ember("workspace", "rm", "team-c", "--force")
    removed = time.monotonic()
    tenant()
    time.sleep(max(0.0, 4 - (time.monotonic() - removed)))  # the request ended meanwhile
    residues = []
    with tenants.client("team-c") as new:
        listed = new.get(f"/{label}/v1/batches").json()["data"]
        if listed:
            residues.append(f"v1/batches lists {[(b['id'], b['metadata']) for b in listed]}")
        found = new.get(f"/{label}/v1/batches/{batch['id']}")
        if found.status_code != 404:
            residues.append(f"v1/batches/{batch['id']} answers {found.json()['status']}")
        for file in new.get(f"/{label}/v1/files").json()["data"]:
            content = new.get(f"/{label}/v1/files/{file['id']}/content").text
            residues.append(f"v1/files lists {file['filename']}: {content[:200]}")
    blobs = [p.name for p in platform.state_dir.rglob(f"*{file_id}*") if p.is_file()]
    if blobs:
        residues.append(f"the old input file's bytes stay in the blob store: {blobs}")
    assert not residues, residues


# ----- last: it stops the runner for every later batch ---------------------------------
def test_a_result_nested_too_deep_stalls_no_other_workspaces_batch(tenants: Tenants) -> None:
    # Failed before its mend: the output file's lines parse each result (documents.answered_line's
    # json.loads catches ValueError, not RecursionError), run from BatchRunner._finish
    # inside tick(), which BatchRunner.run restarts at the oldest batch every tick: team-a's
    # batch stays `finalizing` for ever, and no batch created after it, of any
    # workspace, is fed a request (nor after a restart: take_up loads it again). A fix
    # keeps a result it cannot parse as text (catching RecursionError), and runs each
    # batch's step apart, so that one batch's failure fails that batch alone.
    # Kept last in this module: before its mend, the platform's runner stuck after it.
    with tenants.client("team-a") as a, tenants.client("team-b") as b:
        online(b, B_CHAT)
        poison = created(a, A_CHAT, uploaded(a, A_CHAT, f"{line('d', mode='deep')}\n".encode()))
        wait_for(lambda: batch_of(a, A_CHAT, poison["id"])["status"] in ("finalizing", *ENDED), 60)
        victim = created(b, B_CHAT, uploaded(b, B_CHAT, f"{line('victim')}\n".encode()))
        try:
            done = ended(b, B_CHAT, victim["id"], timeout=10)
        except AssertionError:
            stuck = batch_of(b, B_CHAT, victim["id"])
            poisoned = batch_of(a, A_CHAT, poison["id"])["status"]
            raise AssertionError(
                f"team-b's batch is still {stuck['status']} ({stuck['request_counts']}) "
                f"10 s on, behind team-a's, {poisoned}"
            ) from None
        assert done["status"] == "completed", done
        assert ended(a, A_CHAT, poison["id"], timeout=15)["status"] in ENDED
