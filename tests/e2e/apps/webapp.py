"""Web-app endpoints (@ember.asgi_app) for the end-to-end tests: a Starlette app with
routes that echo, stream, fail, and show what the app was told about its request."""

import asyncio
import json
import time

import ember


def build(name: str):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route, WebSocketRoute
    from starlette.websockets import WebSocket, WebSocketDisconnect

    async def info(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "app": name,
                "method": request.method,
                "path": request.url.path,
                "root_path": request.scope["root_path"],
                "query": dict(request.query_params),
                "authorization": request.headers.get("authorization"),
                "url_for_echo": str(request.url_for("echo")),
            }
        )

    async def echo(request: Request) -> Response:
        body = await request.body()
        return Response(
            body,
            status_code=201,
            media_type=request.headers.get("content-type", "application/octet-stream"),
            headers={"x-echoed-bytes": str(len(body))},
        )

    async def stream(request: Request) -> StreamingResponse:
        count = int(request.query_params.get("n", "3"))
        delay = float(request.query_params.get("delay", "0.05"))
        fail_at = int(request.query_params.get("fail_at", "-1"))

        async def chunks():
            try:
                for i in range(count):
                    await asyncio.sleep(delay)
                    if i == fail_at:
                        raise RuntimeError("the stream failed midway")
                    yield f"chunk {i}\n"
            finally:
                print(f"stream closed after {time.monotonic():.0f}")

        return StreamingResponse(chunks(), media_type="text/plain")

    async def raw(request: Request) -> JSONResponse:
        return JSONResponse(
            {"path": request.url.path, "raw_path": request.scope["raw_path"].decode()}
        )

    async def nap(request: Request) -> PlainTextResponse:
        seconds = float(request.query_params.get("s", "0"))
        print(f"nap of {seconds:g} s begins")
        await asyncio.sleep(seconds)
        return PlainTextResponse(f"slept {seconds:g}")

    async def fail(request: Request) -> Response:
        raise RuntimeError("the route failed")

    def sync_route(request: Request) -> PlainTextResponse:
        return PlainTextResponse("from a thread")

    async def chat(websocket: WebSocket) -> None:
        if websocket.query_params.get("refuse"):
            await websocket.close(code=4003)  # before accepting: the handshake fails
            return
        await websocket.accept(subprotocol=(websocket.scope["subprotocols"] or [None])[0])
        await websocket.send_json({"hello": name, "path": websocket.url.path})
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    raise WebSocketDisconnect(message.get("code", 1000))
                if message.get("bytes") is not None:
                    await websocket.send_bytes(message["bytes"][::-1])
                elif message["text"] == "close please":
                    await websocket.close(code=4000, reason="asked to")
                    return
                elif message["text"] == "fail":
                    raise RuntimeError("the session failed")
                else:
                    await websocket.send_text("echo: " + message["text"])
        except WebSocketDisconnect as gone:
            print(f"websocket closed by the caller with code {gone.code}")

    return Starlette(
        routes=[
            Route("/info", info, methods=["GET", "DELETE", "PUT"]),
            Route("/echo", echo, methods=["POST"], name="echo"),
            Route("/stream", stream),
            Route("/fail", fail),
            Route("/nap", nap),
            Route("/raw/{rest:path}", raw),
            Route("/sync", sync_route),
            WebSocketRoute("/chat", chat),
        ]
    )


@ember.endpoint(concurrency=8)
@ember.asgi_app()
def web():
    return build("private")


@ember.endpoint(public=True, concurrency=8)
@ember.asgi_app()
def open_web():
    return build("public")


@ember.endpoint(concurrency=4, max_replicas=1, timeout=4)
@ember.asgi_app()
def hasty_web():
    return build("hasty")


def with_lifespan(fail: bool):
    """A Starlette app whose lifespan loads what its routes use, as FastAPI apps do."""
    import contextlib

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if fail:
            raise RuntimeError("the model is missing")
        print("lifespan startup", flush=True)
        yield {"model": "loaded in the lifespan"}
        print("lifespan shutdown", flush=True)

    async def model(request: Request) -> JSONResponse:
        return JSONResponse({"model": request.state.model})

    return Starlette(routes=[Route("/model", model)], lifespan=lifespan)


@ember.endpoint(snapshot=False)
@ember.asgi_app()
def lifespan_web():
    return with_lifespan(fail=False)


@ember.endpoint(snapshot=False)
@ember.asgi_app()
def failing_lifespan_web():
    return with_lifespan(fail=True)


@ember.endpoint(concurrency=2)
@ember.asgi_app()
def not_an_app():
    return "not an app"


def classic(environ, start_response):
    """A WSGI app with the standard library alone (what Flask and Django speak)."""
    path = environ["PATH_INFO"]
    if path == "/echo":
        body = environ["wsgi.input"].read()
        start_response("201 Created", [("Content-Type", environ.get("CONTENT_TYPE", ""))])
        return [body]
    if path == "/stream":

        def chunks():
            for i in range(int(environ["QUERY_STRING"].partition("=")[2] or 3)):
                time.sleep(0.2)
                yield f"line {i}\n".encode()

        start_response("200 OK", [("Content-Type", "text/plain")])
        return chunks()
    if path == "/fail":
        raise RuntimeError("the wsgi view failed")
    start_response("200 OK", [("Content-Type", "application/json"), ("X-Kind", "wsgi")])
    seen = {k: environ[k] for k in ("REQUEST_METHOD", "SCRIPT_NAME", "PATH_INFO", "QUERY_STRING")}
    seen["call"] = ember.current_call_id()
    return [json.dumps(seen).encode()]


@ember.endpoint(concurrency=4)
@ember.wsgi_app()
def wsgi_web():
    return classic


@ember.endpoint(concurrency=4)
@ember.wsgi_app()
def flask_web():
    from flask import Flask, request, url_for  # in the test extras, as moto's server needs it

    app = Flask(__name__)

    @app.get("/hello/<name>")
    def hello(name: str):
        return {
            "hello": name,
            "lang": request.args.get("lang"),
            "self": url_for("hello", name=name),
        }

    @app.post("/upload")
    def upload():
        return {"bytes": len(request.get_data()), "type": request.content_type}

    return app
