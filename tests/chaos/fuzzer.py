"""A protocol fuzzer: hostile byte streams and file descriptors at the daemon's socket.

A session is drawn from a seed: a plausible conversation built with ``client/wire.py``
(hello, begin, put + data or data_pipe, put_fd, put_memfd, fetch, seal, abort, wait, status,
...), then
mutated: bit flips, truncation, wrong header or payload lengths, oversize headers, frames
dropped, duplicated or shuffled, garbage between frames, fds of every kind attached to frames
that take none or one (pipes, sockets, /dev/null, write-only files, directories, O_PATH, plain
and sealed and write-only and write-locked memfds, up to 200 at once), fields out of what
any layer stores (steps past 2^63, 400-digit timeouts, 65,400-character reasons), a shard
path that is a directory of another, an abrupt reset, a slow trickle, or an idle stall.

What the daemon may answer: well-formed server frames only (``welcome``, ``ok``, ``error`` with
a known code), then a close; never silence past its idle timeout.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import json
import os
import random
import socket
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ckptdrain.client import wire

FD_KINDS = ("regular", "regular_wronly", "directory", "devnull", "pipe_r", "pipe_w", "socket",
            "memfd", "memfd_sealed", "memfd_wronly", "memfd_locked", "opath", "pipe_full")
# fds that hit a known, not yet fixed bug (each with its own xfail-marked test in test_fuzz.py).
# The general runs leave them out, also from frames that take no fd, until the fix.
KNOWN_BUG_FD_KINDS: frozenset[str] = frozenset()
MUTATIONS = ("none", "bitflip", "truncate", "header_len", "payload_len", "oversize", "reorder",
             "drop", "duplicate", "garbage", "json", "fds", "reset", "trickle", "idle", "bounds",
             "many_fds")
# The most fds one sendmsg may carry (Linux's SCM_MAX_FD): past it the kernel refuses the send
# with EINVAL, and the fuzzer, not the daemon, failed (two many_fds mutations on one chunk).
SCM_MAX_FD = 253
TALLY = {"sessions": 0}  # for the run's summary line (conftest.py)
_SEALS = (getattr(fcntl, "F_SEAL_SEAL", 1) | getattr(fcntl, "F_SEAL_SHRINK", 2)
          | getattr(fcntl, "F_SEAL_GROW", 4) | getattr(fcntl, "F_SEAL_WRITE", 8))


@dataclass
class Chunk:
    """Bytes sent with one sendmsg, and the kinds of fd that ride on their first byte."""

    data: bytes
    fds: list[str] = field(default_factory=list)
    kind: str = ""  # the message it was built as ("" for garbage)


@dataclass
class Session:
    index: int
    seed: int
    chunks: list[Chunk]
    mutations: list[str]
    has_wait: bool = False

    def describe(self) -> str:
        frames = " ".join(f"{c.kind or 'garbage'}{'+' + ','.join(c.fds) if c.fds else ''}"
                          for c in self.chunks)
        return f"session {self.index} (seed {self.seed}): {'+'.join(self.mutations)}: {frames}"


def _frame(kind: str, fields: dict[str, Any], payload: bytes = b"") -> bytes:
    return wire.encode_message(kind, fields, len(payload)) + payload


def conversation(rng: random.Random, sizes: dict[str, int], kinds: tuple[str, ...],
                 fetchable: tuple[str, str] | None) -> list[Chunk]:
    """A plausible conversation a client could send in one go (replies not awaited)."""
    job = f"fz{rng.randrange(8)}"
    step = rng.randint(1, 40)
    world = rng.randint(1, 2)
    rank = rng.randrange(world)
    who = {"job": job, "step": step, "rank": rank}
    chunks = [Chunk(_frame("hello", {"version": wire.PROTOCOL_VERSION, "client": "fuzz"}), kind="hello")]
    if rng.random() < 0.85:
        begin = {"job": job, "step": step, "rank": rank, "world_size": world}
        if rng.random() < 0.3:
            begin["ack"] = rng.choice(wire.ACK_MODES)
        chunks.append(Chunk(_frame("begin", begin), kind="begin"))
    for i in range(rng.randint(0, 4)):
        path = f"p{i}/{rng.choice(('a', 'b', 'c'))}.bin"
        if rng.random() < 0.1:
            path = f"p{rng.randrange(i + 1)}"  # maybe a directory of an earlier shard
        choice = rng.random()
        if choice < 0.3:
            data = rng.randbytes(rng.choice((0, 1, rng.randint(2, 64 << 10))))
            if rng.random() < 0.5:  # a small shard in one frame
                chunks.append(Chunk(_frame("put_bytes", {**who, "path": path, "size": len(data)},
                                           data), kind="put_bytes"))
            else:
                if rng.random() < 0.4:
                    # The bytes through a pipe: mostly a pipe holding the right number of
                    # them, else any fd (short, silent, wrong end, not a pipe at all).
                    fd_kind = "pipe_full" if rng.random() < 0.6 else rng.choice(kinds)
                    size = sizes["pipe_full"] if fd_kind == "pipe_full" else len(data)
                    chunks.append(Chunk(_frame("put", {**who, "path": path, "size": size}),
                                        kind="put"))
                    chunks.append(Chunk(_frame("data_pipe", {}), [fd_kind], "data_pipe"))
                else:
                    chunks.append(Chunk(_frame("put", {**who, "path": path, "size": len(data)}),
                                        kind="put"))
                    chunks.append(Chunk(_frame("data", {}, data), kind="data"))
        elif choice < 0.65:
            kind = rng.choice(("put_fd", "put_memfd"))
            fd_kind = rng.choice(kinds)
            size = sizes.get(fd_kind, 0) if rng.random() < 0.8 else rng.randint(0, 1 << 20)
            chunks.append(Chunk(_frame(kind, {**who, "path": path, "size": size}), [fd_kind], kind))
        elif choice < 0.75:
            # Now and then a shard this node really holds a local copy of (the well-behaved
            # client's), so the daemon writes into whatever fd came with the frame.
            target = ((fetchable[0], rng.randint(1, 30), fetchable[1])
                      if fetchable and rng.random() < 0.5 else (job, step, path))
            chunks.append(Chunk(_frame("fetch", {"job": target[0], "step": target[1],
                                                 "path": target[2]}), [rng.choice(kinds)], "fetch"))
        elif choice < 0.85:
            chunks.append(Chunk(_frame("wait", {"job": job, "step": step,
                                                "timeout_s": round(rng.uniform(0, 0.3), 2)}), kind="wait"))
        else:
            kind = rng.choice(("status", "latest", "retry"))
            fields = {} if kind == "status" else {"job": job} if kind == "latest" else {"job": job, "step": step}
            chunks.append(Chunk(_frame(kind, fields), kind=kind))
    end = rng.random()
    if end < 0.5:
        chunks.append(Chunk(_frame("seal", who), kind="seal"))
    elif end < 0.7:
        chunks.append(Chunk(_frame("abort", {**who, "reason": "fuzz"}), kind="abort"))
    return chunks


def _weird_json(rng: random.Random) -> bytes:
    choices = [
        b"[" * 5000 + b"]" * 5000,
        b'{"type":"hello","version":1,"version":1}',
        b'{"type":"hello","version":NaN}',
        b'{"type":"begin","job":"x","step":1e400,"rank":0,"world_size":1}',
        b'{"type":"begin","job":"\\ud800","step":1,"rank":0,"world_size":1}',
        b'{"type":"put","job":"fz0","step":1,"rank":0,"path":"a","size":-1}',
        b'{"type":"put","job":"fz0","step":1,"rank":0,"path":"a","size":true}',
        b'{"type":"hello","version":1,"client":"' + b"x" * 60000 + b'"}',
        b'{"type":null}', b"null", b"\xff\xfe\x00", b'{"type":"ok"}', b'{"type":"welcome"}',
        json.dumps({"type": "status", "extra": list(range(100))}).encode(),
    ]
    return rng.choice(choices)


def _out_of_bounds(rng: random.Random) -> bytes:
    """A well-framed request with one field past what any layer stores (by hand: the wire
    module would refuse to encode it)."""
    who = {"job": f"fz{rng.randrange(8)}", "step": rng.randint(1, 40), "rank": 0}
    huge = rng.choice((2**63, 2**64, 10**19, 10**400))
    choices: list[dict[str, Any]] = [
        {"type": "begin", **who, "step": huge, "world_size": 1},
        {"type": "begin", **who, "world_size": rng.choice((10**6 + 1, 10**400))},
        {"type": "begin", **who, "world_size": 1, "attempt": "a" * 200},
        {"type": "seal", **who, "step": huge},
        {"type": "put", **who, "rank": huge, "path": "a", "size": 1},
        {"type": "put", **who, "path": "a", "size": rng.choice((2**44 + 1, 2**64, huge))},
        {"type": "abort", **who, "reason": "r" * 65_400},
        {"type": "hello", "version": 10**400},
        {"type": "hello", "version": 1, "client": "c" * 300},
    ]
    body = json.dumps(rng.choice(choices)).encode()
    wait = (b'{"type":"wait","job":"fz0","step":1,"timeout_s":'
            + rng.choice((b"1" + b"0" * 400, b"1e308", b"86401", b"-0.5")) + b"}")
    return rng.choice((body, wait))


def mutate(rng: random.Random, chunks: list[Chunk], kinds: tuple[str, ...]) -> list[str]:
    """Mutate ``chunks`` in place; returns the mutations applied."""
    applied = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        m = rng.choice(MUTATIONS)
        applied.append(m)
        chunks[:] = [c for c in chunks if c.data]
        if not chunks:
            break
        i = rng.randrange(len(chunks))
        c = chunks[i]
        if m == "bitflip":
            data = bytearray(c.data)
            for _ in range(rng.randint(1, 8)):
                pos = rng.randrange(min(len(data), 16 + 200))  # prefix and the header's start
                data[pos] ^= 1 << rng.randrange(8)
            c.data = bytes(data)
        elif m == "truncate":
            c.data = c.data[: rng.randrange(len(c.data))]
            del chunks[i + 1:]
        elif m in ("header_len", "payload_len") and len(c.data) >= 16:
            magic, hlen, plen = struct.unpack_from(">4sIQ", c.data)
            if m == "header_len":
                hlen = rng.choice((0, max(0, hlen - 1), hlen + 1, hlen + 1000, 2**32 - 1, 65537))
            else:
                plen = rng.choice((1, plen + 1, max(0, plen - 1), 2**44, 2**64 - 1))
            c.data = struct.pack(">4sIQ", magic, hlen & 0xFFFFFFFF, plen & (2**64 - 1)) + c.data[16:]
        elif m == "oversize":
            big = rng.choice((wire.MAX_HEADER_BYTES + 1, 10 << 20))
            chunks.insert(i, Chunk(struct.pack(">4sIQ", wire.MAGIC, big, 0) + b"{" * 100, kind="oversize"))
        elif m == "reorder":
            rng.shuffle(chunks)
        elif m == "drop":
            del chunks[i]
        elif m == "duplicate":
            chunks.insert(i, Chunk(c.data, list(c.fds), c.kind))
        elif m == "garbage":
            chunks.insert(i, Chunk(rng.randbytes(rng.randint(1, 300))))
        elif m == "json":
            body = _weird_json(rng)
            chunks.insert(i, Chunk(struct.pack(">4sIQ", wire.MAGIC, len(body), 0) + body, kind="json"))
        elif m == "fds":
            for _ in range(rng.randint(1, 3)):
                target = chunks[rng.randrange(len(chunks))]
                target.fds += [rng.choice(kinds) for _ in range(rng.choice((1, 1, 2, 5)))]
        elif m == "many_fds":
            c.fds += ["devnull"] * rng.choice((9, 200))  # more than one message may carry
        elif m == "bounds":
            body = _out_of_bounds(rng)
            chunks.insert(i, Chunk(struct.pack(">4sIQ", wire.MAGIC, len(body), 0) + body,
                                   kind="bounds"))
    for c in chunks:
        del c.fds[SCM_MAX_FD:]
    return applied


def make_session(run_seed: int, index: int, *, kinds: tuple[str, ...] | None = None,
                 fetchable: tuple[str, str] | None = None) -> Session:
    """Session ``index`` of run ``run_seed``: the same bytes and fds every time."""
    kinds = kinds or tuple(k for k in FD_KINDS if k not in KNOWN_BUG_FD_KINDS)
    seed = random.Random(f"{run_seed}/{index}").getrandbits(48)
    rng = random.Random(seed)
    chunks = conversation(rng, FdFactory.SIZES, kinds, fetchable)
    mutations = mutate(rng, chunks, kinds)
    return Session(index, seed, chunks, mutations,
                   has_wait=any(c.kind == "wait" for c in chunks))


class FdFactory:
    """Fresh fds of every kind; the sizes are the files' sizes, for honest size fields."""

    SIZES: ClassVar[dict[str, int]] = {
        "regular": 4096 + 7, "regular_wronly": 4096 + 7, "opath": 4096 + 7,
        "memfd": 1000, "memfd_sealed": 1000, "memfd_wronly": 1000, "memfd_locked": 1000,
        "pipe_full": 3000}

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.file = tmp / "fuzz-source.bin"
        self.file.write_bytes(os.urandom(self.SIZES["regular"]))
        # Write-only fds get a file of their own: a fetch writes a shard into it.
        self.sink = tmp / "fuzz-sink.bin"
        self.sink.write_bytes(os.urandom(self.SIZES["regular"]))

    def make(self, kind: str) -> tuple[int, list[int]]:
        """(fd to send, every fd to close once it is sent)."""
        if kind in ("regular", "regular_wronly", "opath"):
            flags = {"regular": os.O_RDONLY, "regular_wronly": os.O_WRONLY, "opath": os.O_PATH}[kind]
            fd = os.open(self.sink if kind == "regular_wronly" else self.file, flags | os.O_CLOEXEC)
            return fd, [fd]
        if kind == "directory":
            fd = os.open(self.tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            return fd, [fd]
        if kind == "devnull":
            fd = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
            return fd, [fd]
        if kind in ("pipe_r", "pipe_w"):
            r, w = os.pipe2(os.O_CLOEXEC)
            return (r if kind == "pipe_r" else w), [r, w]
        if kind == "pipe_full":  # a data_pipe's honest pipe: its bytes in, the write end closed
            r, w = os.pipe2(os.O_CLOEXEC)
            os.write(w, b"p" * self.SIZES["pipe_full"])
            os.close(w)
            return r, [r]
        if kind == "socket":
            a, b = socket.socketpair()
            fa, fb = a.detach(), b.detach()
            return fa, [fa, fb]
        memfd = os.memfd_create("fuzz", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.write(memfd, b"m" * self.SIZES["memfd"])
        if kind == "memfd_sealed":
            fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, _SEALS)
        if kind == "memfd_wronly":
            wronly = os.open(f"/proc/self/fd/{memfd}", os.O_WRONLY | os.O_CLOEXEC)
            return wronly, [wronly, memfd]
        if kind == "memfd_locked":
            # A write lock owned by the open file description: it outlives our copy of the fd
            # and is held as long as the daemon keeps the one it was passed. The daemon's
            # shared lock can never be granted; it must refuse, not wait.
            fcntl.fcntl(memfd, fcntl.F_OFD_SETLK, struct.pack("hh4xqqi4x", fcntl.F_WRLCK,
                                                             os.SEEK_SET, 0, 0, 0))
        return memfd, [memfd]


@dataclass
class Limits:
    idle_timeout_s: float
    open_rank_idle_timeout_s: float
    margin_s: float = 5.0


def _send(sock: socket.socket, chunk: Chunk, fds: FdFactory, trickle: bool) -> None:
    made = [fds.make(k) for k in chunk.fds]
    try:
        data = chunk.data
        if made:
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [m[0] for m in made]))]
            sent = sock.sendmsg([data[:1] if trickle else data], rights)
            data = data[sent:]
        if trickle:
            for i in range(min(len(data), 120)):
                sock.sendall(data[i:i + 1])
                time.sleep(0.002)
            data = data[120:]
        sock.sendall(data)
    finally:
        for _, close in made:
            for fd in close:
                os.close(fd)


def run_session(path: Path, session: Session, fds: FdFactory, limits: Limits) -> list[str]:
    """Play one session; returns what the daemon did wrong (nothing, we hope)."""
    trickle = "trickle" in session.mutations
    idle = "idle" in session.mutations
    reset = "reset" in session.mutations
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    received = bytearray()
    try:
        sock.connect(str(path))
        chunks = session.chunks
        if idle and chunks:  # stall in the middle of a frame or between frames
            last = chunks[-1]
            chunks = [*chunks[:-1], Chunk(last.data[: len(last.data) // 2], last.fds, last.kind)]
        for chunk in chunks:
            try:
                _send(sock, chunk, fds, trickle)
            except (BrokenPipeError, ConnectionResetError):
                break  # the daemon hung up on us, which is allowed
            except TimeoutError:
                return [f"daemon stopped reading for 10 s mid-send: {session.describe()}"]
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return []
        if not idle:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
        # A `wait` whose timeout a bit flip raised may legitimately take up to ~10 s.
        budget_s = (max(limits.idle_timeout_s, limits.open_rank_idle_timeout_s if idle else 0.0)
                    + limits.margin_s + (12.0 if session.has_wait else 0.0))
        deadline = time.monotonic() + budget_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return [f"no reply or close within {budget_s:g} s of the last byte (idle timeout "
                        f"{limits.idle_timeout_s:g} s): {session.describe()}"]
            sock.settimeout(left)
            try:
                got = sock.recv(65536)
            except ConnectionResetError:
                break
            except TimeoutError:
                continue
            if not got:
                break
            received += got
    finally:
        sock.close()
    return check_replies(bytes(received), session)


def check_replies(data: bytes, session: Session) -> list[str]:
    """Every byte the daemon sent is a well-formed server frame; errors carry known codes."""
    conn = wire.Connection(wire.Role.CLIENT)
    if data:
        conn.receive_data(data)
    conn.receive_data(b"")
    while True:
        try:
            event = conn.next_event()
        except wire.ProtocolError as exc:
            return [f"daemon sent an invalid frame ({exc.message}): {session.describe()}"]
        if isinstance(event, wire.ConnectionClosed) or event is wire.NEED_DATA:
            return []
        if isinstance(event, wire.Message) and event.kind == "error":
            code = event.fields.get("code")
            if code not in wire.ERROR_CODES:
                return [f"error reply with unknown code {code!r}: {session.describe()}"]
            if code == wire.INTERNAL:
                # By the protocol's own table, `internal` means a daemon bug: hostile input
                # deserves the error that names it (bad_request, size_mismatch, ...).
                return [f"`internal` error ({event.fields.get('message')}) for client input: "
                        f"{session.describe()}"]
