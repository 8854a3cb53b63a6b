"""Sizes the platform's parts agree on: the replica checks them, the control plane's
WebSocket server accepts messages up to them."""

from __future__ import annotations

MIB = 1024 * 1024
MAX_RESULT_BYTES = 64 * MIB  # one result, or one stream event, as JSON
MAX_FILE_RESULT_BYTES = MAX_RESULT_BYTES // 4 * 3  # a file result, once in base64
# One message on a replica's or a worker's channel: a result with its header, or a batch
# of log lines (batches are cut well below this).
MAX_CHANNEL_MESSAGE_BYTES = MAX_RESULT_BYTES + MIB
MAX_LOG_BATCH_BYTES = 4 * MIB
