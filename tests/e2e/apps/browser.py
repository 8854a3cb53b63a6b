"""Endpoints that web pages call from a browser (CORS)."""

import ember


@ember.endpoint(snapshot=False, cors_origins=["https://app.example.com"])
def shout(text: str) -> str:
    return text.upper()


@ember.endpoint(snapshot=False, public=True, cors_origins=["*"])
def count(to: int = 3):
    yield from range(to)


@ember.endpoint(snapshot=False)
def closed(text: str) -> str:
    return text


@ember.endpoint(snapshot=False)
@ember.asgi_app()
def private_site():
    """A private web app that answers CORS itself, as the platform asks web apps to."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def hello(request):
        return PlainTextResponse("hello")

    cors = Middleware(
        CORSMiddleware,
        allow_origins=["https://app.example.com"],
        allow_methods=["POST"],
        allow_headers=["authorization", "content-type"],
    )
    return Starlette(routes=[Route("/hello", hello, methods=["POST"])], middleware=[cors])
