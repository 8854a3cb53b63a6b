"""The node's GPUs as NVML tells of them: telemetry, and health (fenced when it fails)."""
