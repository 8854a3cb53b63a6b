"""A web app as an endpoint: a Starlette app with a page, a JSON API and a stream, built
once per replica (before the snapshot), served under the endpoint's URL.

    ember deploy examples/webapp/app.py
    open https://127.0.0.1:8443/webapp--site/   (public: no token needed)
    curl --cacert ~/.ember/server/ca.pem -d '{"text": "what a lovely day"}' \\
        https://127.0.0.1:8443/webapp--site/api/mood

FastAPI works the same way: return its app from the function, with `fastapi` in a
`requirements.txt` beside this file.
"""

import asyncio
import json

import ember

POSITIVE = {"love", "lovely", "great", "good", "happy", "wonderful", "nice", "excellent"}
NEGATIVE = {"hate", "awful", "bad", "sad", "terrible", "horrible", "poor", "ugly"}

PAGE = """<!doctype html>
<meta charset="utf-8"><title>Mood</title>
<h1>Mood</h1>
<form method="post" action="{action}"><input name="text" autofocus> <button>Ask</button></form>
<p>{answer}</p>
"""


def mood(text: str) -> dict:
    words = text.lower().replace(",", " ").replace(".", " ").split()
    score = sum(w in POSITIVE for w in words) - sum(w in NEGATIVE for w in words)
    label = "positive" if score > 0 else "negative" if score < 0 else "neutral"
    return {"text": text, "label": label, "score": score}


@ember.endpoint(name="site", public=True, concurrency=32, scaledown_window=120)
@ember.asgi_app()
def site():
    from html import escape
    from urllib.parse import parse_qs

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def page(request: Request) -> HTMLResponse:
        answer = ""
        if request.method == "POST":  # a urlencoded form (no multipart parser needed)
            form = parse_qs((await request.body()).decode())
            result = mood(form.get("text", [""])[0])
            answer = f"{escape(result['text'])}: {result['label']}"
        action = escape(str(request.url_for("page")))
        return HTMLResponse(PAGE.format(action=action, answer=answer))

    async def api_mood(request: Request) -> JSONResponse:
        try:
            body = await request.json()
            text = body["text"]
        except (ValueError, KeyError, TypeError):
            return JSONResponse({"error": 'send {"text": "..."}'}, status_code=400)
        return JSONResponse(mood(str(text)))

    async def words(request: Request) -> StreamingResponse:
        """Server-sent events: each word of `text` with its mood, one at a time."""
        text = request.query_params.get("text", "")

        async def events():
            for word in text.split():
                await asyncio.sleep(0.05)
                yield f"data: {json.dumps(mood(word))}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/", page, methods=["GET", "POST"], name="page"),
            Route("/api/mood", api_mood, methods=["POST"]),
            Route("/api/words", words),
        ]
    )
