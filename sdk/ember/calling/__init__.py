"""Calling endpoints: the Python client, its options (priority, timeouts, webhooks), the
bodies it sends and answers it reads, and its connections.
"""
