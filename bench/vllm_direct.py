"""examples/vllm's engine and OpenAI layer served without Ember: the same class, loaded
and warmed as a replica's `enter` hooks do, behind a bare Starlette route on loopback.
bench/engines.py runs it with the interpreter of the environment the platform made for
the endpoint (vLLM is installed there), as the like-for-like baseline of what the
platform adds.

    PYTHON bench/vllm_direct.py --model-dir DIR --port N
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "vllm"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    import os

    os.environ["EMBER_VLLM_DIR"] = str(args.model_dir)
    sys.path.insert(0, str(EXAMPLE))
    import uvicorn
    from starlette.applications import Starlette
    from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    import ember

    app_module = __import__("app")
    served = app_module.VLLM.target()  # the class, as a replica makes it
    served.weights = {"model": ember.weights.open(app_module.WEIGHTS_URL)}
    served.load()
    served.ready()

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
    uvicorn.run(Starlette(routes=routes), host="127.0.0.1", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
