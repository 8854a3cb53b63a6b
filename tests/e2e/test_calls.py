"""Calls over HTTPS through the whole platform: results, errors, streams, URL forms."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import httpx
import pytest
from harness import EMBER, Platform, wait_for

import ember

APP = "basic"


@pytest.fixture(scope="module")
def deployed(platform: Platform, apps_dir: Path) -> dict[str, str]:
    return platform.deploy(apps_dir / "basic.py", APP)


def test_deploy_prints_one_url_per_endpoint(platform: Platform, deployed: dict[str, str]) -> None:
    assert set(deployed) == {
        f"{APP}--{name}"
        for name in (
            "echo",
            "boom",
            "sleepy",
            "numbers",
            "open-echo",
            "needs-gpu",
            "bad-return",
            "sized",
            "model",
            "forever",
            "shell-out",
        )
    }
    # With --domain the wildcard form comes first.
    assert (
        deployed[f"{APP}--echo"]
        == f"https://{APP}--echo.ember.localhost:{platform.url.rsplit(':', 1)[1]}/"
    )


def test_sdk_call(platform: Platform, deployed: dict[str, str]) -> None:
    echo = ember.Endpoint.lookup(APP, "echo", config=platform.config())
    assert echo.call(text="ab", times=3)["text"] == "ababab"


def test_curl_call_with_ca_and_token(platform: Platform, deployed: dict[str, str]) -> None:
    result = platform.curl(
        "-H",
        f"Authorization: Bearer {platform.token}",
        "-d",
        '{"text": "hi"}',
        f"{platform.url}/{APP}--echo/",
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["text"] == "hi"


def test_wildcard_domain_url(platform: Platform, deployed: dict[str, str]) -> None:
    port = platform.url.rsplit(":", 1)[1]
    host = f"{APP}--echo.ember.localhost"
    result = platform.curl(
        "--resolve",
        f"{host}:{port}:127.0.0.1",
        "-H",
        f"Authorization: Bearer {platform.token}",
        "-d",
        '{"text": "w"}',
        f"https://{host}:{port}/",
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["text"] == "w"


def test_class_endpoint_methods(platform: Platform, deployed: dict[str, str]) -> None:
    model = ember.Endpoint.lookup(APP, "model", config=platform.config())
    assert model.scale.call(x=2) == {"y": 6}
    assert model.method("info").call() == {"factor": 3, "ready": True}
    assert list(model.tokens.stream(n=4)) == [{"token": i} for i in range(4)]


def test_method_path_and_per_call_streaming(platform: Platform, deployed: dict[str, str]) -> None:
    model = ember.Endpoint.lookup(APP, "model", config=platform.config())
    with platform.client(timeout=30) as client:
        for path in ("v1/count", "count", "v2/count", "count_async"):
            url = f"/{APP}--model/{path}"
            plain = client.post(url, json={"n": 2})
            assert plain.status_code == 200, plain.text
            assert plain.json() == {"total": 2}
            streamed = client.post(url, json={"n": 3, "stream": True})
            assert streamed.headers["content-type"] == "text/event-stream"
            assert [json.loads(line[6:]) for line in streamed.text.splitlines() if line] == [
                {"i": i} for i in range(3)
            ]
        # An iterator for a call that did not ask to stream is the method's bug, said so.
        lied = client.post(f"/{APP}--model/v2/count", json={"lie": True})
        assert lied.status_code == 500
        assert "did not ask to stream" in lied.json()["error"]["message"]
        for stream in (False, True):  # the caller's mistake: 400, said before any event
            rejected = client.post(f"/{APP}--model/v1/count", json={"n": -1, "stream": stream})
            assert rejected.status_code == 400
            assert rejected.json()["error"] == {
                "type": "invalid_input",
                "message": "n must be 0 or more, not -1",
            }
        missing = client.post(f"/{APP}--model/v1/nothing", json={})
        assert missing.status_code == 404
        assert "v1/nothing" in missing.json()["error"]["message"]
    assert list(model.count.stream(n=2, stream=True)) == [{"i": 0}, {"i": 1}]
    assert model.count.call(n=5) == {"total": 5}


def test_generator_streams_server_sent_events(platform: Platform, deployed: dict[str, str]) -> None:
    result = platform.curl(
        "-N",
        "-H",
        f"Authorization: Bearer {platform.token}",
        "-d",
        '{"to": 4, "delay": 0.05}',
        "-D",
        "-",
        f"{platform.url}/{APP}--numbers/",
    )
    assert "content-type: text/event-stream" in result.stdout.lower()
    events = [
        json.loads(line[6:]) for line in result.stdout.splitlines() if line.startswith("data: ")
    ]
    assert events == [{"n": n} for n in range(4)]
    numbers = ember.Endpoint.lookup(APP, "numbers", config=platform.config())
    assert [item["n"] for item in numbers.stream(to=5)] == list(range(5))
    # Called whole, a generator's result is the list it yielded.
    assert numbers.call(to=3) == [{"n": 0}, {"n": 1}, {"n": 2}]
    # Its error midway has the status it would have had before the first item.
    items = []
    with pytest.raises(ember.RemoteError) as caught:
        for item in numbers.stream(to=5, refuse_at=2):
            items.append(item)
    assert items == [{"n": 0}, {"n": 1}]
    assert (caught.value.status, caught.value.error_type) == (400, "invalid_input")
    with pytest.raises(ember.RemoteError, match="2 is not for counting") as whole:
        numbers.call(to=5, refuse_at=2)
    assert whole.value.status == 400
    # A method that answers one value streams it as one item.
    echo = ember.Endpoint.lookup(APP, "open-echo", config=platform.config())
    assert list(echo.stream(text="once")) == [{"text": "once"}]


def test_public_endpoint_needs_no_token(platform: Platform, deployed: dict[str, str]) -> None:
    result = platform.curl("-d", '{"text": "open"}', f"{platform.url}/{APP}--open-echo/")
    assert json.loads(result.stdout) == {"text": "open"}


def test_the_codes_own_subprocesses_run_no_python_before_their_exec(
    platform: Platform, deployed: dict[str, str]
) -> None:
    """The replica's uvloop starts asyncio subprocesses as asyncio's own loop does: beside
    torch's threads, a child running Python at the fork can hang for ever on a lock."""
    shell_out = ember.Endpoint.lookup(APP, "shell-out", config=platform.config())
    assert shell_out.call(word="hello") == {
        "out": "hello\n",
        "status": 0,
        "loop": "ForkSafeLoop",
        "python_in_child": False,
    }


def _error(response) -> tuple[int, str, str]:
    detail = response.json()["error"]
    return response.status_code, detail["type"], detail["message"]


def test_bad_input_gets_400(platform: Platform, deployed: dict[str, str]) -> None:
    with platform.client() as client:
        status, kind, _ = _error(client.post(f"/{APP}--echo/", content=b"{not json"))
        assert (status, kind) == (400, "invalid_json")
        utf16 = '{"text": "x"}'.encode("utf-16")
        status, kind, _ = _error(client.post(f"/{APP}--echo/", content=utf16))
        assert (status, kind) == (400, "invalid_json")
        status, kind, _ = _error(client.post(f"/{APP}--echo/", content=b"[1, 2]"))
        assert (status, kind) == (400, "invalid_arguments")
        status, kind, message = _error(
            client.post(f"/{APP}--echo/", json={"text": "x", "wrong": 1})
        )
        assert (status, kind) == (400, "invalid_arguments")
        assert "wrong" in message
        # The arguments' types are checked against the code's hints before it runs.
        status, kind, message = _error(
            client.post(f"/{APP}--echo/", json={"text": "x", "times": "3"})
        )
        assert (status, kind) == (400, "invalid_arguments")
        assert message == "echo(): times: expected int, got str '3'"
        status, kind, message = _error(client.post(f"/{APP}--model/scale", json={"x": [1]}))
        assert (status, kind, message) == (
            400,
            "invalid_arguments",
            "scale(): x: expected float, got list [1]",
        )


def test_auth_errors(platform: Platform, deployed: dict[str, str]) -> None:
    with platform.client() as client:
        response = client.post(f"/{APP}--echo/", json={"text": "x"}, headers={"Authorization": ""})
        assert _error(response)[:2] == (401, "unauthorized")
        response = client.post(
            f"/{APP}--echo/", json={"text": "x"}, headers={"Authorization": "Bearer emb_wrong"}
        )
        assert _error(response)[:2] == (401, "unauthorized")
    worker_token = platform.ember("token", "create", "--scope", "worker").stdout.strip()
    with platform.client(token=worker_token) as client:
        assert _error(client.post(f"/{APP}--echo/", json={"text": "x"}))[:2] == (403, "forbidden")
    invoke_token = platform.ember("token", "create").stdout.strip()
    with platform.client(token=invoke_token) as client:
        assert client.post(f"/{APP}--echo/", json={"text": "x"}).status_code == 200
        assert _error(client.get("/v1/apps"))[:2] == (403, "forbidden")


def test_unknown_endpoint_and_method_get_404(platform: Platform, deployed: dict[str, str]) -> None:
    with platform.client() as client:
        assert _error(client.post(f"/{APP}--nope/", json={}))[:2] == (404, "not_found")
        status, _, message = _error(client.post(f"/{APP}--model/nope", json={}))
        assert status == 404 and "scale" in message
        assert _error(client.post("/not-a-label/", json={}))[0] == 404
    with pytest.raises(ember.NotFoundError):
        ember.Endpoint.lookup(APP, "missing", config=platform.config())


def test_oversized_body_gets_413(platform: Platform, deployed: dict[str, str]) -> None:
    big = b'{"text": "' + b"x" * (9 * 1024 * 1024) + b'"}'
    with platform.client() as client:
        assert _error(client.post(f"/{APP}--echo/", content=big))[:2] == (413, "payload_too_large")
        # The platform is still fine afterwards.
        assert client.post(f"/{APP}--echo/", json={"text": "ok"}).status_code == 200


def test_large_results_pass_and_too_large_ones_get_a_clear_500(
    platform: Platform, deployed: dict[str, str]
) -> None:
    with platform.client(timeout=120) as client:
        response = client.post(f"/{APP}--sized/", json={"mib": 20})  # over a WebSocket's 16
        assert response.status_code == 200
        first = response.json()
        assert len(first["text"]) == 20 * 1024 * 1024
        status, kind, message = _error(client.post(f"/{APP}--sized/", json={"mib": 65}))
        assert (status, kind) == (500, "result_too_large")
        assert "over the limit of 64 MiB" in message
        # Not retried, and the replica lives on.
        after = client.post(f"/{APP}--sized/", json={"mib": 0}).json()
        assert after["pid"] == first["pid"] and after["runs"] == first["runs"] + 2


def test_user_exception_gets_500_with_type_and_message(
    platform: Platform, deployed: dict[str, str]
) -> None:
    with platform.client() as client:
        assert _error(client.post(f"/{APP}--boom/", json={"message": "bad things"})) == (
            500,
            "ValueError",
            "bad things",
        )
        status, kind, message = _error(client.post(f"/{APP}--bad-return/", json={}))
        assert (status, kind) == (500, "TypeError") and "JSON" in message
        status, kind, message = _error(client.post(f"/{APP}--bad-return/", json={"nan": True}))
        assert (status, kind) == (500, "TypeError") and "NaN or Infinity" in message
        # Nor does NaN come in: the body is not JSON.
        answer = client.post(f"/{APP}--bad-return/", content=b'{"nan": NaN}')
        assert answer.status_code == 400 and "NaN is not a JSON number" in answer.text
        # A query string's arguments join the body's; an empty one is an empty string.
        echo = client.post(f"/{APP}--echo/?times=3", json={"text": "ab"}).json()
        assert echo["text"] == "ababab", echo
        assert client.get(f"/{APP}--echo/?text=&times=2").json()["text"] == ""
    boom = ember.Endpoint.lookup(APP, "boom", config=platform.config())
    with pytest.raises(ember.UserCodeError) as raised:
        boom.call(message="sdk")
    assert raised.value.error_type == "ValueError" and raised.value.message == "sdk"
    # The traceback went to the logs.
    logs = wait_for(
        lambda: (
            (out := platform.ember("logs", f"{APP}/boom").stdout) and "Traceback" in out and out
        ),
        10,
    )
    assert "ValueError: bad things" in logs


def test_gpu_nobody_has_gets_503(platform: Platform, deployed: dict[str, str]) -> None:
    with platform.client() as client:
        status, kind, message = _error(client.post(f"/{APP}--needs-gpu/", json={}))
    assert (status, kind) == (503, "no_capacity")
    assert "H100" in message


def test_timeout_gets_504_and_the_endpoint_recovers(
    platform: Platform, deployed: dict[str, str]
) -> None:
    with platform.client() as client:
        status, kind, _ = _error(client.post(f"/{APP}--sleepy/", json={"seconds": 5}))
        assert (status, kind) == (504, "timeout")
        assert client.post(f"/{APP}--sleepy/", json={"seconds": 0.01}).json() == {"slept": 0.01}


def test_map_gives_results_in_input_order_with_errors_in_their_places(
    platform: Platform, deployed: dict[str, str]
) -> None:
    echo = ember.Endpoint.lookup(APP, "echo", config=platform.config())
    texts = [f"t{i}" for i in range(40)]
    results = echo.map(({"text": t, "times": 2} for t in texts), concurrency=8)
    assert [r["text"] for r in results] == [t * 2 for t in texts]
    # A generator method's result is the list of what it yielded.
    numbers = ember.Endpoint.lookup(APP, "numbers", config=platform.config())
    assert list(numbers.map([{"to": 2}, {"to": 3}])) == [
        [{"n": 0}, {"n": 1}],
        [{"n": 0}, {"n": 1}, {"n": 2}],
    ]
    boom = ember.Endpoint.lookup(APP, "boom", config=platform.config())
    with pytest.raises(ember.UserCodeError, match="first") as caught:
        list(boom.map([{"message": "first"}, {"message": "second"}], concurrency=1))
    assert "(input 0 of the map)" in caught.value.__notes__
    kept = list(boom.map([{"message": "a"}, {"message": "b"}], return_exceptions=True))
    assert [(e.error_type, e.message) for e in kept] == [("ValueError", "a"), ("ValueError", "b")]


def test_map_from_the_shell_writes_a_json_line_per_input(
    platform: Platform, deployed: dict[str, str], tmp_path: Path
) -> None:
    inputs = tmp_path / "inputs.jsonl"
    inputs.write_text("".join(json.dumps({"seconds": s}) + "\n" for s in (0.01, 3, 0.02)))
    result = platform.ember("map", f"{APP}--sleepy", str(inputs), "-c", "3", check=False)
    assert result.returncode == 1, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines[0] == {"index": 0, "result": {"slept": 0.01}}
    assert lines[1]["index"] == 1 and lines[1]["error"]["type"] == "timeout"
    assert lines[2] == {"index": 2, "result": {"slept": 0.02}}
    assert "3 inputs, 2 done, 1 failed" in result.stderr
    # --unordered names each line's input; -o writes a file; stdin works as '-'.
    out = tmp_path / "out.jsonl"
    piped = subprocess.run(
        [*EMBER, "map", f"{APP}--model/scale", "-", "--unordered", "-o", str(out)],
        input='{"x": 1}\n{"x": 2}\n\n{"x": 3}\n',
        env=platform.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert piped.returncode == 0, piped.stderr
    written = sorted(
        (json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["index"]
    )
    assert written == [{"index": i, "result": {"y": 3 * (i + 1)}} for i in range(3)]
    # Bad lines are all named, and nothing is sent.
    inputs.write_text('{"seconds": 0.01}\n[1]\n{oops\n')
    refused = platform.ember("map", f"{APP}--sleepy", str(inputs), check=False)
    assert refused.returncode == 1
    assert "line 2" in refused.stderr and "line 3" in refused.stderr
    assert "Nothing was sent" in refused.stderr and refused.stdout == ""
    inputs.write_text('{"seconds": 0.01}\n')
    unknown = platform.ember("map", f"{APP}--nobody", str(inputs), check=False)
    assert unknown.returncode == 1 and "not_found" in unknown.stderr


def test_the_asyncio_client_calls_streams_spawns_and_cancels(
    platform: Platform, deployed: dict[str, str]
) -> None:
    echo = ember.Endpoint.lookup(APP, "echo", config=platform.config())
    model = ember.Endpoint.lookup(APP, "model", config=platform.config())
    boom = ember.Endpoint.lookup(APP, "boom", config=platform.config())

    async def scenario() -> None:
        answers = await asyncio.gather(*(echo.acall(text=str(i)) for i in range(5)))
        assert [a["text"] for a in answers] == [str(i) for i in range(5)]
        items = [item async for item in model.tokens.astream(n=4)]
        assert items == [{"token": i} for i in range(4)]
        handle = await echo.aspawn(text="later")
        assert (await handle.aget(timeout=30))["text"] == "later"
        with pytest.raises(ember.UserCodeError, match="async boom"):
            await boom.acall(message="async boom")
        slow = await model.patient.aspawn(seconds=30)
        await slow.acancel()
        with pytest.raises(ember.CallCancelledError):
            await slow.aget(timeout=30)
        # Cancelled just after its spawn, maybe before its replica began it: the slot frees.
        await asyncio.to_thread(
            wait_for, lambda: platform.endpoint_status(f"{APP}--model")["running"] == 0, 10
        )
        # amap: map's results, in order, from tasks on this loop; async inputs too.
        texts = [f"a{i}" for i in range(20)]
        mapped = [r async for r in echo.amap(({"text": t} for t in texts), concurrency=4)]
        assert [r["text"] for r in mapped] == texts

        async def tokens():
            for n in (2, 3):
                yield {"n": n}

        streamed = [r async for r in model.tokens.amap(tokens(), with_index=True)]
        assert streamed == [
            (0, [{"token": 0}, {"token": 1}]),
            (1, [{"token": i} for i in range(3)]),
        ]
        kept = [e async for e in boom.amap([{"message": "x"}], return_exceptions=True)]
        assert [(e.error_type, e.message) for e in kept] == [("ValueError", "x")]

    asyncio.run(scenario())


def test_async_call_and_poll(platform: Platform, deployed: dict[str, str]) -> None:
    echo = ember.Endpoint.lookup(APP, "echo", config=platform.config())
    handle = echo.spawn(text="later")
    assert handle.get(timeout=30)["text"] == "later"
    # Another process, knowing only the id, gets the same result.
    again = ember.CallHandle.from_id(handle.call_id, config=platform.config())
    assert again.get(timeout=30)["text"] == "later"
    with pytest.raises(ember.NotFoundError):
        ember.CallHandle.from_id("c-unknown", config=platform.config()).get(timeout=5)
    with pytest.raises(ember.InvalidError, match="not a call id"):
        ember.CallHandle.from_id("../v1/apps", config=platform.config())
    with platform.client() as client:
        response = client.post(
            f"/{APP}--boom/", json={"message": "async"}, headers={"Prefer": "respond-async"}
        )
        assert response.status_code == 202
        status_url = response.json()["status_url"]
        final = wait_for(lambda: (r := client.get(status_url)).status_code != 202 and r, 30)
        assert _error(final) == (500, "ValueError", "async")
        assert _error(client.get("/v1/calls/c-unknown"))[0] == 404


def test_a_spawn_retried_with_its_idempotency_key_gets_the_same_call(
    platform: Platform, deployed: dict[str, str]
) -> None:
    echo = ember.Endpoint.lookup(APP, "echo", config=platform.config())
    first = echo.spawn(_idempotency_key="job-17", text="once")
    again = echo.spawn(_idempotency_key="job-17", text="once")
    assert again.call_id == first.call_id
    assert first.get(timeout=30)["text"] == "once"
    # Still the same call once it has ended: its result, not a new run.
    with platform.client() as client:
        replay = client.post(
            f"/{APP}--echo/",
            json={"text": "once"},
            headers={"Prefer": "respond-async", "Idempotency-Key": "job-17"},
        )
        assert replay.status_code == 202 and replay.headers["idempotent-replayed"] == "true"
        assert replay.json()["call_id"] == first.call_id
        spaced = client.post(  # the same arguments, however the JSON is spaced
            f"/{APP}--echo/",
            content=b'{ "text" :  "once" }',
            headers={"Prefer": "respond-async", "Idempotency-Key": "job-17"},
        )
        assert spaced.status_code == 202 and spaced.json()["call_id"] == first.call_id
        # The same key with other arguments is a mistake, said as such.
        status, error_type, message = _error(
            client.post(
                f"/{APP}--echo/",
                json={"text": "other"},
                headers={"Prefer": "respond-async", "Idempotency-Key": "job-17"},
            )
        )
        assert (status, error_type) == (422, "idempotency_conflict")
        assert first.call_id in message
        bad = client.post(
            f"/{APP}--echo/",
            json={"text": "x"},
            headers={"Prefer": "respond-async", "Idempotency-Key": "x" * 300},
        )
        assert _error(bad)[:2] == (400, "invalid_request")
        # A synchronous call is not deduplicated: its key is refused, not ignored.
        sync = client.post(f"/{APP}--echo/", json={"text": "x"}, headers={"Idempotency-Key": "k"})
        assert _error(sync)[:2] == (400, "invalid_request") and "respond-async" in sync.text
    # Another caller's key is its own, and a new key is a new call.
    other = platform.ember("token", "create").stdout.strip()
    with platform.client(token=other) as client:
        theirs = client.post(
            f"/{APP}--echo/",
            json={"text": "once"},
            headers={"Prefer": "respond-async", "Idempotency-Key": "job-17"},
        )
    assert theirs.status_code == 202 and theirs.json()["call_id"] != first.call_id
    assert echo.spawn(_idempotency_key="job-18", text="once").call_id != first.call_id
    out = platform.ember(
        "call", f"{APP}--echo", '{"text": "once"}', "--spawn", "--idempotency-key", "job-17"
    ).stdout
    assert out.strip() == first.call_id


def test_ember_call_reads_its_arguments_from_a_file_or_standard_input(
    platform: Platform, deployed: dict[str, str], tmp_path: Path
) -> None:
    arguments = tmp_path / "args.json"
    arguments.write_text('{"text": "from a file", "times": 2}')
    out = platform.ember("call", f"{APP}--echo", f"@{arguments}").stdout
    assert json.loads(out)["text"] == "from a file" * 2
    piped = subprocess.run(
        [*EMBER, "call", f"{APP}--echo", "-"],
        input='{"text": "piped"}',
        env=platform.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert piped.returncode == 0, piped.stderr
    assert json.loads(piped.stdout)["text"] == "piped"
    missing = platform.ember("call", f"{APP}--echo", f"@{tmp_path / 'none.json'}", check=False)
    assert missing.returncode != 0 and "cannot read the arguments from" in missing.stderr


def test_spawned_calls_can_be_fetched_and_cancelled_from_the_shell(
    platform: Platform, deployed: dict[str, str], tmp_path: Path
) -> None:
    call_id = platform.ember("call", f"{APP}--echo", '{"text": "later"}', "--spawn").stdout
    out = platform.ember("calls", "get", call_id.strip(), "--wait", "30").stdout
    assert json.loads(out)["text"] == "later"
    saved = tmp_path / "result.json"
    said = platform.ember("calls", "get", call_id.strip(), "-o", str(saved)).stderr
    assert json.loads(saved.read_text())["text"] == "later" and f"wrote {saved}" in said
    nan = platform.ember("calls", "get", call_id.strip(), "--wait", "nan", check=False)
    assert nan.returncode == 2 and "is not a number of seconds" in nan.stderr
    # A running call, cancelled: its code sees it and stops, and its slot frees.
    label = f"{APP}--model"
    model = ember.Endpoint.lookup(APP, "model", config=platform.config())
    handle = model.patient.spawn(seconds=60)
    wait_for(lambda: platform.endpoint_status(label)["running"] == 1, 30)
    out = platform.ember("calls", "cancel", handle.call_id).stdout
    assert out.strip() == f"cancelled {handle.call_id}"
    with pytest.raises(ember.CallCancelledError, match="cancelled by its caller"):
        handle.get(timeout=10)
    wait_for(lambda: platform.endpoint_status(label)["running"] == 0, 10)
    wait_for(lambda: "stopping after" in platform.ember("logs", f"{APP}/model").stdout, 10)
    # Too late, unknown, or not an id: clear answers.
    again = platform.ember("calls", "cancel", handle.call_id, check=False)
    assert again.returncode == 1 and "was cancelled already" in again.stderr
    result = platform.ember("calls", "get", handle.call_id, check=False)
    assert result.returncode == 1 and "cancelled" in result.stderr
    unknown = platform.ember("calls", "cancel", "c-unknown", check=False)
    assert unknown.returncode == 1 and "no call c-unknown" in unknown.stderr
    bad = platform.ember("calls", "get", "../apps", check=False)
    assert bad.returncode == 2 and "is not a call id" in bad.stderr


def test_calls_ls_lists_an_apps_newest_spawned_calls(
    platform: Platform, deployed: dict[str, str]
) -> None:
    echo = ember.Endpoint.lookup(APP, "echo", config=platform.config())
    handles = [echo.spawn(text=str(i)) for i in range(3)]
    for handle in handles:
        handle.get(timeout=30)
    listed = json.loads(platform.ember("calls", "ls", f"{APP}/echo", "--json").stdout)
    newest = [c["call_id"] for c in listed[:3]]
    assert newest == [h.call_id for h in reversed(handles)]
    assert all(c["status"] == "succeeded" and c["http_status"] == 200 for c in listed[:3])
    assert all(c["label"] == f"{APP}--echo" for c in listed)
    table = platform.ember("calls", "ls", APP, "-n", "2").stdout.splitlines()
    assert table[0].split() == ["CALL", "ENDPOINT", "STATUS", "CREATED", "TOOK", "WEBHOOK"]
    assert len(table) == 3 and handles[-1].call_id in table[1]
    assert "succeeded (200)" in table[1]
    nobody = platform.ember("calls", "ls", "nobody", check=False)
    assert nobody.returncode == 1 and "no app named nobody was ever deployed" in nobody.stderr
    bad = platform.ember("calls", "ls", "../x", check=False)
    assert bad.returncode == 1 and "not allowed" in bad.stderr
    as_label = json.loads(platform.ember("calls", "ls", f"{APP}--echo", "--json").stdout)
    assert as_label == listed
    never = platform.ember("calls", "ls", f"{APP}/nope", check=False)
    assert never.returncode == 1 and f"app {APP} never had an endpoint named nope" in never.stderr
    with platform.client() as client:
        assert client.get("/v1/calls", params={"limit": "0"}).status_code == 400
        odd = client.get("/v1/calls", params={"limit": "1e3"})
        assert odd.status_code == 400 and "a whole number from 1 to" in odd.text
        assert client.get("/v1/calls", params={"endpoint": "echo"}).status_code == 400
    invoke_token = platform.ember("token", "create").stdout.strip()
    with platform.client(invoke_token) as client:
        denied = client.get("/v1/calls")
        assert denied.status_code == 403 and "needs a deploy token" in denied.text


def test_usage_shows_what_the_replicas_held(platform: Platform, deployed: dict[str, str]) -> None:
    echo = ember.Endpoint.lookup(APP, "echo", config=platform.config())
    for _ in range(3):
        echo.call(text="counted")
    data = json.loads(platform.ember("usage", APP, "--since", "1h", "--json").stdout)
    rows = {row["endpoint"]: row for row in data["endpoints"]}
    assert {row["app"] for row in data["endpoints"]} == {APP}
    row = rows["echo"]  # live replicas count up to now
    assert row["replicas"] >= 1 and row["replica_seconds"] > 0
    assert row["cpu_seconds"] == pytest.approx(row["replica_seconds"] * 0.25, rel=0.01)
    assert sum(row["starts"].values()) >= 1 and row["inputs"] >= 3
    table = platform.ember("usage", APP).stdout.splitlines()
    assert table[0].split()[:3] == ["ENDPOINT", "REPLICAS", "HOURS"]
    assert any(line.startswith(f"{APP}--echo ") for line in table)
    bad = platform.ember("usage", "--since", "40d", check=False)
    assert bad.returncode == 1 and "since must be" in bad.stderr


def test_logs_show_replica_output(platform: Platform, deployed: dict[str, str]) -> None:
    ember.Endpoint.lookup(APP, "echo", config=platform.config()).call(text="logged-line")
    # A call of its own, so that the class endpoint has a replica however the test runs.
    ember.Endpoint.lookup(APP, "model", method="scale", config=platform.config()).call(x=1.0)
    out = wait_for(lambda: "logged-line" in (o := platform.ember("logs", APP).stdout) and o, 10)
    model_logs = wait_for(
        lambda: "loading model" in (o := platform.ember("logs", f"{APP}/model").stdout) and o, 10
    )
    assert "echo called" not in model_logs
    # Filters: one replica's lines, recent lines. The platform filters before it counts
    # -n, so a replica's first line is found however many lines other replicas wrote.
    line = next(line for line in out.splitlines() if "logged-line" in line)
    replica = line.split()[1].split("/", 1)[1]
    mine = platform.ember("logs", APP, "--replica", replica, "-n", "100000").stdout.splitlines()
    assert mine and all(f"/{replica} " in entry for entry in mine)
    assert any("replica ready" in entry for entry in mine)
    last = platform.ember("logs", APP, "--replica", replica, "-n", "1").stdout.splitlines()
    assert len(last) == 1 and f"/{replica} " in last[0]
    assert "logged-line" in platform.ember("logs", APP, "--since", "1h").stdout
    assert platform.ember("logs", APP, "--replica", "r-nobody").stdout == ""


def test_ls_shows_endpoints_and_worker(platform: Platform, deployed: dict[str, str]) -> None:
    out = platform.ember("ls").stdout
    assert f"{APP}--echo" in out and "1 worker(s): local" in out
    assert "UNSERVABLE" in out  # the GPU endpoint says why


def test_caller_leaving_closes_the_generator_and_frees_the_slot(
    platform: Platform, deployed: dict[str, str]
) -> None:
    label = f"{APP}--forever"
    with platform.client() as client:
        with client.stream("POST", f"/{label}/", json={}) as response:
            lines = response.iter_lines()
            received = [line for line, _ in zip(lines, range(6), strict=False) if line]
        assert len(received) >= 2
        logs = wait_for(
            lambda: (
                "generator closed" in (o := platform.ember("logs", f"{APP}/forever").stdout) and o
            ),
            15,
        )
        assert "cancelled" in logs
        wait_for(lambda: platform.endpoint_status(label)["running"] == 0, 10)
        # concurrency=1: the slot is free again, so a new stream starts on the same replica.
        with client.stream("POST", f"/{label}/", json={}) as response:
            assert next(line for line in response.iter_lines() if line).startswith("data: ")
        assert sum(platform.endpoint_status(label)["replicas"].values()) == 1


def test_sync_call_abandoned_by_its_caller_is_cancelled(
    platform: Platform, deployed: dict[str, str]
) -> None:
    label = f"{APP}--sleepy"
    with platform.client() as client:  # a replica is up, so the input will be running
        assert client.post(f"/{label}/", json={"seconds": 0.01}).status_code == 200
        # On the connection that call opened: the 0.3 s is spent waiting for the answer,
        # not on a TLS handshake (slow on a loaded machine).
        with pytest.raises(httpx.ReadTimeout):
            client.post(f"/{label}/", json={"seconds": 0.8}, timeout=0.3)
    wait_for(lambda: platform.endpoint_status(label)["running"] == 0, 10)
    logs = platform.ember("logs", f"{APP}/sleepy").stdout
    assert "waiting for its thread" in logs


def test_sync_code_sees_its_caller_leave_and_stops_early(
    platform: Platform, deployed: dict[str, str]
) -> None:
    label = f"{APP}--model"
    with platform.client() as client:
        answer = client.post(f"/{label}/patient", json={"seconds": 0.01}).json()
        assert answer == {"stopped": False}
        # On the connection that call opened: the 0.5 s is spent waiting for the answer,
        # not on a TLS handshake (slow on a loaded machine).
        with pytest.raises(httpx.ReadTimeout):
            client.post(f"/{label}/patient", json={"seconds": 20}, timeout=0.5)
    # The slot frees long before the 20 s asked for: the code saw its caller leave.
    wait_for(lambda: platform.endpoint_status(label)["running"] == 0, 10)
    logs = wait_for(
        lambda: [
            line
            for line in platform.ember("logs", f"{APP}/model").stdout.splitlines()
            if "the caller left" in line
        ],
        10,
    )
    assert "stopping after" in logs[0]
    assert not ember.cancelled()  # outside a replica's input: never


def test_an_acall_given_up_by_its_task_is_cancelled_and_the_kept_client_goes_on(
    platform: Platform, deployed: dict[str, str]
) -> None:
    label = f"{APP}--model"
    patient = ember.Endpoint.lookup(APP, "model", config=platform.config()).method("patient")

    async def scenario() -> dict:
        assert await patient.acall(seconds=0.01) == {"stopped": False}
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(patient.acall(seconds=20), 0.5)
        # The kept connection that carried it was closed, so the platform saw the caller
        # leave; the client itself serves the next call.
        await asyncio.to_thread(
            wait_for, lambda: platform.endpoint_status(label)["running"] == 0, 10
        )
        return await patient.acall(seconds=0.01)

    def caller_left() -> int:
        return platform.ember("logs", f"{APP}/model").stdout.count("the caller left")

    before = caller_left()
    assert asyncio.run(scenario()) == {"stopped": False}
    assert caller_left() == before + 1


def test_the_code_s_own_metrics_are_exported(platform: Platform, deployed: dict[str, str]) -> None:
    echo = ember.Endpoint.lookup(APP, "echo", config=platform.config())
    for _ in range(3):
        echo.call(text="abc", times=7)
    series = f'ember:user_echoes_total{{app="{APP}",endpoint="echo",times="7"}} '

    def counted() -> float | None:
        with platform.client() as client:
            text = client.get("/metrics").text
        lines = [line for line in text.splitlines() if line.startswith(series)]
        return float(lines[0].split()[-1]) if lines and float(lines[0].split()[-1]) >= 3 else None

    assert wait_for(counted, 10) == 3.0  # once a second, with the replicas' heartbeats
    with platform.client() as client:
        text = client.get("/metrics").text
    assert "# TYPE ember:user_echoes_total counter" in text
    assert "# HELP ember:user_echo_last_length Characters in echo's last answer" in text
    gauges = [line for line in text.splitlines() if line.startswith("ember:user_echo_last_length{")]
    assert any('replica="r-' in line and line.endswith(" 21.0") for line in gauges)
    # Every text echo was given so far, by length: the three of three characters among them.
    bucket = f'ember:user_echo_text_length_bucket{{app="{APP}",endpoint="echo",le="10.0"}} '
    counts = {
        line.split()[0]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("ember:user_echo_text_length")
    }
    assert counts[bucket.strip()] >= 3
    assert counts[f'ember:user_echo_text_length_count{{app="{APP}",endpoint="echo"}}'] >= 3


def test_metrics_need_a_metrics_token_and_count_replica_starts(
    platform: Platform, deployed: dict[str, str]
) -> None:
    with platform.client() as client:
        assert client.post(f"/{APP}--echo/", json={"text": "x"}).status_code == 200
        assert _error(client.get("/metrics", headers={"Authorization": ""}))[:2] == (
            401,
            "unauthorized",
        )
    invoke_token = platform.ember("token", "create").stdout.strip()
    with platform.client(token=invoke_token) as client:
        assert _error(client.get("/metrics"))[:2] == (403, "forbidden")
    metrics_token = platform.ember("token", "create", "--scope", "metrics").stdout.strip()
    with platform.client(token=metrics_token) as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    started = f'ember:replica_starts_total{{app="{APP}",endpoint="echo",kind="cold"}}'
    assert started in text
    assert (
        f'ember:replica_start_seconds_count{{app="{APP}",endpoint="echo",kind="cold",phase="total"}}'
        in text
    )

    # Requests the gateway refuses before anything runs are counted too.
    def refused(status: int) -> float:
        with platform.client(token=metrics_token) as client:
            text = client.get("/metrics").text
        labels = f'app="{APP}",endpoint="echo",kind="sync",status="{status}"'
        return _metric(text, "ember:requests_total", labels, default=0.0)

    before = {status: refused(status) for status in (401, 404)}
    with platform.client() as client:
        assert client.post(f"/{APP}--echo/", headers={"Authorization": ""}).status_code == 401
        assert client.post(f"/{APP}--echo/no-such-method", json={}).status_code == 404
        token = client.headers["authorization"]
        twice = client.post(
            f"/{APP}--echo/", json={}, headers=[("Authorization", token), ("Authorization", "x")]
        )
        assert twice.status_code == 400 and "one Authorization header" in twice.text
    assert {status: refused(status) - before[status] for status in (401, 404)} == {
        401: 1.0,
        404: 1.0,
    }


def _metric(text: str, name: str, labels: str, default: float | None = None) -> float:
    for line in text.splitlines():
        if line.startswith(f"{name}{{{labels}}} "):
            return float(line.rsplit(" ", 1)[1])
    if default is None:
        raise AssertionError(f"no {name}{{{labels}}} in /metrics")
    return default


def test_stream_timings_reach_the_metrics_and_the_log(
    platform: Platform, deployed: dict[str, str]
) -> None:
    labels = f'app="{APP}",endpoint="numbers"'

    def scrape() -> dict[str, float]:
        with platform.client() as client:
            text = client.get("/metrics").text
        names = ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count")
        found = {n: _metric(text, f"ember:{n}", labels, default=0.0) for n in names}
        found["gap_sum"] = _metric(text, "ember:inter_token_latency_seconds_sum", labels, 0.0)
        ok = labels + ',kind="stream",status="200"'
        found["ok"] = _metric(text, "ember:requests_total", ok, 0.0)
        return found

    before = scrape()
    numbers = ember.Endpoint.lookup(APP, "numbers", config=platform.config())
    assert [item["n"] for item in numbers.stream(to=4, delay=0.15)] == list(range(4))
    after = scrape()
    assert (
        after["time_to_first_token_seconds_count"]
        == before["time_to_first_token_seconds_count"] + 1
    )
    # Four events, three gaps, each about the generator's delay of 0.15 s.
    assert (
        after["inter_token_latency_seconds_count"]
        == before["inter_token_latency_seconds_count"] + 3
    )
    # (The upper bound is loose: a loaded machine delays events, not the point here.)
    assert 0.4 <= after["gap_sum"] - before["gap_sum"] < 15
    assert after["ok"] == before["ok"] + 1

    def request_lines() -> list[str]:
        out = platform.ember("logs", f"{APP}/numbers", "-n", "50").stdout
        return [line for line in out.splitlines() if "first event" in line]

    assert "4 events" in wait_for(request_lines, 10)[-1]
