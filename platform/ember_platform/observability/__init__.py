"""Metrics, logs, usage and spans."""
