"""One object read by byte range through the tiers (process memory, node disk, origin):
`ObjectReader` and its parts."""
