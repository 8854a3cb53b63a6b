"""The lazy image file system: an image's root mounted from its file index (FUSE), file
contents read on first use through the node's tiered cache and checked."""
