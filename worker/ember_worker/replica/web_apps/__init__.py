"""What a replica needs to serve a user's web app: the ASGI lifespan (`asgi_lifespan.py`)
and the bridge that runs a WSGI app (`wsgi_bridge.py`)."""
