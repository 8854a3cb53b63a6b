"""`ember.File`: a result that is a file, not JSON. An endpoint that returns `bytes` or a
`File` answers with the bytes as the response body, of the file's media type (with a
`Content-Disposition` when it has a name), and the SDK gives the caller `bytes`.

On the channel between a replica and the control plane the bytes travel as base64, with
the media type and name in the result's header (`result_header`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from email.message import Message
from email.utils import collapse_rfc2231_value
from typing import Any
from urllib.parse import quote

from ember.errors import InvalidError

DEFAULT_MEDIA_TYPE = "application/octet-stream"
BAD_NAME = '/\\"\r\n\x00'  # what a file name offered in a header may not hold
# type "/" subtype, with optional parameters (`text/csv; charset=utf-8`).
MEDIA_TYPE = re.compile(r"[A-Za-z0-9!#$&^_.+-]+/[A-Za-z0-9!#$&^_.+-]+(\s*;\s*[ -~]*)?\Z")


@dataclass(frozen=True)
class File:
    """Return one from an endpoint: `ember.File(png, media_type="image/png")`."""

    data: bytes
    media_type: str = DEFAULT_MEDIA_TYPE
    filename: str | None = None  # offered to save it as (Content-Disposition: attachment)

    def __post_init__(self) -> None:
        if not isinstance(self.data, bytes | bytearray | memoryview):
            raise InvalidError(f"ember.File takes bytes, not {type(self.data).__name__}")
        object.__setattr__(self, "data", bytes(self.data))
        if not isinstance(self.media_type, str) or not MEDIA_TYPE.match(self.media_type):
            raise InvalidError(f"ember.File: {self.media_type!r} is not a media type")
        if self.filename is not None and (
            not isinstance(self.filename, str)
            or not self.filename
            or any(c in self.filename for c in BAD_NAME)
        ):
            raise InvalidError(f"ember.File: {self.filename!r} is not a file name")


def as_file(value: Any) -> File | None:
    """The file an endpoint returned, or None when its result is a JSON value."""
    if isinstance(value, File):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return File(bytes(value))
    return None


def result_header(file: File) -> dict[str, str]:
    """What a file result's channel header carries beside its base64 body."""
    header = {"media_type": file.media_type}
    if file.filename is not None:
        header["filename"] = file.filename
    return header


def received_file_header(header: dict[str, Any]) -> tuple[str, str | None]:
    """The media type and name a replica's result header gives, as headers may carry
    them: a replica runs the user's code, so what it sends is checked again here."""
    media_type, filename = header.get("media_type"), header.get("filename")
    if not isinstance(media_type, str) or not MEDIA_TYPE.match(media_type):
        media_type = DEFAULT_MEDIA_TYPE
    if not isinstance(filename, str) or not filename or any(c in filename for c in BAD_NAME):
        filename = None
    return media_type, filename


class ReceivedFile(bytes):
    """A file result as the SDK gives it: the bytes themselves, so that code comparing or
    writing them needs nothing new, with the media type and name the answer carried."""

    media_type: str
    filename: str | None

    def __new__(cls, data: bytes, media_type: str, filename: str | None = None) -> ReceivedFile:
        received = super().__new__(cls, data)
        received.media_type = media_type
        received.filename = filename
        return received

    def __reduce__(self) -> tuple[Any, ...]:
        return (ReceivedFile, (bytes(self), self.media_type, self.filename))


def received_file(data: bytes, content_type: str, disposition: str | None) -> ReceivedFile:
    """The file an answer's body and headers hold: its name is RFC 6266's UTF-8 form when
    the header has one (the platform sends it beside an ASCII stand-in), else the plain one."""
    return ReceivedFile(
        data,
        content_type or DEFAULT_MEDIA_TYPE,
        _offered_name(disposition) if disposition else None,
    )


def _offered_name(disposition: str) -> str | None:
    message = Message()
    message["content-disposition"] = disposition
    names = [
        value
        for key, value in message.get_params([], header="content-disposition")
        if key == "filename"
    ]
    # The email parser gives an RFC 2231 value as (charset, language, text), the plain one as str.
    encoded = [value for value in names if isinstance(value, tuple)]
    name = collapse_rfc2231_value(encoded[0]) if encoded else (names[0] if names else None)
    if not isinstance(name, str) or not name or any(c in name for c in BAD_NAME):
        return None
    return name


def content_disposition(filename: str) -> str:
    """An attachment header with the name as ASCII and, when it is not, as RFC 6266's
    UTF-8 form too."""
    ascii_name = filename.encode("ascii", "replace").decode("ascii")
    header = f'attachment; filename="{ascii_name}"'
    if ascii_name != filename:
        header += f"; filename*=UTF-8''{quote(filename)}"
    return header
