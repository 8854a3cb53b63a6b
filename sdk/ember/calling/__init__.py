"""Calling endpoints: the Python client, its options (priority, affinity, timeouts, webhooks), and
its connections.
"""
