"""Model weights named by URL, read by byte range through memory, node disk and origin tiers."""
