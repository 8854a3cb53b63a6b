"""Model weights named by URL, read by byte range through memory, node disk and origin tiers:
`opener` (a URL to a lazy view), `origins/`, `reading/`, `cache/` and `safetensors/`."""
