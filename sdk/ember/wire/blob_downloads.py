"""How a worker asks for a snapshot image it may download from the blob store itself:
with this header, a control plane whose blobs are in a bucket answers 307 with a presigned
URL (else it sends the bytes, as it does without the header)."""

from __future__ import annotations

DIRECT_HEADER = "X-Ember-Direct"
