"""The ckptdrain wire protocol as a pure state machine (sans-IO, in the style of h11).

No sockets here: the IO layer feeds received bytes in with :meth:`Connection.receive_data`,
pulls events out with :meth:`Connection.next_event`, and writes the bytes :meth:`Connection.send`
returns. The same machine serves the blocking client (CLIENT role) and the asyncio daemon
(SERVER role), so both sides agree on every rule by construction.

Frames, and the events made of them, are ``frames.py``'s (the frame layout is drawn there);
cutting them from the bytes received is ``framereader.py``'s (the connection's base).

A shard sent as bytes takes two round trips: ``put`` declares it (``size``, no payload), the
daemon answers ``ok`` once it has admitted it (budget reserved: backpressure happens before any
byte is sent, never with gigabytes stuck in a socket), then the client sends one ``data`` frame
whose payload is the shard, exactly ``size`` bytes, and the daemon answers again. The machine
tracks this on both sides: ``data`` is refused unless it follows an accepted ``put`` with the
same size, and nothing else may come between. A daemon whose ``ok`` to the put says ``"pipe":
true`` also takes a ``data_pipe`` frame there instead: no payload, and one fd, the read end of
a pipe into which the client writes (``vmsplice``) exactly ``size`` bytes.

A small shard (at most :data:`INLINE_MAX_BYTES`, and only to a daemon whose ``begin`` reply
offers ``inline_bytes``) takes one round trip instead: ``put_bytes`` carries the shard as its
payload, ``size`` bytes exactly. A refusal then costs the bytes already sent, which is why only
small shards go this way. Only ``data`` and ``put_bytes`` carry a payload.

``put_fd``, ``put_memfd`` (and ``data_pipe``) carry one file descriptor instead (SCM_RIGHTS, attached to the
frame's first byte) and take one round trip; the IO layer moves the fd, this machine only says
which types need one (:func:`needs_fd`).

Events: a :class:`Message` per frame; after a ``data`` Message, its payload as
:class:`PayloadChunk` events and always one :class:`PayloadEnd` (even for an empty payload);
:class:`Rejected` (server role) for a whole frame whose fields break a rule, after which the
conversation goes on; :class:`ConnectionClosed` when the peer closed at a frame boundary;
``NEED_DATA`` when more bytes are needed. Input that breaks the framing or the order of
messages raises :class:`ProtocolError` and leaves the receiving side dead.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Final

from ckptdrain.client.framereader import FrameReader
from ckptdrain.client.frames import (
    MAGIC,
    MAX_HEADER_BYTES,
    NEED_DATA,
    PREFIX,
    PREFIX_BYTES,
    ConnectionClosed,
    Event,
    Message,
    PayloadChunk,
    PayloadEnd,
    Rejected,
    decode_header,
    encode_message,
)
from ckptdrain.client.messages import (
    ACK_MODES,
    BACKPRESSURE,
    BAD_REQUEST,
    CLIENT_MESSAGE_TYPES,
    CLOSED,
    CLOSED_IDLE,
    CLOSED_STALLED,
    CLOSED_TOO_SLOW,
    COMMITTED,
    DATA_KINDS,
    DESTINATION,
    DRAINING,
    DUPLICATE,
    ERROR_CODES,
    GENERATION_FAILED,
    INLINE_MAX_BYTES,
    INTERNAL,
    INVALID_NAME,
    MAX_ATTEMPT_CHARS,
    MAX_CLIENT_NAME_CHARS,
    MAX_PAYLOAD_BYTES,
    MAX_REASON_CHARS,
    MAX_TIMEOUT_S,
    NOT_FOUND,
    PERMISSION_DENIED,
    SERVER_MESSAGE_TYPES,
    SIZE_MISMATCH,
    TIMEOUT,
    UNAVAILABLE,
    UNSUPPORTED_VERSION,
    ProtocolError,
    needs_fd,
    schema_for,
    takes_payload,
    validate,
)

# The field rules live in messages.py, frames and their events in frames.py; their names are
# re-exported here because both sides speak the protocol through this module
# (``wire.BAD_REQUEST``, ``wire.ProtocolError``, ``wire.Message``).
__all__ = [
    "ACK_MODES", "BACKPRESSURE", "BAD_REQUEST", "CLIENT_MESSAGE_TYPES", "CLOSED",
    "CLOSED_IDLE", "CLOSED_STALLED", "CLOSED_TOO_SLOW", "COMMITTED",
    "DESTINATION", "DRAINING", "DUPLICATE", "ERROR_CODES", "GENERATION_FAILED",
    "INLINE_MAX_BYTES", "INTERNAL", "INVALID_NAME", "MAGIC", "MAX_ATTEMPT_CHARS",
    "MAX_CLIENT_NAME_CHARS", "MAX_HEADER_BYTES", "MAX_PAYLOAD_BYTES", "MAX_REASON_CHARS",
    "MAX_TIMEOUT_S", "NEED_DATA", "NOT_FOUND", "PERMISSION_DENIED", "PREFIX", "PREFIX_BYTES",
    "PROTOCOL_VERSION", "SERVER_MESSAGE_TYPES", "SIZE_MISMATCH", "TIMEOUT", "UNAVAILABLE",
    "UNSUPPORTED_VERSION", "Connection", "ConnectionClosed", "Event", "Message", "PayloadChunk",
    "PayloadEnd", "ProtocolError", "Rejected", "Role", "encode_message", "needs_fd",
    "takes_payload",
]

PROTOCOL_VERSION: Final = 1


class Role(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


class Connection(FrameReader):
    """One side of one connection: parses what the peer sends, frames what we send."""

    def __init__(self, role: Role) -> None:
        self.role = role
        self._peer_kinds = CLIENT_MESSAGE_TYPES if role is Role.SERVER else SERVER_MESSAGE_TYPES
        self._own_kinds = SERVER_MESSAGE_TYPES if role is Role.SERVER else CLIENT_MESSAGE_TYPES
        self._buf = bytearray()
        self._pos = 0
        self._eof = False
        self._closed = False
        self._failed: ProtocolError | None = None
        self._in_payload = False
        self._payload_left = 0
        self._received_any = False
        self._sent_any = False
        # Stream offsets (bytes since the connection began), so the IO layer can tell which
        # frame a passed fd arrived with: every byte fed or reported consumed, and where the
        # last Message or Rejected began.
        self._received = 0
        self._frame_start = 0
        # The two-phase put, tracked alike on both sides. _put_size: a put went out (client) or
        # came in (server) and its answer is not known yet. _data_size: the daemon answered it
        # ok, so the client's next frame must be its `data`, carrying exactly this many bytes.
        self._put_size: int | None = None
        self._data_size: int | None = None

    # --- receiving ---------------------------------------------------------------------------

    @property
    def awaiting_data(self) -> int | None:
        """The size the next ``data`` frame must have (after an accepted put), else None."""
        return self._data_size

    def _parse(self, header: bytes, payload_len: int) -> Message | Rejected:
        kind, fields = decode_header(header)
        if kind not in self._peer_kinds:
            schema_for(kind)  # raises "unknown message type" for a type nobody sends
            peer = "client" if self.role is Role.SERVER else "server"
            raise ProtocolError(BAD_REQUEST, f"message type {kind!r} is never sent by a {peer}")
        if self.role is Role.SERVER:
            if not self._received_any and kind != "hello":
                raise ProtocolError(
                    BAD_REQUEST, f"got {kind!r} before 'hello'; a client must say hello first"
                )
            if self._received_any and kind == "hello":
                raise ProtocolError(BAD_REQUEST, "second 'hello' on one connection")
        else:
            if not self._received_any and kind not in ("welcome", "error"):
                raise ProtocolError(
                    BAD_REQUEST, f"got {kind!r} before 'welcome'; a server must answer hello first"
                )
            if self._received_any and kind == "welcome":
                raise ProtocolError(BAD_REQUEST, "second 'welcome' on one connection")
        if self.role is Role.SERVER:
            self._check_client_frame(kind, payload_len)
            try:
                checked = validate(kind, fields, payload_len, outgoing=False)
            except ProtocolError as exc:
                # The frame is whole and consumed: a bad field is one refused request, not a
                # broken stream. Unless bytes follow it (a payload), nothing was agreed yet, or
                # it is the data frame an admitted put waits for.
                if kind == "hello" or kind in DATA_KINDS or payload_len:
                    raise
                self._received_any = True
                return Rejected(kind, exc.code, exc.message)
            self._client_frame_done(kind, checked)
        else:
            checked = validate(kind, fields, payload_len, outgoing=False)
            self._server_frame_done(kind)
        self._received_any = True
        return Message(kind, checked, payload_len)

    def _check_client_frame(self, kind: str, payload_len: int) -> None:
        if self._data_size is not None:
            if kind not in DATA_KINDS:
                raise ProtocolError(
                    BAD_REQUEST,
                    f"expected the 'data' frame of the accepted put, got {kind!r}; "
                    "send the shard's bytes right after the daemon's 'ok' to its put",
                )
            if kind == "data" and payload_len != self._data_size:
                raise ProtocolError(
                    SIZE_MISMATCH,
                    f"the put declared {self._data_size} bytes but its 'data' frame carries "
                    f"{payload_len}; they must be equal",
                )
        elif kind in DATA_KINDS:
            raise ProtocolError(
                BAD_REQUEST,
                f"{kind!r} frame without a put the daemon accepted; send 'put' and wait for "
                "its 'ok' first",
            )

    def _client_frame_done(self, kind: str, fields: Mapping[str, Any]) -> None:
        if kind in DATA_KINDS:
            self._data_size = None
        elif kind == "put":
            self._put_size = fields["size"]

    def _server_frame_done(self, kind: str) -> None:
        if self._put_size is not None:
            if kind == "ok":
                self._data_size = self._put_size
            self._put_size = None

    # --- sending -----------------------------------------------------------------------------

    def send(
        self, kind: str, fields: Mapping[str, Any] | None = None, payload_len: int = 0
    ) -> bytes:
        """The prefix and header bytes of a message; the caller writes its payload after them."""
        if kind not in self._own_kinds:
            schema_for(kind)
            raise ProtocolError(BAD_REQUEST, f"a {self.role.value} does not send {kind!r} messages")
        if self.role is Role.CLIENT:
            if not self._sent_any and kind != "hello":
                raise ProtocolError(BAD_REQUEST, f"send 'hello' before {kind!r}")
            if self._sent_any and kind == "hello":
                raise ProtocolError(BAD_REQUEST, "'hello' was already sent on this connection")
        else:
            if not self._sent_any and kind not in ("welcome", "error"):
                raise ProtocolError(BAD_REQUEST, f"send 'welcome' or 'error' before {kind!r}")
            if self._sent_any and kind == "welcome":
                raise ProtocolError(BAD_REQUEST, "'welcome' was already sent on this connection")
            if kind == "error" and fields is not None and fields.get("code") not in ERROR_CODES:
                raise ProtocolError(
                    BAD_REQUEST,
                    f"error code {fields.get('code')!r} is not one of {sorted(ERROR_CODES)}",
                )
        if self.role is Role.CLIENT:
            self._check_client_frame(kind, payload_len)
        data = encode_message(kind, fields, payload_len)
        if self.role is Role.CLIENT:
            self._client_frame_done(kind, fields or {})
        else:
            self._server_frame_done(kind)
        self._sent_any = True
        return data

    def send_error(self, code: str, message: str, details: dict[str, Any] | None = None) -> bytes:
        """An ``error`` frame (server role): ``code`` from ERROR_CODES, one clear sentence."""
        return self.send("error", {"code": code, "message": message, "details": details})
