"""One frame of the ckptdrain wire protocol (pure): its bytes, and the events a receiver makes
of it. The rules of the conversation (which frame may come when) are ``wire.py``'s, which
re-exports every name here: both sides speak the protocol through that module.

Frame (both directions)::

    +------+------------+-------------+------------------------+---------------------+
    | CKD1 | header_len | payload_len | header: UTF-8 JSON obj | payload (raw bytes) |
    | 4 B  | u32 BE     | u64 BE      | header_len bytes       | payload_len bytes   |
    +------+------------+-------------+------------------------+---------------------+

The header is a JSON object whose ``"type"`` names the message; the other keys are its fields.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from ckptdrain.client.messages import BAD_REQUEST, ProtocolError, validate

MAGIC: Final = b"CKD1"
PREFIX: Final = struct.Struct(">4sIQ")
PREFIX_BYTES: Final = PREFIX.size  # 16
MAX_HEADER_BYTES: Final = 64 * 1024


@dataclass(frozen=True)
class Message:
    """One frame's header: its ``type`` as ``kind`` and its other keys as ``fields``."""

    kind: str
    fields: dict[str, Any]
    payload_len: int = 0


@dataclass(frozen=True)
class PayloadChunk:
    """Part of the payload of the last ``data`` Message (a view of bytes nobody else holds)."""

    data: memoryview


@dataclass(frozen=True)
class PayloadEnd:
    """The payload of the last ``data`` Message is complete."""


@dataclass(frozen=True)
class Rejected:
    """A well-framed request whose fields break a rule (server role only): the frame is
    consumed and the conversation goes on; the IO layer answers ``error`` with this ``code``
    and ``message`` and reads the next request. Framing and ordering faults raise instead."""

    kind: str
    code: str
    message: str


@dataclass(frozen=True)
class ConnectionClosed:
    """The peer closed its side at a frame boundary (a clean EOF)."""


class Sentinel(enum.Enum):
    NEED_DATA = "NEED_DATA"

    def __repr__(self) -> str:
        return self.value


NEED_DATA: Final = Sentinel.NEED_DATA
"""next_event() returns this when it needs more bytes from receive_data()."""

Event = Message | Rejected | PayloadChunk | PayloadEnd | ConnectionClosed


def encode_message(
    kind: str, fields: Mapping[str, Any] | None = None, payload_len: int = 0
) -> bytes:
    """The prefix and header bytes of one frame (the caller sends ``payload_len`` bytes after)."""
    checked = validate(kind, fields or {}, payload_len, outgoing=True)
    try:
        header = json.dumps(
            {"type": kind, **checked}, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise ProtocolError(BAD_REQUEST, f"{kind!r} fields are not JSON: {exc}") from None
    if len(header) > MAX_HEADER_BYTES:
        raise ProtocolError(
            BAD_REQUEST,
            f"{kind!r} header is {len(header)} bytes, over the limit of {MAX_HEADER_BYTES}",
        )
    return PREFIX.pack(MAGIC, len(header), payload_len) + header


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Two parsers may pick different duplicates; refusing them removes the ambiguity.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def decode_header(header: bytes) -> tuple[str, dict[str, Any]]:
    try:
        obj = json.loads(
            header.decode("utf-8"),
            object_pairs_hook=_reject_duplicates,
            parse_constant=_reject_constant,
        )
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ProtocolError(BAD_REQUEST, f"frame header is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(
            BAD_REQUEST, f"frame header must be a JSON object, not {type(obj).__name__}"
        )
    kind = obj.pop("type", None)
    if not isinstance(kind, str):
        raise ProtocolError(BAD_REQUEST, "frame header has no string 'type'")
    return kind, obj
