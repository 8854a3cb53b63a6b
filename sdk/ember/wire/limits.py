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
# A result larger than this goes in pieces of this size (`ResultPart`), each a message.
RESULT_PIECE_BYTES = MIB
# A stream's flow control: a replica stops making events while this much of what it sent
# is not yet taken for its caller, so a caller that reads slowly (or not at all) holds
# the generator back instead of filling the control plane's memory. The control plane
# acknowledges what it took every quarter window.
STREAM_WINDOW_BYTES = 8 * MIB
STREAM_ACK_BYTES = STREAM_WINDOW_BYTES // 4
