"""The control plane's own API under /v1, one module per resource, and the WebSocket channels of
agents and replicas.
"""
