"""What the HTTPS edge's two sides share, the gateway (`http/`) and the API (`api/`): the
error answers, CORS, and ASGI's types. It imports neither."""
