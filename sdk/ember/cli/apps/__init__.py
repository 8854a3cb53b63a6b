"""Commands about apps: deploy, serve, run, stop, history, canary, scale, ls, openapi, logs."""
