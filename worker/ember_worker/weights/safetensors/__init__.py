"""The safetensors format read lazily: headers and shard indexes parsed without torch, one
file or a sharded checkpoint viewed as tensors fetched by byte range when asked for."""
