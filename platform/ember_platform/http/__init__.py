"""The HTTP edge: the ASGI app, the gateway that turns calls into inputs, request parsing, CORS,
web apps, OpenAPI, the dashboard, and the mapping of errors to status codes.
"""
