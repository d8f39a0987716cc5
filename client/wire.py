"""The ckptdrain wire protocol as a pure state machine (sans-IO, in the style of h11).

No sockets here: the IO layer feeds received bytes in with :meth:`Connection.receive_data`,
pulls events out with :meth:`Connection.next_event`, and writes the bytes :meth:`Connection.send`
returns. The same machine serves the blocking client (CLIENT role) and the asyncio daemon
(SERVER role), so both sides agree on every rule by construction.

Frame (both directions)::

    +------+------------+-------------+------------------------+---------------------+
    | CKD1 | header_len | payload_len | header: UTF-8 JSON obj | payload (raw bytes) |
    | 4 B  | u32 BE     | u64 BE      | header_len bytes       | payload_len bytes   |
    +------+------------+-------------+------------------------+---------------------+

The header is a JSON object whose ``"type"`` names the message; the other keys are its fields.

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
import json
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from ckptdrain.client import names
from ckptdrain.client.errors import InvalidName, RejectedInput

PROTOCOL_VERSION: Final = 1
MAGIC: Final = b"CKD1"
PREFIX: Final = struct.Struct(">4sIQ")
PREFIX_BYTES: Final = PREFIX.size  # 16
MAX_HEADER_BYTES: Final = 64 * 1024
MAX_PAYLOAD_BYTES: Final = 1 << 44
# The largest shard a ``put_bytes`` frame carries. A daemon holds that much of a connection's
# bytes before it has admitted them (while it waits for room, too), on top of the connection's
# receive buffer: small, so that this stays a fraction of what a connection costs anyway.
INLINE_MAX_BYTES: Final = 256 * 1024

# Error codes: the same strings as ``code`` on the classes in ckptdrain.client.errors.
BAD_REQUEST: Final = "bad_request"
INVALID_NAME: Final = "invalid_name"
DUPLICATE: Final = "duplicate"
SIZE_MISMATCH: Final = "size_mismatch"
BACKPRESSURE: Final = "backpressure"
PERMISSION_DENIED: Final = "permission_denied"
GENERATION_FAILED: Final = "generation_failed"
NOT_FOUND: Final = "not_found"
TIMEOUT: Final = "timeout"
UNSUPPORTED_VERSION: Final = "unsupported_version"
UNAVAILABLE: Final = "unavailable"
INTERNAL: Final = "internal"
# The step is committed at the destination: it can never be saved again.
COMMITTED: Final = "committed"
# The destination could not be read or holds something damaged (wait, latest).
DESTINATION: Final = "destination"
# The node is being drained for maintenance (`ckptdrain drain`): no new generation here.
DRAINING: Final = "draining"
ERROR_CODES: Final = frozenset(
    {
        DRAINING,
        COMMITTED,
        DESTINATION,
        BAD_REQUEST,
        INVALID_NAME,
        DUPLICATE,
        SIZE_MISMATCH,
        BACKPRESSURE,
        PERMISSION_DENIED,
        GENERATION_FAILED,
        NOT_FOUND,
        TIMEOUT,
        UNSUPPORTED_VERSION,
        UNAVAILABLE,
        INTERNAL,
    }
)

ACK_MODES: Final = ("local", "memory")

# Once this much consumed data sits before the read offset, it is dropped from the buffer:
# compacting on every event would copy the tail each time (quadratic on many small frames).
_COMPACT_BYTES = 64 * 1024


class Role(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


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


class _Sentinel(enum.Enum):
    NEED_DATA = "NEED_DATA"

    def __repr__(self) -> str:
        return self.value


NEED_DATA: Final = _Sentinel.NEED_DATA
"""next_event() returns this when it needs more bytes from receive_data()."""

Event = Message | Rejected | PayloadChunk | PayloadEnd | ConnectionClosed


class ProtocolError(Exception):
    """The peer (or the caller, on send) broke the protocol; ``code`` is an error code above."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# ---------------------------------------------------------------------------------------------
# Message schemas. A checker raises ProtocolError naming the message, the field and the rule.

_Checker = Callable[[str, str, Any], None]


def _type_error(kind: str, name: str, expected: str, value: Any) -> ProtocolError:
    return ProtocolError(
        BAD_REQUEST, f"{kind!r} field {name!r} must be {expected}, not {type(value).__name__}"
    )


def _is_int(value: Any) -> bool:
    # bool is an int subclass in Python and JSON true/false arrive as bool: reject them.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_str(kind: str, name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise _type_error(kind, name, "a string", value)


def _check_dict(kind: str, name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise _type_error(kind, name, "a JSON object", value)


MAX_VERSION: Final = 0xFFFF


def _check_version(kind: str, name: str, value: Any) -> None:
    if not _is_int(value) or not 0 <= value <= MAX_VERSION:
        raise ProtocolError(
            BAD_REQUEST, f"{kind!r} field {name!r} must be an integer from 0 to {MAX_VERSION}"
        )


def _check_size(kind: str, name: str, value: Any) -> None:
    if not _is_int(value):
        raise _type_error(kind, name, "an integer", value)
    if not 0 <= value <= MAX_PAYLOAD_BYTES:
        raise ProtocolError(
            BAD_REQUEST, f"{kind!r} size {value} is out of range; use 0..{MAX_PAYLOAD_BYTES}"
        )


# The longest a request may ask the daemon to wait (a day): larger values only overflow the
# timers they end up in (a 400-digit integer is not a float at all).
MAX_TIMEOUT_S: Final = 86_400


def _check_timeout(kind: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _type_error(kind, name, "a number of seconds", value)
    # Compared as what it is: an int that big has no float, and math.isfinite() overflows.
    if (isinstance(value, float) and not math.isfinite(value)) or not 0 <= value <= MAX_TIMEOUT_S:
        shown = f"{value}" if len(str(value)) <= 40 else f"{str(value)[:20]}... (too long)"
        raise ProtocolError(
            BAD_REQUEST,
            f"{kind!r} field {name!r} is {shown}; use a finite number from 0 to {MAX_TIMEOUT_S}",
        )


def _check_ack(kind: str, name: str, value: Any) -> None:
    if value not in ACK_MODES:
        raise ProtocolError(
            BAD_REQUEST, f"{kind!r} field {name!r} is {value!r}; use one of {list(ACK_MODES)}"
        )


MAX_ATTEMPT_CHARS = 128


def _check_attempt(kind: str, name: str, value: Any) -> None:
    if not isinstance(value, str) or len(value) > MAX_ATTEMPT_CHARS or not value.isprintable():
        raise ProtocolError(
            BAD_REQUEST,
            f"{kind!r} field {name!r} must be printable text of at most {MAX_ATTEMPT_CHARS} "
            "characters",
        )


def _text_checker(limit: int) -> _Checker:
    """A string of at most ``limit`` characters: free text (a reason, a client's name) is
    stored, logged and shown in status, so its length is bounded where it enters."""

    def check(kind: str, name: str, value: Any) -> None:
        if not isinstance(value, str):
            raise _type_error(kind, name, "a string", value)
        if len(value) > limit:
            raise ProtocolError(
                BAD_REQUEST,
                f"{kind!r} field {name!r} is {len(value)} characters, over the limit of {limit}; "
                "send a shorter text",
            )

    return check


MAX_REASON_CHARS: Final = 1000
MAX_CLIENT_NAME_CHARS: Final = 256
_reason = _text_checker(MAX_REASON_CHARS)
_client_name = _text_checker(MAX_CLIENT_NAME_CHARS)


def _check_source(kind: str, name: str, value: Any) -> None:
    if value not in ("local", "destination"):
        raise ProtocolError(
            BAD_REQUEST, f"{kind!r} field {name!r} is {value!r}; use 'local' or 'destination'"
        )


def _check_bool(kind: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _type_error(kind, name, "true or false", value)


def _names_checker(validate: Callable[[object], object]) -> _Checker:
    """Run a names.py rule, turning its typed error into the matching wire error code."""

    def check(kind: str, name: str, value: Any) -> None:
        try:
            validate(value)
        except InvalidName as exc:
            raise ProtocolError(INVALID_NAME, exc.message) from None
        except RejectedInput as exc:
            raise ProtocolError(BAD_REQUEST, f"{kind!r}: {exc.message}") from None

    return check


def _any_rank(value: object) -> object:
    # Messages after begin carry no world_size; the daemon checks the rank against the one
    # its generation began with. Here: only that it could be a rank at all.
    return names.validate_rank(value, names.MAX_WORLD_SIZE)


_job = _names_checker(names.validate_job)
_path = _names_checker(names.validate_shard_path)
_step = _names_checker(names.validate_step)
_world_size = _names_checker(names.validate_world_size)
_rank = _names_checker(_any_rank)

# kind -> field -> (checker, required). None: any JSON fields (only "ok").
_Schema = dict[str, tuple[_Checker, bool]]
_SHARD: _Schema = {
    "job": (_job, True),
    "step": (_step, True),
    "rank": (_rank, True),
    "path": (_path, True),
    "size": (_check_size, True),
    # Deferred: drained only once every rank's shards are at the destination, right before
    # the manifest (e.g. DCP's .metadata, which makes a directory loadable on its own).
    "deferred": (_check_bool, False),
}
_CLIENT_KINDS: dict[str, _Schema] = {
    "hello": {"version": (_check_version, True), "client": (_client_name, False)},
    "begin": {
        "job": (_job, True),
        "step": (_step, True),
        "rank": (_rank, True),
        "world_size": (_world_size, True),
        "ack": (_check_ack, False),
        # Names one attempt at saving this step (all ranks of the attempt send the same):
        # a new attempt at an uncommitted step replaces the old one instead of failing.
        "attempt": (_check_attempt, False),
    },
    "put": _SHARD,
    "data": {},
    # The admitted put's bytes through a pipe instead: its read end rides with the frame and
    # the client vmsplice()s its buffer into the write end (offered by the put's `ok`).
    "data_pipe": {},
    "put_bytes": _SHARD,
    "put_fd": _SHARD,
    "put_memfd": _SHARD,
    "seal": {"job": (_job, True), "step": (_step, True), "rank": (_rank, True)},
    "abort": {
        "job": (_job, True),
        "step": (_step, True),
        "rank": (_rank, True),
        "reason": (_reason, True),
    },
    "wait": {
        "job": (_job, True),
        "step": (_step, True),
        "timeout_s": (_check_timeout, True),
        # The waiter's attempt: an older attempt's failure is not its answer (it waits for
        # the re-save). An attempt "A/x" is one of attempt "A"'s.
        "attempt": (_check_attempt, False),
    },
    "latest": {"job": (_job, True)},
    "status": {"job": (_job, False)},  # job: only that job's generations
    "retry": {"job": (_job, True), "step": (_step, True)},
    # Restore's fast path: the daemon copies its local copy of a shard into the file whose
    # (writable) fd travels with the frame, and answers with the checksum of what it wrote.
    "fetch": {
        "job": (_job, True),
        "step": (_step, True),
        "path": (_path, True),
        # "local" (default): this node's local copy; "destination": the daemon reads the
        # committed shard from the destination and checks it against the manifest.
        "source": (_check_source, False),
    },
    # A reader's fast path: the daemon checks its local copy of a committed shard against
    # the manifest and answers `ok` with a read-only fd of it on the reply frame.
    "open": {"job": (_job, True), "step": (_step, True), "path": (_path, True)},
    # Operators (`ckptdrain drain / resume / abort`): take the node out of service and back,
    # and end one generation on this node.
    "drain": {},
    "resume": {},
    "abort_generation": {"job": (_job, True), "step": (_step, True),
                         "reason": (_reason, False)},
}
_SERVER_KINDS: dict[str, _Schema | None] = {
    "welcome": {"version": (_check_version, True), "node_id": (_check_str, True)},
    "ok": None,
    "error": {
        "code": (_check_str, True),
        "message": (_check_str, True),
        "details": (_check_dict, False),
    },
}
_PAYLOAD_KINDS: Final = frozenset({"data", "put_bytes"})
_FD_KINDS: Final = frozenset({"put_fd", "put_memfd", "fetch", "data_pipe"})
# What an accepted put's next frame may be.
_DATA_KINDS: Final = frozenset({"data", "data_pipe"})

CLIENT_MESSAGE_TYPES: Final = frozenset(_CLIENT_KINDS)
SERVER_MESSAGE_TYPES: Final = frozenset(_SERVER_KINDS)


def needs_fd(kind: str) -> bool:
    """Whether a frame of this type carries exactly one file descriptor (SCM_RIGHTS)."""
    return kind in _FD_KINDS


def takes_payload(kind: str) -> bool:
    """Whether a frame of this type carries payload bytes after its header."""
    return kind in _PAYLOAD_KINDS


def _schema_for(kind: str) -> _Schema | None:
    if kind in _CLIENT_KINDS:
        return _CLIENT_KINDS[kind]
    if kind in _SERVER_KINDS:
        return _SERVER_KINDS[kind]
    raise ProtocolError(
        BAD_REQUEST,
        f"unknown message type {kind!r}; known types: {sorted(_CLIENT_KINDS) + sorted(_SERVER_KINDS)}",
    )


def _validate(
    kind: str, fields: Mapping[str, Any], payload_len: int, *, outgoing: bool
) -> dict[str, Any]:
    """The checked fields of a message (outgoing: optional fields set to None are dropped)."""
    schema = _schema_for(kind)
    if not _is_int(payload_len) or not 0 <= payload_len <= MAX_PAYLOAD_BYTES:
        raise ProtocolError(
            BAD_REQUEST,
            f"payload length {payload_len!r} is out of range; use 0..{MAX_PAYLOAD_BYTES}",
        )
    if payload_len and kind not in _PAYLOAD_KINDS:
        raise ProtocolError(
            BAD_REQUEST, f"{kind!r} carries no payload but the frame declares {payload_len} bytes"
        )
    if schema is None:
        if "type" in fields:
            raise ProtocolError(BAD_REQUEST, f"{kind!r} may not carry a field named 'type'")
        return dict(fields)
    checked: dict[str, Any] = {}
    for name, value in fields.items():
        if name not in schema:
            raise ProtocolError(
                BAD_REQUEST, f"{kind!r} has unknown field {name!r}; allowed: {sorted(schema)}"
            )
        checker, required = schema[name]
        if value is None and outgoing and not required:
            continue
        checker(kind, name, value)
        checked[name] = value
    for name, (_checker, required) in schema.items():
        if required and name not in checked:
            raise ProtocolError(BAD_REQUEST, f"{kind!r} is missing required field {name!r}")
    if kind == "put_bytes":
        if max(payload_len, checked["size"]) > INLINE_MAX_BYTES:
            raise ProtocolError(
                BAD_REQUEST,
                f"'put_bytes' carries at most {INLINE_MAX_BYTES} bytes, not "
                f"{max(payload_len, checked['size'])}; send a larger shard with 'put' and then "
                "its 'data'",
            )
        if payload_len != checked["size"]:
            raise ProtocolError(
                SIZE_MISMATCH,
                f"'put_bytes' declares {checked['size']} bytes but carries {payload_len}; they "
                "must be equal",
            )
    if kind == "begin":
        try:
            names.validate_rank(checked["rank"], checked["world_size"])
        except RejectedInput as exc:
            raise ProtocolError(BAD_REQUEST, f"'begin': {exc.message}") from None
    return checked


def encode_message(
    kind: str, fields: Mapping[str, Any] | None = None, payload_len: int = 0
) -> bytes:
    """The prefix and header bytes of one frame (the caller sends ``payload_len`` bytes after)."""
    checked = _validate(kind, fields or {}, payload_len, outgoing=True)
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


def _decode_header(header: bytes) -> tuple[str, dict[str, Any]]:
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


class Connection:
    """One side of one connection: parses what the peer sends, frames what we send."""

    def __init__(self, role: Role) -> None:
        self.role = role
        self._peer_kinds = _CLIENT_KINDS.keys() if role is Role.SERVER else _SERVER_KINDS.keys()
        self._own_kinds = _SERVER_KINDS.keys() if role is Role.SERVER else _CLIENT_KINDS.keys()
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

    def next_event(self) -> Event | Literal[_Sentinel.NEED_DATA]:
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
            BAD_REQUEST, f"connection closed in the middle of {where} (truncated frame)"
        )

    def _next_event(self) -> Event | Literal[_Sentinel.NEED_DATA]:
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
        if isinstance(message, Message) and message.kind in _PAYLOAD_KINDS:
            self._in_payload = True
            self._payload_left = payload_len
        return message

    def _payload_event(self) -> PayloadChunk | PayloadEnd | Literal[_Sentinel.NEED_DATA]:
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

    def _parse(self, header: bytes, payload_len: int) -> Message | Rejected:
        kind, fields = _decode_header(header)
        if kind not in self._peer_kinds:
            _schema_for(kind)  # raises "unknown message type" for a type nobody sends
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
                checked = _validate(kind, fields, payload_len, outgoing=False)
            except ProtocolError as exc:
                # The frame is whole and consumed: a bad field is one refused request, not a
                # broken stream. Unless bytes follow it (a payload), nothing was agreed yet, or
                # it is the data frame an admitted put waits for.
                if kind == "hello" or kind in _DATA_KINDS or payload_len:
                    raise
                self._received_any = True
                return Rejected(kind, exc.code, exc.message)
            self._client_frame_done(kind, checked)
        else:
            checked = _validate(kind, fields, payload_len, outgoing=False)
            self._server_frame_done(kind)
        self._received_any = True
        return Message(kind, checked, payload_len)

    def _check_client_frame(self, kind: str, payload_len: int) -> None:
        if self._data_size is not None:
            if kind not in _DATA_KINDS:
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
        elif kind in _DATA_KINDS:
            raise ProtocolError(
                BAD_REQUEST,
                f"{kind!r} frame without a put the daemon accepted; send 'put' and wait for "
                "its 'ok' first",
            )

    def _client_frame_done(self, kind: str, fields: Mapping[str, Any]) -> None:
        if kind in _DATA_KINDS:
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
            _schema_for(kind)
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
