"""Metrics, logs and usage."""
