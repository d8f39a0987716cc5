"""The receiving side of a connection: the bytes fed in from the peer, the frames cut from
them (a prefix, a header, a ``data`` frame's payload as chunks or read past the buffer by the
IO layer), the stream offsets that tell which frame a passed fd came with, and the end of the
stream (closed at a frame boundary, or truncated). Input that breaks the framing leaves it
dead for good.

The base of :class:`~ckptdrain.client.wire.Connection`, which owns the order of messages
(each frame's header is checked there, by ``_parse``) and the sending side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

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
    Sentinel,
)
from ckptdrain.client.messages import BAD_REQUEST, MAX_PAYLOAD_BYTES, PAYLOAD_KINDS, ProtocolError

# Once this much consumed data sits before the read offset, it is dropped from the buffer:
# compacting on every event would copy the tail each time (quadratic on many small frames).
_COMPACT_BYTES = 64 * 1024


class FrameReader:
    """A connection's received bytes and the frames cut from them (the base of
    :class:`~ckptdrain.client.wire.Connection`, which sets these)."""

    _buf: bytearray
    _pos: int
    _eof: bool
    _closed: bool
    _failed: ProtocolError | None
    _in_payload: bool
    _payload_left: int
    _received: int
    _frame_start: int

    if TYPE_CHECKING:  # the connection's: the order of messages
        def _parse(self, header: bytes, payload_len: int) -> Message | Rejected: ...

    @property
    def received_bytes(self) -> int:
        """Bytes received so far (fed with receive_data or reported with payload_consumed)."""
        return self._received

    @property
    def frame_start(self) -> int:
        """The stream offset of the first byte of the last Message or Rejected returned."""
        return self._frame_start

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as events."""
        return len(self._buf) - self._pos

    @property
    def payload_remaining(self) -> int:
        """Payload bytes of the current ``data`` frame not yet returned or consumed."""
        return self._payload_left if self._in_payload else 0

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Feed bytes from the peer; ``b""`` means the peer closed its side (EOF)."""
        self._raise_if_failed()
        if self._eof:
            raise RuntimeError("receive_data() after EOF was already fed")
        if len(data) == 0:
            self._eof = True
            return
        # Copy: the caller reuses its receive buffer as soon as this returns.
        self._buf += data
        self._received += len(data)

    def payload_consumed(self, n: int) -> None:
        """Record that the IO layer read ``n`` payload bytes itself, bypassing this machine.

        Only while ``buffered == 0`` and for at most ``payload_remaining`` bytes; the IO layer
        reads straight into its own reused buffer (no copy through here). The next event is
        PayloadEnd once the payload is done.
        """
        self._raise_if_failed()
        if not self._in_payload:
            raise RuntimeError("payload_consumed() outside a payload")
        if self.buffered:
            raise RuntimeError(
                f"payload_consumed() with {self.buffered} bytes still buffered; "
                "take them with next_event() first"
            )
        if not 0 <= n <= self._payload_left:
            raise RuntimeError(f"payload_consumed({n}) but only {self._payload_left} bytes remain")
        self._payload_left -= n
        self._received += n

    def next_event(self) -> Event | Literal[Sentinel.NEED_DATA]:
        """The next event, or NEED_DATA. Raises ProtocolError on input that breaks the framing
        or the order of messages, for good; a bad field of one request is a Rejected event."""
        self._raise_if_failed()
        try:
            return self._next_event()
        except ProtocolError as exc:
            self._failed = exc
            self._buf = bytearray()
            self._pos = 0
            raise

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise ProtocolError(
                self._failed.code, f"connection already failed: {self._failed.message}"
            )

    def _truncated(self, where: str) -> ProtocolError:
        return ProtocolError(
            BAD_REQUEST, f"connection closed in the middle of {where} (truncated frame)",
            truncated=True,
        )

    def _next_event(self) -> Event | Literal[Sentinel.NEED_DATA]:
        if self._in_payload:
            return self._payload_event()
        if self._closed:
            return ConnectionClosed()
        available = self.buffered
        if available < PREFIX_BYTES:
            # Fail fast on a wrong magic rather than waiting for a prefix that never comes.
            seen = min(available, len(MAGIC))
            if self._buf[self._pos : self._pos + seen] != MAGIC[:seen]:
                raise self._bad_magic()
            if not self._eof:
                return NEED_DATA
            if available:
                raise self._truncated("a frame prefix")
            self._closed = True
            self._buf = bytearray()
            self._pos = 0
            return ConnectionClosed()
        magic, header_len, payload_len = PREFIX.unpack_from(self._buf, self._pos)
        if magic != MAGIC:
            raise self._bad_magic()
        if header_len > MAX_HEADER_BYTES:
            raise ProtocolError(
                BAD_REQUEST,
                f"oversize header: {header_len} bytes declared, limit {MAX_HEADER_BYTES}",
            )
        if payload_len > MAX_PAYLOAD_BYTES:
            raise ProtocolError(
                BAD_REQUEST,
                f"oversize payload: {payload_len} bytes declared, limit {MAX_PAYLOAD_BYTES}",
            )
        if available < PREFIX_BYTES + header_len:
            if self._eof:
                raise self._truncated("a frame header")
            return NEED_DATA
        frame_start = self._received - self.buffered
        start = self._pos + PREFIX_BYTES
        with memoryview(self._buf) as view:
            header = bytes(view[start : start + header_len])
        self._pos = start + header_len
        self._frame_start = frame_start
        message = self._parse(header, payload_len)
        self._compact()
        if isinstance(message, Message) and message.kind in PAYLOAD_KINDS:
            self._in_payload = True
            self._payload_left = payload_len
        return message

    def _payload_event(self) -> PayloadChunk | PayloadEnd | Literal[Sentinel.NEED_DATA]:
        if self._payload_left == 0:
            self._in_payload = False
            return PayloadEnd()
        available = self.buffered
        if available == 0:
            if self._eof:
                raise self._truncated(f"a payload ({self._payload_left} bytes missing)")
            return NEED_DATA
        n = min(available, self._payload_left)
        with memoryview(self._buf) as view:
            # A copy the caller owns: a view into _buf would stop it from growing or shrinking.
            data = bytes(view[self._pos : self._pos + n])
        self._pos += n
        self._payload_left -= n
        self._compact()
        return PayloadChunk(memoryview(data))

    def _compact(self) -> None:
        if self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        elif self._pos >= _COMPACT_BYTES and self._pos * 2 >= len(self._buf):
            del self._buf[: self._pos]
            self._pos = 0

    def _bad_magic(self) -> ProtocolError:
        got = bytes(self._buf[self._pos : self._pos + len(MAGIC)])
        return ProtocolError(
            BAD_REQUEST,
            f"bad magic {got!r} (expected {MAGIC!r}): the peer does not speak the ckptdrain protocol",
        )
