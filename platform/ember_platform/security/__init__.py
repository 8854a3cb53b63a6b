"""Tokens, rate limits, TLS certificates, and secrets."""
