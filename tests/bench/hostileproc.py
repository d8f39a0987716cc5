"""Hostile clients, in a process of their own (``python -m tests.bench.hostileproc``).

``SOCKET COUNT [--uid UID]``: ``COUNT`` threads (run as ``UID`` when given: another user of
the node, as a hostile user is), in three kinds taking turns: *tricklers* send ``hello``
and then a frame one byte every half second; *holders* connect, say ``hello`` and then
nothing; *fuzzers* send mutated frames (random bytes in a valid frame, truncated frames,
wrong magic, oversize lengths, unknown kinds) about twenty times a second. Each reconnects
whenever the daemon hangs up. Prints ``ready`` once every thread has connected once, runs
until stdin closes, then prints one JSON line of what they did and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import struct
import sys
import threading

from ckptdrain.client import wire

KINDS = ("trickle", "hold", "fuzz")


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(2.0)
    s.connect(path)
    return s


def _hello() -> bytes:
    return wire.encode_message("hello", {"version": wire.PROTOCOL_VERSION})


def _mutated(rng: random.Random) -> bytes:
    good = wire.encode_message("put", {"job": "fuzz", "step": rng.randrange(1, 10**6), "rank": 0,
                                       "path": "x.bin", "size": rng.randrange(1 << 20)})
    choice = rng.randrange(5)
    if choice == 0:  # flip bytes in the header
        data = bytearray(good)
        for _ in range(rng.randrange(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if choice == 1:  # truncated
        return good[: rng.randrange(1, len(good))]
    if choice == 2:  # wrong magic
        return b"XXXX" + good[4:]
    if choice == 3:  # a length far over the limit
        return struct.pack(">4sIQ", wire.MAGIC, rng.randrange(1 << 17, 1 << 31), 0)
    return wire.encode_message("status", {}) + b'{"type": "frobnicate"}'


class Hostile:
    def __init__(self, path: str, count: int) -> None:
        self.path = path
        self.count = count
        self.stop = threading.Event()
        self.connected = threading.Barrier(count + 1)
        self.counts = dict.fromkeys(("connections", "frames", "bytes", "refused"), 0)
        self._lock = threading.Lock()

    def add(self, **delta: int) -> None:
        with self._lock:
            for key, n in delta.items():
                self.counts[key] += n

    def run(self, kind: str, seed: int) -> None:
        rng = random.Random(seed)
        first = True
        while not self.stop.is_set():
            try:
                s = _connect(self.path)
            except OSError:
                self.add(refused=1)
                self.stop.wait(0.1)
                continue
            self.add(connections=1)
            if first:
                first = False
                self.connected.wait()
            try:
                getattr(self, f"_{kind}")(s, rng)
            except OSError:
                pass  # the daemon hung up: reconnect
            finally:
                s.close()

    def _trickle(self, s: socket.socket, rng: random.Random) -> None:
        s.sendall(_hello())
        frame = wire.encode_message("status", {})
        while not self.stop.is_set():
            for i in range(len(frame)):
                s.sendall(frame[i:i + 1])
                self.add(bytes=1)
                if self.stop.wait(0.5):
                    return

    def _hold(self, s: socket.socket, rng: random.Random) -> None:
        s.sendall(_hello())
        s.settimeout(None)
        while not self.stop.is_set():
            s.settimeout(1.0)
            try:
                if not s.recv(65536):
                    return
            except TimeoutError:
                continue

    def _fuzz(self, s: socket.socket, rng: random.Random) -> None:
        s.sendall(_hello())
        while not self.stop.is_set():
            data = _mutated(rng)
            s.sendall(data)
            self.add(frames=1, bytes=len(data))
            self.stop.wait(0.05)
            s.setblocking(False)
            try:
                if s.recv(65536) == b"":
                    return
            except BlockingIOError:
                pass
            finally:
                s.setblocking(True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.bench.hostileproc")
    p.add_argument("socket")
    p.add_argument("count", type=int)
    p.add_argument("--uid", type=int, help="drop to this uid (and gid) first")
    ns = p.parse_args(argv)
    if ns.uid is not None:
        os.setgroups([])
        os.setgid(ns.uid)
        os.setuid(ns.uid)
    hostile = Hostile(ns.socket, ns.count)
    threads = [threading.Thread(target=hostile.run, args=(KINDS[i % len(KINDS)], i), daemon=True)
               for i in range(ns.count)]
    for t in threads:
        t.start()
    hostile.connected.wait(timeout=60)
    print("ready", flush=True)
    sys.stdin.read()
    hostile.stop.set()
    for t in threads:
        t.join(5)
    print(json.dumps(hostile.counts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
