"""Bare baselines that need a process of their own: a plain Unix-socket receiver.

``python -m tests.bench.bare receive SOCKET OUTDIR [--discard]`` serves one connection at a
time. Per message: an 8-byte little-endian length, then that many bytes, received with
``recv_into`` a reused 1 MiB buffer (as the daemon does) and written to a new file in OUTDIR
(or dropped with ``--discard``); then one byte back, the acknowledgement. A zero length ends a
run: the files are removed (outside the sender's timed span) and acknowledged.
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import sys
from pathlib import Path

from tests.bench.workload import write_all

BUFFER_BYTES = 1 << 20
HEADER = struct.Struct("<Q")


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise ConnectionError("sender left")
        out += chunk
    return bytes(out)


def serve_one(conn: socket.socket, outdir: Path, discard: bool) -> None:
    buf = bytearray(BUFFER_BYTES)
    view = memoryview(buf)
    count = 0
    while True:
        try:
            (size,) = HEADER.unpack(_recv_exactly(conn, HEADER.size))
        except ConnectionError:
            return
        if size == 0:
            for path in outdir.iterdir():
                path.unlink()
            conn.sendall(b"k")
            continue
        count += 1
        fd = -1 if discard else os.open(outdir / f"{count}.bin",
                                         os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            left = size
            while left:
                n = conn.recv_into(view[:min(left, BUFFER_BYTES)])
                if n == 0:
                    raise ConnectionError("sender left mid-message")
                if fd >= 0:
                    write_all(fd, view[:n])
                left -= n
        finally:
            if fd >= 0:
                os.close(fd)
        conn.sendall(b"k")


def send(sock: socket.socket, data: bytes | bytearray | memoryview) -> None:
    """One message and its acknowledgement (the sender's side of the protocol above)."""
    with memoryview(data) as view:
        sock.sendall(HEADER.pack(len(view)))
        sock.sendall(view)
    if sock.recv(1) != b"k":
        raise ConnectionError("the bare receiver did not acknowledge")


def end_run(sock: socket.socket) -> None:
    sock.sendall(HEADER.pack(0))
    if sock.recv(1) != b"k":
        raise ConnectionError("the bare receiver did not acknowledge the end of a run")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.bench.bare")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("receive")
    r.add_argument("socket", type=Path)
    r.add_argument("outdir", type=Path)
    r.add_argument("--discard", action="store_true")
    ns = p.parse_args(argv)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(ns.socket))
    listener.listen(4)
    while True:
        conn, _ = listener.accept()
        with conn:
            serve_one(conn, ns.outdir, ns.discard)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
