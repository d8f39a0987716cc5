"""Property tests of the wire machine: whatever bytes arrive, split wherever, it only ever
returns events (whose fields are within what every layer of the daemon stores) or raises its
own ProtocolError. Any other exception is a request that could kill the daemon."""

from __future__ import annotations

import json
import struct
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptdrain.client import names, wire
from ckptdrain.client.wire import (
    NEED_DATA,
    Connection,
    ConnectionClosed,
    Message,
    PayloadChunk,
    PayloadEnd,
    ProtocolError,
    Rejected,
    Role,
)

SETTINGS = settings(
    max_examples=400, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
INT64_MAX = 2**63 - 1

JOB = {"job": "j", "step": 7, "rank": 0}
VALID: list[dict[str, Any]] = [
    {"type": "begin", **JOB, "world_size": 4, "ack": "local", "attempt": "a1"},
    {"type": "put", **JOB, "path": "a/b.bin", "size": 3},
    {"type": "data"},
    {"type": "put_bytes", **JOB, "path": "s.bin", "size": 0},
    {"type": "put_fd", **JOB, "path": "c.bin", "size": 10},
    {"type": "put_memfd", **JOB, "path": "d.bin", "size": 0, "deferred": True},
    {"type": "seal", **JOB},
    {"type": "abort", **JOB, "reason": "KeyboardInterrupt"},
    {"type": "wait", "job": "j", "step": 7, "timeout_s": 1.5},
    {"type": "latest", "job": "j"},
    {"type": "status"},
    {"type": "retry", "job": "j", "step": 7},
    {"type": "fetch", "job": "j", "step": 7, "path": "a/b.bin"},
]

# What a hostile client puts in a field: every JSON type, and the sizes that overflow.
json_scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**400, 10**19]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40), st.text(alphabet="a/._-", max_size=3000),
)
# Just past (and at) what each layer stores: int64, the payload limit, timers, text caps.
edges = st.sampled_from([
    2**63 - 1, 2**63, 2**64, -1, 10**400, 1e308, -0.0, 86_400, 86_401, 1 << 44, (1 << 44) + 1,
    1_000_000, 1_000_001, "r" * 1001, "r" * 5000, "a" * 129, "x/" * 600, "\x00", "..",
])
json_values = st.one_of(edges, st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
))
FIELD_NAMES = sorted({k for m in VALID for k in m} - {"type"} | {"version", "client", "evil"})


@st.composite
def mutated_header(draw: st.DrawFn) -> dict[str, Any]:
    header = dict(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.sampled_from(["set", "drop", "type"]))
        if action == "set":
            # Mostly a field the message has (so the rest of it passes), sometimes any name.
            keys = sorted(k for k in header if k != "type") or FIELD_NAMES
            key = draw(st.sampled_from(keys) | st.sampled_from(FIELD_NAMES))
            header[key] = draw(json_values)
        elif action == "drop" and len(header) > 1:
            header.pop(draw(st.sampled_from(sorted(header))))
        else:
            header["type"] = draw(st.sampled_from([*sorted(wire.CLIENT_MESSAGE_TYPES),
                                                    "welcome", "ok", "error", "nope"]))
    return header


def encode(header: Any, payload: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack(">4sIQ", wire.MAGIC, len(raw), len(payload)) + raw + payload


@st.composite
def client_stream(draw: st.DrawFn) -> bytes:
    frames = [encode({"type": "hello", "version": 1}, b"")]
    for _ in range(draw(st.integers(1, 6))):
        header = draw(mutated_header())
        payload = b"abc" if header.get("type") == "data" and draw(st.booleans()) else b""
        frames.append(encode(header, payload))
    stream = bytearray(b"".join(frames))
    # Byte-level damage too: flips, cuts and junk anywhere (the prefix included).
    for _ in range(draw(st.integers(0, 3))):
        if not stream:
            break
        at = draw(st.integers(0, len(stream) - 1))
        action = draw(st.sampled_from(["flip", "cut", "insert"]))
        if action == "flip":
            stream[at] ^= 1 << draw(st.integers(0, 7))
        elif action == "cut":
            del stream[at : at + draw(st.integers(1, 8))]
        else:
            stream[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(stream)


def split(data: bytes, points: list[int]) -> list[bytes]:
    cuts = sorted({p % (len(data) + 1) for p in points})
    chunks, last = [], 0
    for cut in [*cuts, len(data)]:
        if cut > last:
            chunks.append(data[last:cut])
            last = cut
    return chunks


def check_bounded(message: Message) -> None:
    """What the daemon stores of a message fits: int64 steps, bounded sizes and texts."""
    f = message.fields
    if "step" in f:
        assert 0 <= f["step"] <= INT64_MAX
    if "rank" in f:
        assert 0 <= f["rank"] < names.MAX_WORLD_SIZE
    if "world_size" in f:
        assert 1 <= f["world_size"] <= names.MAX_WORLD_SIZE
    if "size" in f:
        assert 0 <= f["size"] <= wire.MAX_PAYLOAD_BYTES
    if "timeout_s" in f:
        assert 0 <= f["timeout_s"] <= wire.MAX_TIMEOUT_S
        float(f["timeout_s"])  # no OverflowError
    for key, limit in (("reason", wire.MAX_REASON_CHARS), ("attempt", wire.MAX_ATTEMPT_CHARS),
                       ("client", wire.MAX_CLIENT_NAME_CHARS), ("job", names.MAX_JOB_BYTES),
                       ("path", names.MAX_PATH_BYTES)):
        if key in f:
            assert isinstance(f[key], str) and len(f[key]) <= limit


def run_server(chunks: list[bytes], eof: bool) -> list[Any]:
    """Feed a SERVER machine as the daemon does, answering each request; every event it
    returns is checked; a ProtocolError ends the run (and the machine can still say why)."""
    conn = Connection(Role.SERVER)
    events: list[Any] = []
    try:
        for chunk in [*chunks, *([b""] if eof else [])]:
            conn.receive_data(chunk)
            while (event := conn.next_event()) is not NEED_DATA:
                assert isinstance(event, Message | Rejected | PayloadChunk | PayloadEnd
                                  | ConnectionClosed), event
                events.append(event)
                if isinstance(event, ConnectionClosed):
                    return events
                if isinstance(event, Rejected):
                    assert event.code in wire.ERROR_CODES
                    conn.send_error(event.code, event.message)
                elif isinstance(event, Message):
                    check_bounded(event)
                    if event.kind == "hello":
                        conn.send("welcome", {"version": 1, "node_id": "n"})
                    elif event.kind != "data":
                        conn.send("ok", {"ready": True})
                elif isinstance(event, PayloadEnd):
                    conn.send("ok", {})
    except ProtocolError as exc:
        assert exc.code in wire.ERROR_CODES
        conn.send_error(exc.code, exc.message)
    return events


@st.composite
def one_bad_field(draw: st.DrawFn) -> dict[str, Any]:
    """A valid request with one field (mostly one it has) set to any JSON value."""
    header = dict(draw(st.sampled_from([m for m in VALID if m["type"] != "data"])))
    keys = sorted(k for k in header if k != "type") or FIELD_NAMES
    key = draw(st.sampled_from(keys) | st.sampled_from(FIELD_NAMES))
    header[key] = draw(json_values)
    return header


@SETTINGS
@given(one_bad_field(), st.lists(st.integers(0, 1 << 12), max_size=8))
def test_a_request_with_any_field_value_is_served_or_refused_and_the_next_one_served(
    header: dict[str, Any], points: list[int]
) -> None:
    stream = (encode({"type": "hello", "version": 1}, b"") + encode(header, b"")
              + encode({"type": "status"}, b""))
    conn = Connection(Role.SERVER)
    seen: list[Any] = []
    for chunk in [*split(stream, points), b""]:
        conn.receive_data(chunk)
        while (event := conn.next_event()) is not NEED_DATA:
            if isinstance(event, PayloadEnd):
                continue  # the empty payload of a put_bytes served below
            seen.append(event)
            if isinstance(event, ConnectionClosed):
                break
            if isinstance(event, Rejected):
                # size_mismatch: a put_bytes whose size is not its (empty) payload's
                assert event.code in (wire.BAD_REQUEST, wire.INVALID_NAME, wire.SIZE_MISMATCH), event
                conn.send_error(event.code, event.message)
                continue
            assert isinstance(event, Message), event
            check_bounded(event)
            if event.kind == "hello":
                conn.send("welcome", {"version": 1, "node_id": "n"})
            else:  # a put is refused, as a full daemon would: no data frame follows
                conn.send_error(wire.BACKPRESSURE, "full")
    assert isinstance(seen[1], Message | Rejected)
    assert seen[2:] == [Message("status", {}), ConnectionClosed()]


@SETTINGS
@given(client_stream(), st.lists(st.integers(0, 1 << 16), max_size=12), st.booleans())
def test_server_machine_only_returns_events_or_raises_protocol_error(
    stream: bytes, points: list[int], eof: bool
) -> None:
    run_server(split(stream, points), eof)


@SETTINGS
@given(client_stream(), st.lists(st.integers(0, 1 << 16), max_size=12))
def test_how_the_bytes_are_split_does_not_change_the_events(stream: bytes, points: list[int]) -> None:
    def summary(events: list[Any]) -> list[Any]:
        out: list[Any] = []
        for e in events:  # payload chunks depend on the split; their bytes do not
            if isinstance(e, PayloadChunk):
                if out and isinstance(out[-1], bytes):
                    out[-1] += bytes(e.data)
                else:
                    out.append(bytes(e.data))
            else:
                out.append(e)
        return out

    assert summary(run_server(split(stream, points), True)) == summary(run_server([stream], True))


@SETTINGS
@given(st.binary(max_size=200), st.lists(st.integers(0, 1 << 10), max_size=6))
def test_random_bytes_in_either_role(data: bytes, points: list[int]) -> None:
    for role in (Role.SERVER, Role.CLIENT):
        conn = Connection(role)
        try:
            for chunk in [*split(data, points), b""]:
                conn.receive_data(chunk)
                while not isinstance(event := conn.next_event(), ConnectionClosed):
                    if event is NEED_DATA:
                        break
                    if isinstance(event, Message):
                        check_bounded(event)
        except ProtocolError as exc:
            assert exc.code in wire.ERROR_CODES
