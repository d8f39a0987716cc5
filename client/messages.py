"""What each message type of the wire protocol may carry, checked the same on both sides.

One schema per message type: its fields, which are required, and the rule each field's value
must meet (names through :mod:`ckptdrain.client.names`, sizes, timeouts, the ack mode). The
framing and the order of messages live in :mod:`ckptdrain.client.wire`; a frame whose fields
break a rule here is refused with a :class:`ProtocolError` naming the message, the field and
the rule, before anything acts on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Final

from ckptdrain.client import names
from ckptdrain.client.errors import InvalidName, RejectedInput

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
# ``details.closed`` of the ``timeout`` error a daemon sends as its last word before hanging up
# on a connection that went quiet (the message says the same to a person, in words that may
# change; a client decides by this field). CLOSED_IDLE: nothing of a request had come since the
# last reply, so a request sent as it hung up was never read, nor acted on, and may go again on
# a new connection. CLOSED_STALLED: a frame begun, or a shard's bytes due, stopped coming for the
# idle timeout; CLOSED_TOO_SLOW: they came slower than the minimum rate.
CLOSED: Final = "closed"
CLOSED_IDLE: Final = "idle"
CLOSED_STALLED: Final = "stalled"
CLOSED_TOO_SLOW: Final = "too_slow"
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


class ProtocolError(Exception):
    """The peer (or the caller, on send) broke the protocol; ``code`` is an error code above."""

    def __init__(self, code: str, message: str, *, truncated: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        # The peer closed its end in the middle of a frame: a hang-up (a killed process),
        # not a frame it got wrong.
        self.truncated = truncated


# A checker raises ProtocolError naming the message, the field and the rule.

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
PAYLOAD_KINDS: Final = frozenset({"data", "put_bytes"})
FD_KINDS: Final = frozenset({"put_fd", "put_memfd", "fetch", "data_pipe"})
# What an accepted put's next frame may be.
DATA_KINDS: Final = frozenset({"data", "data_pipe"})

CLIENT_MESSAGE_TYPES: Final = frozenset(_CLIENT_KINDS)
SERVER_MESSAGE_TYPES: Final = frozenset(_SERVER_KINDS)


def needs_fd(kind: str) -> bool:
    """Whether a frame of this type carries exactly one file descriptor (SCM_RIGHTS)."""
    return kind in FD_KINDS


def takes_payload(kind: str) -> bool:
    """Whether a frame of this type carries payload bytes after its header."""
    return kind in PAYLOAD_KINDS


def schema_for(kind: str) -> _Schema | None:
    if kind in _CLIENT_KINDS:
        return _CLIENT_KINDS[kind]
    if kind in _SERVER_KINDS:
        return _SERVER_KINDS[kind]
    raise ProtocolError(
        BAD_REQUEST,
        f"unknown message type {kind!r}; known types: {sorted(_CLIENT_KINDS) + sorted(_SERVER_KINDS)}",
    )


def validate(
    kind: str, fields: Mapping[str, Any], payload_len: int, *, outgoing: bool
) -> dict[str, Any]:
    """The checked fields of a message (outgoing: optional fields set to None are dropped)."""
    schema = schema_for(kind)
    if not _is_int(payload_len) or not 0 <= payload_len <= MAX_PAYLOAD_BYTES:
        raise ProtocolError(
            BAD_REQUEST,
            f"payload length {payload_len!r} is out of range; use 0..{MAX_PAYLOAD_BYTES}",
        )
    if payload_len and kind not in PAYLOAD_KINDS:
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
