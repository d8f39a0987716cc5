"""The sans-IO wire machine: byte streams in, events out, split at every point (no event loop)."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest

from ckptdrain.client import wire
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

JOB = {"job": "llama-70b", "step": 1200, "rank": 3}
PAYLOAD = bytes(range(256)) * 3 + b"tail"


def frame(
    header: dict[str, Any] | bytes, payload: bytes = b"", payload_len: int | None = None
) -> bytes:
    """A raw frame built by hand, so hostile ones can be built too."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    declared = len(payload) if payload_len is None else payload_len
    return struct.pack(">4sIQ", b"CKD1", len(raw), declared) + raw + payload


HELLO = frame({"type": "hello", "version": 1, "client": "test"})


def put(path: str, size: int) -> bytes:
    return frame({"type": "put", **JOB, "path": path, "size": size})


def data(payload: bytes) -> bytes:
    return frame({"type": "data"}, payload)


def client_stream() -> tuple[bytes, list[int]]:
    """A valid client->server stream and the offsets where its frames end."""
    frames = [
        HELLO,
        frame({"type": "begin", **JOB, "world_size": 8, "ack": "memory"}),
        put("model/rank3.pt", len(PAYLOAD)),
        data(PAYLOAD),
        put("empty.bin", 0),
        data(b""),
        frame({"type": "put_fd", **JOB, "path": "optim/rank3.pt", "size": 1 << 40}),
        frame({"type": "put_memfd", **JOB, "path": "optim/rank3.mem", "size": 5}),
        put("refused.bin", 10),  # the daemon says no (see answer()): no data frame follows
        put("x/y.bin", 3),
        data(b"xyz"),
        frame({"type": "seal", **JOB}),
        frame({"type": "abort", **JOB, "reason": "KeyboardInterrupt: ü"}),
        frame({"type": "wait", "job": "llama-70b", "step": 1200, "timeout_s": 1.5}),
        frame({"type": "latest", "job": "llama-70b"}),
        frame({"type": "status"}),
        frame({"type": "retry", "job": "llama-70b", "step": 0}),
    ]
    ends, total = [], 0
    for f in frames:
        total += len(f)
        ends.append(total)
    return b"".join(frames), ends


def normalize(events: list[Any]) -> list[Any]:
    """Events with consecutive payload chunks joined: how they split depends on the feed."""
    out: list[Any] = []
    for event in events:
        if isinstance(event, PayloadChunk):
            assert len(event.data) > 0
            if out and isinstance(out[-1], bytes):
                out[-1] += bytes(event.data)
            else:
                out.append(bytes(event.data))
        else:
            out.append(event)
    return out


def answer(conn: Connection, message: Message) -> bytes:
    """What a daemon would send back: the machine tracks the put/data exchange from it."""
    if message.kind == "hello":
        return conn.send("welcome", {"version": 1, "node_id": "n"})
    if message.kind == "put" and message.fields["path"] == "refused.bin":
        return conn.send_error("backpressure", "full")
    return conn.send("ok", {"ready": True} if message.kind == "put" else {})


def drain(conn: Connection, replies: list[bytes] | None = None) -> list[Any]:
    """Every event available now (stops at NEED_DATA or after ConnectionClosed).

    In the SERVER role each Message is answered as a daemon would, before the next is parsed;
    the answers go to ``replies``.
    """
    events: list[Any] = []
    while True:
        event = conn.next_event()
        if event is NEED_DATA:
            return events
        events.append(event)
        if isinstance(event, ConnectionClosed):
            return events
        if conn.role is Role.SERVER and isinstance(event, Message):
            reply = answer(conn, event)
            if replies is not None:
                replies.append(reply)


def feed(role: Role, chunks: list[bytes], eof: bool = True) -> list[Any]:
    conn = Connection(role)
    events: list[Any] = []
    for chunk in chunks:
        if chunk:  # b"" would mean EOF
            conn.receive_data(chunk)
            events += drain(conn)
    if eof:
        conn.receive_data(b"")
        events += drain(conn)
    return normalize(events)


def expect_error(
    role: Role, data: bytes, code: str, match: str, eof: bool = False
) -> ProtocolError:
    conn = Connection(role)
    if role is Role.CLIENT:
        conn.receive_data(frame({"type": "welcome", "version": 1, "node_id": "n"}))
        assert isinstance(conn.next_event(), Message)
    conn.receive_data(data)
    if eof:
        conn.receive_data(b"")
    with pytest.raises(ProtocolError) as info:
        drain(conn)
    assert info.value.code == code
    assert match in info.value.message
    return info.value


def test_whole_stream_yields_each_message_its_payload_and_a_clean_close() -> None:
    stream, _ = client_stream()
    events = feed(Role.SERVER, [stream])
    kinds = [e.kind if isinstance(e, Message) else e for e in events]
    assert kinds == [
        "hello",
        "begin",
        "put",
        "data",
        PAYLOAD,
        PayloadEnd(),
        "put",
        "data",
        PayloadEnd(),  # an empty payload still ends, so the server's loop is always the same
        "put_fd",
        "put_memfd",
        "put",
        "put",
        "data",
        b"xyz",
        PayloadEnd(),
        "seal",
        "abort",
        "wait",
        "latest",
        "status",
        "retry",
        ConnectionClosed(),
    ]
    assert events[2] == Message("put", {**JOB, "path": "model/rank3.pt", "size": len(PAYLOAD)})
    assert events[3] == Message("data", {}, len(PAYLOAD))
    assert events[1].fields == {**JOB, "world_size": 8, "ack": "memory"}


def test_every_split_point_yields_the_same_events() -> None:
    stream, _ = client_stream()
    expected = feed(Role.SERVER, [stream])
    for cut in range(len(stream) + 1):
        assert feed(Role.SERVER, [stream[:cut], stream[cut:]]) == expected, cut


def test_byte_by_byte_yields_the_same_events() -> None:
    stream, _ = client_stream()
    expected = feed(Role.SERVER, [stream])
    assert feed(Role.SERVER, [stream[i : i + 1] for i in range(len(stream))]) == expected


def test_memoryview_and_bytearray_input_are_copied_before_the_caller_reuses_them() -> None:
    stream, _ = client_stream()
    expected = feed(Role.SERVER, [stream])
    conn = Connection(Role.SERVER)
    reused = bytearray(7)
    events: list[Any] = []
    for start in range(0, len(stream), 7):
        n = len(stream[start : start + 7])
        reused[:n] = stream[start : start + 7]
        conn.receive_data(memoryview(reused)[:n])
        events += drain(conn)
        reused[:] = b"\xff" * 7  # the caller overwrites its buffer before the next recv
    conn.receive_data(b"")
    events += drain(conn)
    assert normalize(events) == expected


def test_server_stream_split_everywhere() -> None:
    stream = b"".join(
        [
            frame({"type": "welcome", "version": 1, "node_id": "gpu017"}),
            frame({"type": "ok", "generation": 1200, "nested": {"a": [1, None]}}),
            frame(
                {
                    "type": "error",
                    "code": "backpressure",
                    "message": "full",
                    "details": {"retry_after_s": 2},
                }
            ),
            frame({"type": "error", "code": "some_future_code", "message": "m"}),
            frame({"type": "ok"}),
        ]
    )
    expected = feed(Role.CLIENT, [stream])
    assert [e.kind for e in expected[:-1]] == ["welcome", "ok", "error", "error", "ok"]
    assert expected[1].fields == {"generation": 1200, "nested": {"a": [1, None]}}
    for cut in range(len(stream) + 1):
        assert feed(Role.CLIENT, [stream[:cut], stream[cut:]]) == expected


def test_truncated_anywhere_inside_a_frame_is_an_error_and_at_a_boundary_a_close() -> None:
    stream, ends = client_stream()
    boundaries = {0, *ends}
    for cut in range(len(stream)):
        conn = Connection(Role.SERVER)
        if cut:
            conn.receive_data(stream[:cut])
        conn.receive_data(b"")
        if cut in boundaries:
            events = drain(conn)
            assert events[-1] == ConnectionClosed()
            assert conn.next_event() == ConnectionClosed()  # stays closed
        else:
            with pytest.raises(ProtocolError, match="truncated") as info:
                drain(conn)
            assert info.value.code == "bad_request"


def accepted_put(size: int) -> Connection:
    """A server-role machine that has said hello and accepted a put of ``size`` bytes."""
    conn = Connection(Role.SERVER)
    conn.receive_data(HELLO + put("a.bin", size))
    assert [e.kind for e in drain(conn)] == ["hello", "put"]  # drain() answers both with ok
    assert conn.awaiting_data == size
    return conn


def test_fast_path_payload_consumed_skips_the_machine() -> None:
    conn = accepted_put(1000)
    conn.receive_data(wire.encode_message("data", {}, 1000) + PAYLOAD[:100])
    message = conn.next_event()
    assert message == Message("data", {}, 1000)
    assert conn.awaiting_data is None
    assert conn.payload_remaining == 1000 and conn.buffered == 100
    with pytest.raises(RuntimeError, match="still buffered"):
        conn.payload_consumed(1)
    chunk = conn.next_event()
    assert isinstance(chunk, PayloadChunk) and bytes(chunk.data) == PAYLOAD[:100]
    assert conn.buffered == 0 and conn.payload_remaining == 900
    # The IO layer now recv_into()s its own buffer and reports what it read.
    conn.payload_consumed(400)
    assert conn.next_event() is NEED_DATA
    with pytest.raises(RuntimeError, match="only 500 bytes remain"):
        conn.payload_consumed(501)
    conn.payload_consumed(500)
    assert conn.payload_remaining == 0
    assert conn.next_event() == PayloadEnd()
    with pytest.raises(RuntimeError, match="outside a payload"):
        conn.payload_consumed(0)
    conn.receive_data(frame({"type": "seal", **JOB}))
    assert conn.next_event() == Message("seal", JOB)
    conn.receive_data(b"")
    assert conn.next_event() == ConnectionClosed()


def test_fast_path_eof_before_the_payload_is_done_is_truncated() -> None:
    conn = accepted_put(10)
    conn.receive_data(wire.encode_message("data", {}, 10))
    assert conn.next_event() == Message("data", {}, 10)
    conn.payload_consumed(4)
    conn.receive_data(b"")
    with pytest.raises(ProtocolError, match="6 bytes missing"):
        conn.next_event()


def test_many_small_frames_in_one_buffer_are_all_parsed_and_the_buffer_emptied() -> None:
    status = frame({"type": "status"})
    conn = Connection(Role.SERVER)
    conn.receive_data(HELLO + status * 20_000 + status[:5])
    events = drain(conn)
    assert len(events) == 20_001 and events[-1] == Message("status", {})
    assert conn.buffered == 5
    conn.receive_data(status[5:])
    assert conn.next_event() == Message("status", {})
    assert conn.buffered == 0


# --- hostile input ----------------------------------------------------------------------------


def test_bad_magic_fails_on_the_first_wrong_byte() -> None:
    expect_error(Role.SERVER, b"G", "bad_request", "bad magic")
    expect_error(Role.SERVER, b"GET / HTTP/1.1\r\n\r\n", "bad_request", "bad magic")
    expect_error(Role.SERVER, b"CKD2" + HELLO[4:], "bad_request", "bad magic")


def test_oversize_header_fails_before_the_header_arrives() -> None:
    prefix = struct.pack(">4sIQ", b"CKD1", wire.MAX_HEADER_BYTES + 1, 0)
    expect_error(Role.SERVER, prefix, "bad_request", "oversize header")


def test_oversize_payload_is_refused() -> None:
    prefix = struct.pack(">4sIQ", b"CKD1", 10, wire.MAX_PAYLOAD_BYTES + 1)
    expect_error(Role.SERVER, prefix, "bad_request", "oversize payload")


def test_the_data_frame_must_carry_exactly_the_declared_size() -> None:
    for wrong in (b"x" * 9, b"x" * 11, b""):
        error = expect_error(
            Role.SERVER, HELLO + put("a.bin", 10) + data(wrong), "size_mismatch", "declared 10"
        )
        assert f"carries {len(wrong)}" in error.message


def put_bytes(path: str, payload: bytes, size: int | None = None) -> bytes:
    size = len(payload) if size is None else size
    return frame({"type": "put_bytes", **JOB, "path": path, "size": size}, payload)


def test_put_bytes_carries_a_small_shard_as_its_own_payload() -> None:
    events = feed(Role.SERVER, [HELLO, put_bytes("a.bin", b"abc"), put_bytes("e.bin", b""),
                                frame({"type": "seal", **JOB})])
    assert events[1] == Message("put_bytes", {**JOB, "path": "a.bin", "size": 3}, 3)
    assert events[2:4] == [b"abc", PayloadEnd()]
    assert events[4] == Message("put_bytes", {**JOB, "path": "e.bin", "size": 0}, 0)
    assert events[5] == PayloadEnd()
    assert events[6] == Message("seal", JOB, 0)
    assert isinstance(events[7], ConnectionClosed)
    # At the limit it goes; the bytes follow the header in the same frame.
    at_limit = b"x" * wire.INLINE_MAX_BYTES
    assert normalize(feed(Role.SERVER, [HELLO, put_bytes("big", at_limit)])[2:4]) == [
        at_limit, PayloadEnd()]


def test_put_bytes_must_carry_exactly_its_size_and_no_more_than_the_inline_limit() -> None:
    # Bytes follow the header, so the frame cannot be skipped: the connection fails.
    for wrong in (b"x" * 9, b"x" * 11):
        error = expect_error(Role.SERVER, HELLO + put_bytes("a.bin", wrong, size=10),
                             "size_mismatch", "declares 10 bytes")
        assert f"carries {len(wrong)}" in error.message
    # Without bytes after it the frame is whole: refused, and the next one is read.
    events = feed(Role.SERVER, [HELLO, put_bytes("a.bin", b"", size=10), frame({"type": "status"})])
    assert isinstance(events[1], Rejected) and events[1].code == "size_mismatch"
    assert events[2] == Message("status", {}, 0)
    # A size over the limit is the limit's error, with or without the bytes.
    events = feed(Role.SERVER, [HELLO, put_bytes("a.bin", b"", size=wire.INLINE_MAX_BYTES + 1)])
    assert isinstance(events[1], Rejected) and events[1].code == "bad_request"
    assert "at most" in events[1].message
    over = wire.INLINE_MAX_BYTES + 1
    expect_error(Role.SERVER, HELLO + put_bytes("a.bin", b"x" * over), "bad_request",
                 f"at most {wire.INLINE_MAX_BYTES} bytes")
    # A put_bytes is not the data frame an admitted put waits for.
    expect_error(Role.SERVER, HELLO + put("a.bin", 3) + put_bytes("b.bin", b"abc"),
                 "bad_request", "expected the 'data' frame of the accepted put, got 'put_bytes'")
    # The sending side refuses the same frames.
    client = Connection(Role.CLIENT)
    client.send("hello", {"version": 1})
    with pytest.raises(ProtocolError, match="declares 4 bytes but carries 3"):
        client.send("put_bytes", {**JOB, "path": "a", "size": 4}, 3)
    with pytest.raises(ProtocolError, match="at most"):
        client.send("put_bytes", {**JOB, "path": "a", "size": over}, over)


def test_data_only_right_after_a_put_the_daemon_accepted() -> None:
    never = "'data' frame without a put the daemon accepted"
    expect_error(Role.SERVER, HELLO + data(b"abc"), "bad_request", never)
    # Refused put: the daemon's error answer means no data frame may follow.
    expect_error(Role.SERVER, HELLO + put("refused.bin", 3) + data(b"abc"), "bad_request", never)
    # Accepted put: the data frame must come next, nothing else.
    expect_error(
        Role.SERVER,
        HELLO + put("a.bin", 3) + frame({"type": "seal", **JOB}),
        "bad_request",
        "expected the 'data' frame of the accepted put, got 'seal'",
    )
    # Before the daemon answered the put: the client has not waited for admission.
    conn = Connection(Role.SERVER)
    conn.receive_data(HELLO + put("a.bin", 3) + data(b"abc"))
    hello = conn.next_event()
    assert isinstance(hello, Message)
    answer(conn, hello)
    assert isinstance(conn.next_event(), Message)  # the put, left unanswered
    with pytest.raises(ProtocolError, match=never):
        conn.next_event()


def test_payload_on_a_type_that_takes_none() -> None:
    for header in (
        {"type": "seal", **JOB},
        {"type": "put", **JOB, "path": "a", "size": 3},
        {"type": "put_fd", **JOB, "path": "a", "size": 3},
    ):
        expect_error(
            Role.SERVER, HELLO + frame(header, b"abc"), "bad_request", "carries no payload"
        )
    expect_error(
        Role.SERVER, frame({"type": "hello", "version": 1}, b"x"), "bad_request", "no payload"
    )


def test_unknown_type_names_the_type() -> None:
    expect_error(Role.SERVER, HELLO + frame({"type": "rm_rf"}), "bad_request", "'rm_rf'")


def test_types_from_the_wrong_direction_are_refused() -> None:
    welcome = frame({"type": "welcome", "version": 1, "node_id": "n"})
    expect_error(Role.SERVER, HELLO + welcome, "bad_request", "never sent by a client")
    expect_error(Role.CLIENT, frame({"type": "status"}), "bad_request", "never sent by a server")


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (b"", "not valid UTF-8 JSON"),
        (b"{", "not valid UTF-8 JSON"),
        (b"\xff\xfe{}", "not valid UTF-8 JSON"),
        (b'{"type": "status", "x": NaN}', "not valid UTF-8 JSON"),
        (b'{"type": "status", "type": "latest"}', "duplicate key"),
        (b"[" * 60000 + b"]" * 5000, "not valid UTF-8 JSON"),
        (b"[]", "must be a JSON object"),
        (b'"status"', "must be a JSON object"),
        (b"{}", "no string 'type'"),
        (b'{"type": 3}', "no string 'type'"),
        (b'{"type": "latest", "job": "j", "step": 1' + b"1" * 5000 + b"}", "not valid UTF-8 JSON"),
    ],
)
def test_bad_json_headers(header: bytes, match: str) -> None:
    expect_error(Role.SERVER, HELLO + frame(header), "bad_request", match)


@pytest.mark.parametrize(
    ("fields", "code", "match"),
    [
        ({"type": "begin", **JOB}, "bad_request", "missing required field 'world_size'"),
        (
            {"type": "begin", **JOB, "world_size": 8, "evil": 1},
            "bad_request",
            "unknown field 'evil'",
        ),
        (
            {"type": "begin", **JOB, "world_size": True},
            "bad_request",
            "world_size must be an integer",
        ),
        ({"type": "begin", **JOB, "world_size": 2}, "bad_request", "rank 3 is out of range"),
        (
            {"type": "begin", **JOB, "world_size": 8, "ack": "disk"},
            "bad_request",
            "'ack' is 'disk'",
        ),
        ({"type": "begin", **JOB, "world_size": 8, "ack": None}, "bad_request", "'ack' is None"),
        ({"type": "seal", **JOB, "step": "1200"}, "bad_request", "step must be an integer"),
        ({"type": "seal", **JOB, "step": 1.0}, "bad_request", "step must be an integer"),
        ({"type": "seal", **JOB, "step": -1}, "bad_request", "out of range"),
        ({"type": "seal", **JOB, "rank": False}, "bad_request", "rank must be an integer"),
        (
            {"type": "put_fd", **JOB, "path": "a", "size": -1},
            "bad_request",
            "size -1 is out of range",
        ),
        (
            {"type": "put_fd", **JOB, "path": "a", "size": "5"},
            "bad_request",
            "'size' must be an integer",
        ),
        ({"type": "abort", **JOB, "reason": 5}, "bad_request", "'reason' must be a string"),
        (
            {"type": "wait", "job": "j", "step": 1, "timeout_s": True},
            "bad_request",
            "number of seconds",
        ),
        (
            {"type": "wait", "job": "j", "step": 1, "timeout_s": -1},
            "bad_request",
            "use a finite number from 0 to",
        ),
        ({"type": "status", "verbose": True}, "bad_request", "unknown field 'verbose'"),
        # hostile names become invalid_name through names.py
        ({"type": "begin", **JOB, "job": "../etc", "world_size": 8}, "invalid_name", "'/'"),
        ({"type": "latest", "job": ".."}, "invalid_name", "starts with '.'"),
        ({"type": "latest", "job": 7}, "invalid_name", "must be a string"),
        ({"type": "put_fd", **JOB, "path": "/etc/passwd", "size": 1}, "invalid_name", "absolute"),
        ({"type": "put_fd", **JOB, "path": "a/../../b", "size": 1}, "invalid_name", "'..'"),
        ({"type": "put_fd", **JOB, "path": "a\x00b", "size": 1}, "invalid_name", "NUL"),
        ({"type": "put_fd", **JOB, "path": "MANIFEST.json", "size": 1}, "invalid_name", "reserved"),
        ({"type": "put_fd", **JOB, "path": "_parts/n1", "size": 1}, "invalid_name", "_parts/"),
        (
            {"type": "put_fd", **JOB, "path": "x" * 2000, "size": 1},
            "invalid_name",
            "over the limit",
        ),
    ],
)
def test_bad_fields(fields: dict[str, Any], code: str, match: str) -> None:
    expect_rejected(frame(fields), code, match)


def expect_rejected(request: bytes, code: str, match: str) -> Rejected:
    """A whole frame with a bad field is one refused request: the next one is served."""
    conn = Connection(Role.SERVER)
    conn.receive_data(HELLO + request + frame({"type": "status"}))
    events = drain(conn)
    assert [type(e) for e in events] == [Message, Rejected, Message], events
    rejected = events[1]
    assert isinstance(rejected, Rejected)
    assert rejected.code == code, rejected
    assert match in rejected.message, rejected
    assert events[2] == Message("status", {})
    return rejected


def test_json_numbers_that_overflow_to_infinity_are_not_timeouts() -> None:
    header = b'{"type": "wait", "job": "j", "step": 1, "timeout_s": 1e999}'
    expect_rejected(frame(header), "bad_request", "use a finite number from 0 to")


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        # The journal stores steps as SQLite integers (int64): 2**63 crashed the daemon.
        ({"type": "seal", **JOB, "step": 2**63}, "out of range"),
        ({"type": "begin", **JOB, "step": 2**63, "world_size": 8}, "out of range"),
        ({"type": "wait", "job": "j", "step": 2**64, "timeout_s": 1}, "out of range"),
        # A 400-digit timeout_s has no float: math.isfinite() raised OverflowError.
        ({"type": "wait", "job": "j", "step": 1, "timeout_s": 10**400}, "(too long)"),
        ({"type": "wait", "job": "j", "step": 1, "timeout_s": 86_401}, "from 0 to 86400"),
        ({"type": "wait", "job": "j", "step": 1, "timeout_s": 1e300}, "from 0 to 86400"),
        ({"type": "begin", **JOB, "world_size": 10**400}, "out of range"),
        ({"type": "put", **JOB, "path": "a", "size": 2**64}, "out of range"),
        ({"type": "put", **JOB, "rank": 10**30, "path": "a", "size": 1}, "out of range"),
        ({"type": "abort", **JOB, "reason": "r" * 65_400}, "over the limit of 1000"),
        ({"type": "begin", **JOB, "world_size": 8, "attempt": "a" * 129}, "at most 128"),
    ],
)
def test_every_field_is_bounded_at_the_wire(fields: dict[str, Any], match: str) -> None:
    expect_rejected(frame(fields), "bad_request", match)


def test_bounds_that_are_in_range_pass() -> None:
    conn = Connection(Role.SERVER)
    conn.receive_data(HELLO + frame({"type": "seal", **JOB, "step": 2**63 - 1})
                      + frame({"type": "wait", "job": "j", "step": 1, "timeout_s": 86_400})
                      + frame({"type": "abort", **JOB, "reason": "r" * 1000}))
    assert [e.kind for e in drain(conn)] == ["hello", "seal", "wait", "abort"]


def test_a_rejected_put_expects_no_data_and_the_next_put_goes_through() -> None:
    # An invalid_name on a put once closed the connection though this page's promise is that
    # an error reply leaves it usable.
    conn = Connection(Role.SERVER)
    conn.receive_data(HELLO + put("../escape", 3) + put("ok.bin", 3) + data(b"abc"))
    events = drain(conn)
    assert isinstance(events[1], Rejected) and events[1].code == "invalid_name"
    assert events[2] == Message("put", {**JOB, "path": "ok.bin", "size": 3})
    assert normalize(events[3:]) == [Message("data", {}, 3), b"abc", PayloadEnd()]


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        # Bytes follow these frames, or nothing was agreed yet: the stream cannot go on.
        (frame({"type": "hello", "version": 1, "client": "c" * 257}), "over the limit of 256"),
        (frame({"type": "hello", "version": 10**400}), "from 0 to 65535"),
        (HELLO + frame({"type": "data", "x": 1}, b"abc"), "without a put"),
        (HELLO + frame({"type": "put", **JOB, "path": "../x", "size": 3}, b"abc"), "carries no payload"),
    ],
)
def test_field_faults_that_cannot_be_skipped_stay_fatal(raw: bytes, match: str) -> None:
    expect_error(Role.SERVER, raw, "bad_request", match)


def test_server_side_message_checks() -> None:
    def check(header: dict[str, Any], match: str) -> None:
        expect_error(Role.CLIENT, frame(header), "bad_request", match)

    check({"type": "ok", "type2": 1} | {"x": float("nan")}, "not valid UTF-8 JSON")
    check({"type": "error", "code": "timeout"}, "missing required field 'message'")
    check({"type": "error", "code": 5, "message": "m"}, "'code' must be a string")
    check({"type": "error", "code": "x", "message": "m", "details": []}, "JSON object")


def test_the_first_client_message_must_be_hello_and_only_once() -> None:
    expect_error(Role.SERVER, frame({"type": "status"}), "bad_request", "before 'hello'")
    expect_error(Role.SERVER, HELLO + HELLO, "bad_request", "second 'hello'")
    expect_error(Role.SERVER, frame({"type": "hello", "version": "1"}), "bad_request", "'version'")


def test_the_first_server_message_must_be_welcome_or_error() -> None:
    conn = Connection(Role.CLIENT)
    conn.receive_data(frame({"type": "ok"}))
    with pytest.raises(ProtocolError, match="before 'welcome'"):
        conn.next_event()
    refused = Connection(Role.CLIENT)
    refused.receive_data(frame({"type": "error", "code": "unsupported_version", "message": "v2"}))
    assert refused.next_event() == Message(
        "error", {"code": "unsupported_version", "message": "v2"}
    )
    twice = frame({"type": "welcome", "version": 1, "node_id": "n"})
    expect_error(Role.CLIENT, twice, "bad_request", "second 'welcome'")


def test_after_a_protocol_error_the_receiving_side_stays_dead_but_can_still_send() -> None:
    conn = Connection(Role.SERVER)
    conn.receive_data(b"XXXX")
    with pytest.raises(ProtocolError, match="bad magic"):
        conn.next_event()
    with pytest.raises(ProtocolError, match="already failed: bad magic"):
        conn.next_event()
    with pytest.raises(ProtocolError, match="already failed"):
        conn.receive_data(HELLO)
    error = conn.send_error("bad_request", "bad magic")
    peer = Connection(Role.CLIENT)
    peer.receive_data(error)
    assert peer.next_event() == Message("error", {"code": "bad_request", "message": "bad magic"})


def test_receive_after_eof_is_a_usage_error() -> None:
    conn = Connection(Role.SERVER)
    conn.receive_data(b"")
    with pytest.raises(RuntimeError, match="after EOF"):
        conn.receive_data(HELLO)


# --- sending ----------------------------------------------------------------------------------


def test_round_trip_of_every_client_message() -> None:
    client, server = Connection(Role.CLIENT), Connection(Role.SERVER)
    script: list[tuple[str, dict[str, Any] | None, bytes]] = [
        ("hello", {"version": wire.PROTOCOL_VERSION, "client": "pytest"}, b""),
        ("begin", {**JOB, "world_size": 4, "ack": None}, b""),  # None optional: left out
        ("put", {**JOB, "path": "m/u", "size": 4}, b""),
        ("data", None, b"abcd"),
        ("put_fd", {**JOB, "path": "o.pt", "size": 12345}, b""),
        ("put_memfd", {**JOB, "path": "o.mem", "size": 0}, b""),
        ("put_bytes", {**JOB, "path": "s.bin", "size": 5}, b"small"),
        ("seal", JOB, b""),
        ("abort", {**JOB, "reason": "ValueError: ünïcode"}, b""),
        ("wait", {"job": "j", "step": 2, "timeout_s": 600}, b""),
        ("latest", {"job": "j"}, b""),
        ("status", None, b""),
        ("retry", {"job": "j", "step": 2}, b""),
    ]
    for kind, fields, payload in script:
        # Request, then its answer, one at a time as real peers do.
        server.receive_data(client.send(kind, fields, len(payload)) + payload)
        replies: list[bytes] = []
        events = drain(server, replies)
        clean = {k: v for k, v in (fields or {}).items() if v is not None}
        assert events[0] == Message(kind, clean, len(payload))
        if payload:
            assert normalize(events[1:]) == [payload, PayloadEnd()]
        client.receive_data(b"".join(replies))
        expected = "welcome" if kind == "hello" else "ok"
        assert [m.kind for m in drain(client)] == [expected]
    assert wire.needs_fd("put_fd") and wire.needs_fd("put_memfd") and not wire.needs_fd("put")
    assert wire.takes_payload("data") and wire.takes_payload("put_bytes")
    assert not wire.takes_payload("put")


def test_round_trip_of_server_messages() -> None:
    server, client = Connection(Role.SERVER), Connection(Role.CLIENT)
    data = (
        server.send("welcome", {"version": 1, "node_id": "gpu017"})
        + server.send("ok", {"generation": None, "shards": [{"path": "a", "size": 1}]})
        + server.send_error("backpressure", "staging is full", {"retry_after_s": 1.5})
        + server.send_error("not_found", "no such job")
    )
    client.receive_data(data)
    assert drain(client) == [
        Message("welcome", {"version": 1, "node_id": "gpu017"}),
        Message("ok", {"generation": None, "shards": [{"path": "a", "size": 1}]}),
        Message(
            "error",
            {
                "code": "backpressure",
                "message": "staging is full",
                "details": {"retry_after_s": 1.5},
            },
        ),
        Message("error", {"code": "not_found", "message": "no such job"}),
    ]


def test_send_refuses_what_receive_would_refuse() -> None:
    client = Connection(Role.CLIENT)
    with pytest.raises(ProtocolError, match="send 'hello' before 'status'"):
        client.send("status")
    client.send("hello", {"version": 1})
    with pytest.raises(ProtocolError, match="already sent"):
        client.send("hello", {"version": 1})
    with pytest.raises(ProtocolError, match="does not send 'ok'"):
        client.send("ok")
    with pytest.raises(ProtocolError, match="unknown message type 'nope'"):
        client.send("nope")
    with pytest.raises(ProtocolError, match="missing required field 'size'") as info:
        client.send("put", {**JOB, "path": "a"})
    assert info.value.code == "bad_request"
    with pytest.raises(ProtocolError, match="carries no payload"):
        client.send("put", {**JOB, "path": "a", "size": 3}, 3)
    with pytest.raises(ProtocolError, match="without a put the daemon accepted"):
        client.send("data", None, 3)
    with pytest.raises(ProtocolError) as info:
        client.send("begin", {**JOB, "world_size": 4, "job": "a b"})
    assert info.value.code == "invalid_name"
    with pytest.raises(ProtocolError, match="carries no payload"):
        client.send("seal", JOB, 1)
    with pytest.raises(ProtocolError, match="over the limit"):
        client.send("abort", {**JOB, "reason": "x" * wire.MAX_HEADER_BYTES})
    # A failed send leaves the connection usable.
    assert client.send("status").startswith(b"CKD1")

    server = Connection(Role.SERVER)
    with pytest.raises(ProtocolError, match="'welcome' or 'error' before 'ok'"):
        server.send("ok")
    with pytest.raises(ProtocolError, match="does not send 'begin'"):
        server.send("begin", {**JOB, "world_size": 4})
    with pytest.raises(ProtocolError, match="error code 'oops'"):
        server.send_error("oops", "m")
    server.send("welcome", {"version": 1, "node_id": "n"})
    with pytest.raises(ProtocolError, match="already sent"):
        server.send("welcome", {"version": 1, "node_id": "n"})
    with pytest.raises(ProtocolError, match="'type'"):
        server.send("ok", {"type": "error"})
    with pytest.raises(ProtocolError, match="not JSON"):
        server.send("ok", {"x": object()})
    with pytest.raises(ProtocolError, match="not JSON"):
        server.send("ok", {"x": float("inf")})


def test_client_side_put_then_data_follows_the_daemons_answer() -> None:
    client = Connection(Role.CLIENT)
    client.send("hello", {"version": 1})
    client.receive_data(frame({"type": "welcome", "version": 1, "node_id": "n"}))
    drain(client)
    # Refused: no data may follow, the next request is free.
    client.send("put", {**JOB, "path": "a", "size": 3})
    with pytest.raises(ProtocolError, match="without a put the daemon accepted"):
        client.send("data", None, 3)  # not answered yet
    client.receive_data(frame({"type": "error", "code": "backpressure", "message": "full"}))
    drain(client)
    assert client.awaiting_data is None
    with pytest.raises(ProtocolError, match="without a put the daemon accepted"):
        client.send("data", None, 3)
    # Accepted: the data frame, of exactly that size, must come next.
    client.send("put", {**JOB, "path": "a", "size": 3})
    client.receive_data(frame({"type": "ok", "ready": True}))
    drain(client)
    assert client.awaiting_data == 3
    with pytest.raises(ProtocolError, match="expected the 'data' frame"):
        client.send("seal", JOB)
    with pytest.raises(ProtocolError) as info:
        client.send("data", None, 4)
    assert info.value.code == "size_mismatch"
    assert client.send("data", None, 3).startswith(b"CKD1")
    assert client.awaiting_data is None
    client.send("seal", JOB)


def test_encoded_frame_layout_is_the_documented_one() -> None:
    encoded = wire.encode_message("data", {}, 7)
    magic, header_len, payload_len = struct.unpack(">4sIQ", encoded[:16])
    assert (magic, header_len, payload_len) == (b"CKD1", len(encoded) - 16, 7)
    assert json.loads(encoded[16:]) == {"type": "data"}
    encoded = wire.encode_message("put", {**JOB, "path": "a", "size": 7})
    assert encoded[:16] == struct.pack(">4sIQ", b"CKD1", len(encoded) - 16, 0)
    assert json.loads(encoded[16:]) == {"type": "put", **JOB, "path": "a", "size": 7}


def test_error_codes_match_the_client_error_classes() -> None:
    from ckptdrain.client import errors

    for code in wire.ERROR_CODES - {"unavailable", "internal", "bad_request"}:
        assert errors.error_for_code(code, "m").code == code
    assert errors.error_for_code(wire.BAD_REQUEST, "m").code == "bad_request"
    assert errors.error_for_code(wire.UNAVAILABLE, "m").code == "unavailable"


def test_frame_start_and_received_bytes_are_stream_offsets() -> None:
    # The IO layer pairs a passed fd with the frame that starts in the read it came with.
    stream, ends = client_stream()
    starts = [0, *ends[:-1]]
    for step in (1, 7, len(stream)):
        conn = Connection(Role.SERVER)
        seen: list[int] = []
        for at in range(0, len(stream), step):
            conn.receive_data(stream[at : at + step])
            assert conn.received_bytes == min(at + step, len(stream))
            while (event := conn.next_event()) is not NEED_DATA:
                if isinstance(event, Message):
                    seen.append(conn.frame_start)
                    answer(conn, event)
        assert seen == starts  # every frame of the stream is one Message


def test_frame_start_counts_payload_bytes_read_past_the_machine() -> None:
    conn = Connection(Role.SERVER)
    conn.receive_data(HELLO + put("a", 100))
    assert [e.kind for e in drain(conn)] == ["hello", "put"]
    head = data(b"x" * 100)[:-100]
    conn.receive_data(head)
    assert isinstance(conn.next_event(), Message)
    conn.payload_consumed(100)  # read straight into the IO layer's buffer
    assert isinstance(conn.next_event(), PayloadEnd)
    offset = len(HELLO) + len(put("a", 100)) + len(head) + 100
    assert conn.received_bytes == offset
    conn.receive_data(frame({"type": "status"}))
    assert conn.next_event() == Message("status", {})
    assert conn.frame_start == offset


def test_data_pipe_stands_where_data_would_and_nowhere_else() -> None:
    """An accepted put's bytes may come through a pipe (its read end on the frame, no payload):
    the same place in the conversation as `data`, never without an accepted put, never twice."""
    never = "'data_pipe' frame without a put the daemon accepted"
    expect_error(Role.SERVER, HELLO + frame({"type": "data_pipe"}), "bad_request", never)
    expect_error(Role.SERVER, HELLO + put("refused.bin", 3) + frame({"type": "data_pipe"}),
                 "bad_request", never)
    expect_error(Role.SERVER, HELLO + put("a.bin", 3) + frame({"type": "data_pipe"}, b"abc"),
                 "bad_request", "payload")
    assert wire.needs_fd("data_pipe") and not wire.takes_payload("data_pipe")
    client = Connection(Role.CLIENT)
    client.send("hello", {"version": 1})
    client.receive_data(frame({"type": "welcome", "version": 1, "node_id": "n"}))
    drain(client)
    client.send("put", {**JOB, "path": "a", "size": 3})
    with pytest.raises(ProtocolError, match=never):
        client.send("data_pipe", None)  # not answered yet
    client.receive_data(frame({"type": "ok", "ready": True, "pipe": True}))
    drain(client)
    assert client.send("data_pipe", None).startswith(b"CKD1")
    assert client.awaiting_data is None
    with pytest.raises(ProtocolError, match=never):
        client.send("data_pipe", None)
    # The server side ends its wait for the bytes the same way.
    server = Connection(Role.SERVER)
    server.receive_data(HELLO + put("a.bin", 3) + frame({"type": "data_pipe"}))
    hello = server.next_event()
    assert isinstance(hello, Message)
    answer(server, hello)
    put_msg = server.next_event()
    assert isinstance(put_msg, Message) and put_msg.kind == "put"
    server.send("ok", {"ready": True, "pipe": True})
    assert server.awaiting_data == 3
    event = server.next_event()
    assert isinstance(event, Message) and event.kind == "data_pipe"
    assert server.awaiting_data is None and server.payload_remaining == 0
