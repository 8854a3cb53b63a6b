"""A replica process: boots user code (or is restored) and serves inputs over its channel."""
