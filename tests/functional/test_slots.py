"""Slots and reservations held by the hostile or the dead: each is freed in seconds, and a
well-behaved client gets in."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptdrain.client import Backpressure, DrainError, GenerationFailed, wire
from tests.conftest import DaemonProcess, wait_for
from tests.functional.test_bad_input import RawClient, as_other_user, error_in, frame

needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="dropping to another uid needs root (CI runs as root)")
OTHER_UID = 65534


@contextlib.contextmanager
def held_by_other_uid(socket_path: Path, count: int, uid: int = OTHER_UID,
                      hello: bool = False) -> Iterator[list[bytes]]:
    """``count`` connections held open by a forked child running as ``uid`` until the block
    ends. Yields what each connection had received after a moment (the daemon's first words,
    without the child sending anything unless ``hello``)."""
    ready_r, ready_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            os.close(ready_r)
            os.close(stop_w)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            socks = []
            for _ in range(count):
                s = socket.socket(socket.AF_UNIX)
                s.connect(str(socket_path))
                if hello:
                    # A connection refused at accept may be closed before this is sent: the
                    # refusal is still there to read (on a loaded machine the daemon's
                    # accept won that race and the child died of EPIPE, answering nothing).
                    with contextlib.suppress(OSError):
                        s.sendall(wire.encode_message("hello",
                                                      {"version": wire.PROTOCOL_VERSION}))
                socks.append(s)
            heard = []
            for s in socks:
                s.settimeout(0.5)
                try:
                    heard.append(s.recv(65536).hex())
                except OSError:
                    heard.append("")
            os.write(ready_w, (",".join(heard) + "\n").encode())
            os.read(stop_r, 1)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(stop_r)
    try:
        with os.fdopen(ready_r, "rb") as f:
            line = f.readline().decode().strip()
        yield [bytes.fromhex(h) for h in line.split(",")] if line else []
    finally:
        os.close(stop_w)
        os.waitpid(pid, 0)


@needs_root
def test_refused_uid_is_answered_at_accept_and_holds_no_slot(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACCESS__SOCKET_MODE="0666",
                                   CKPTDRAIN_LIMITS__MAX_CLIENTS="4")
    os.chmod(d.socket_path.parent, 0o755)
    with held_by_other_uid(d.socket_path, 12) as heard:
        # Refused before it sent a byte, with a typed reason...
        assert len(heard) == 12
        for data in heard:
            err = error_in(data)
            assert err["code"] == "permission_denied" and str(OTHER_UID) in err["message"]
        # ... so the allowed user still gets in while the refused one holds its sockets.
        with d.client(timeout_s=5, connect_timeout_s=5) as c:
            assert c.status()["node_id"] == "node-a"


def test_max_clients_refusal_is_typed(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # One uid may hold both (the default share is half of max_clients).
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__MAX_CLIENTS="2",
                                   CKPTDRAIN_LIMITS__MAX_CLIENTS_PER_UID="2")
    held: list[RawClient] = []

    def hold_one() -> bool:
        # The daemon may still count the start-up probe's connection for a moment.
        raw = RawClient(d.socket_path)
        with contextlib.suppress(OSError):
            if raw.call("hello", version=wire.PROTOCOL_VERSION).kind == "welcome":
                held.append(raw)
                return True
        raw.close()
        return False

    try:
        for _ in range(2):
            wait_for(hold_one, timeout_s=10)
        with pytest.raises(Backpressure) as info, d.client(timeout_s=5) as c:
            c.status()
        assert info.value.details["limit"] == "max_clients"
        assert "max_clients" in info.value.message
    finally:
        for raw in held:
            raw.close()


@needs_root
def test_one_uid_cannot_take_every_connection(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACCESS__SOCKET_MODE="0666",
                                   CKPTDRAIN_ACCESS__ALLOWED_UIDS=f"[{OTHER_UID}]",
                                   CKPTDRAIN_LIMITS__MAX_CLIENTS="8",
                                   CKPTDRAIN_LIMITS__MAX_CLIENTS_PER_UID="3")
    os.chmod(d.socket_path.parent, 0o755)
    with held_by_other_uid(d.socket_path, 6, hello=True) as heard:
        kinds = []
        for data in heard:
            conn = wire.Connection(wire.Role.CLIENT)
            conn.receive_data(data)
            ev = conn.next_event()
            kinds.append(ev.fields["details"]["limit"] if ev.kind == "error" else ev.kind)
        assert kinds.count("welcome") == 3
        assert kinds.count("max_clients_per_uid") == 3
        with d.client(timeout_s=5) as c:
            assert c.status()["node_id"] == "node-a"


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    with contextlib.suppress(ConnectionResetError, TimeoutError):
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _rate_limited(make_daemon, **extra: str) -> DaemonProcess:  # type: ignore[no-untyped-def]
    return make_daemon(CKPTDRAIN_LIMITS__CLIENT_MIN_BYTES_PER_S="65536",  # type: ignore[no-any-return]
                       CKPTDRAIN_LIMITS__CLIENT_RATE_GRACE_S="1.0", **extra)


def test_header_trickle_is_dropped_in_seconds(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d = _rate_limited(make_daemon)
    with RawClient(d.socket_path) as raw:
        assert raw.call("hello", version=wire.PROTOCOL_VERSION).kind == "welcome"
        data = frame({"type": "status"})
        t0 = time.monotonic()
        # 2 bytes a second: each byte alone would reset an idle timer forever.
        got = b""
        for i in range(len(data)):
            try:
                raw.sock.sendall(data[i:i + 1])
            except OSError:
                # Cut off between our last read and this byte: the daemon's last word is
                # still in our receive buffer (left unread, a run failed on an empty reply).
                with contextlib.suppress(OSError):
                    raw.sock.settimeout(2)
                    got += raw.sock.recv(65536)
                break
            with contextlib.suppress(TimeoutError, BlockingIOError):
                raw.sock.settimeout(0.5)
                got += raw.sock.recv(65536)
            if got:
                break
            assert time.monotonic() - t0 < 15, "a trickled header kept its connection"
        elapsed = time.monotonic() - t0
    err = error_in(got)
    assert err["code"] == "timeout" and "client_min_bytes_per_s" in err["message"]
    assert elapsed < 6.0


def test_admitted_put_whose_bytes_never_come_frees_its_room(make_daemon) -> None:  # type: ignore[no-untyped-def]
    size = 900 << 20
    d = _rate_limited(make_daemon, CKPTDRAIN_LIMITS__MAX_STAGED_BYTES="1GiB",
                      CKPTDRAIN_LIMITS__ON_FULL="reject")
    with RawClient(d.socket_path) as raw:
        raw.hello_begin(job="never")
        ready = raw.call("put", job="never", step=1, rank=0, path="big", size=size)
        assert ready.kind == "ok" and ready.fields.get("ready")
        assert d.client().status()["staged_bytes"] == size
        t0 = time.monotonic()
        # The bytes never come: the room goes back in the grace period plus a moment.
        wait_for(lambda: d.client().status()["staged_bytes"] == 0, timeout_s=15)
        assert time.monotonic() - t0 < 6.0
        err = error_in(read_all(raw.sock))
    assert err["code"] == "timeout" and "client_min_bytes_per_s" in err["message"]
    with d.client().generation("other", 1) as gen:  # another job gets the room
        gen.put("w", os.urandom(1 << 20))


def test_payload_trickle_is_dropped_in_seconds(make_daemon) -> None:  # type: ignore[no-untyped-def]
    size = 1 << 20
    d = _rate_limited(make_daemon)
    with RawClient(d.socket_path) as raw:
        raw.hello_begin(job="trickle")
        assert raw.call("put", job="trickle", step=1, rank=0, path="a", size=size).kind == "ok"
        raw.sock.sendall(frame({"type": "data"}, payload_len=size) + b"x" * 4096)
        t0 = time.monotonic()
        raw.sock.settimeout(0.2)
        got = b""
        while not got:
            assert time.monotonic() - t0 < 15, "a trickled payload kept its reservation"
            with contextlib.suppress(OSError):
                raw.sock.sendall(b"x" * 100)
            with contextlib.suppress(TimeoutError, BlockingIOError, ConnectionResetError):
                got = raw.sock.recv(65536)
        elapsed = time.monotonic() - t0
    err = error_in(got)
    assert err["code"] == "timeout" and "client_min_bytes_per_s" in err["message"]
    assert elapsed < 6.0
    wait_for(lambda: d.client().status()["staged_bytes"] == 0, timeout_s=10)


WAITER = """
import sys, time
from ckptdrain.client import Backpressure, Client
print("ready", flush=True)
while True:
    try:  # the test's own probes may hold a slot for a moment
        Client(sys.argv[1]).wait("nothing", 1, timeout_s=3000)
    except Backpressure:
        time.sleep(0.05)
"""


def test_abandoned_waits_give_back_their_slots(make_daemon) -> None:  # type: ignore[no-untyped-def]
    clients = 8
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__MAX_CLIENTS=str(clients))
    waiters = [subprocess.Popen([sys.executable, "-c", WAITER, str(d.socket_path)],
                                stdout=subprocess.PIPE, env=os.environ.copy())
               for _ in range(clients)]
    try:
        for w in waiters:
            assert w.stdout is not None and w.stdout.readline().strip() == b"ready"

        def all_waiting() -> bool:
            with contextlib.suppress(Backpressure):
                with d.client(timeout_s=5) as c:
                    c.status()
                return False
            return True

        wait_for(all_waiting, timeout_s=20, interval_s=0.1)  # every slot is taken by a wait
    finally:
        for w in waiters:
            w.send_signal(signal.SIGKILL)
            w.wait()
            if w.stdout is not None:
                w.stdout.close()

    def good_client_gets_in() -> bool:
        with contextlib.suppress(Backpressure):
            with d.client(timeout_s=5) as c:
                c.status()
            return True
        return False

    wait_for(good_client_gets_in, timeout_s=10, interval_s=0.1)


def test_failed_memory_generation_gives_back_its_staging(make_daemon) -> None:  # type: ignore[no-untyped-def]
    size = 64 << 20
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACK="memory",
                                   CKPTDRAIN_LIMITS__MAX_MEMORY_BYTES="1GiB",
                                   CKPTDRAIN_LIMITS__MAX_STAGED_BYTES=str(size + size // 2),
                                   CKPTDRAIN_LIMITS__BLOCK_TIMEOUT_S="1.0")
    payload = os.urandom(size)
    with d.client() as c:
        with pytest.raises(GenerationFailed), c.generation("mem", 1) as gen:  # seal refused
            # Deferred: it stays staged until the whole generation has drained.
            gen.put("a", payload, deferred=True)
            wait_for(lambda: c.status()["staged_bytes"] == size, timeout_s=20)
            # No room on staging for the second: its persist gives up and the generation fails.
            gen.put("b", payload)
            wait_for(lambda: [g["state"] for g in c.status()["generations"]] == ["failed"],
                     timeout_s=20)
        # It lost a shard that never reached local storage: no retry can save it, so what
        # it still holds on staging is given back.
        with pytest.raises(GenerationFailed):
            c.retry("mem", 1)
        wait_for(lambda: c.status()["staged_bytes"] == 0, timeout_s=10)


@needs_root
def test_one_uid_cannot_open_every_generation(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACCESS__SOCKET_MODE="0666",
                                   CKPTDRAIN_ACCESS__ALLOWED_UIDS=f"[{OTHER_UID}]",
                                   CKPTDRAIN_LIMITS__MAX_GENERATIONS_PER_UID="2")
    os.chmod(d.socket_path.parent, 0o755)
    with d.client() as c, c.generation("a", 1), c.generation("b", 1):
        with pytest.raises(Backpressure) as info, c.generation("c", 1):
            pass
        assert info.value.details["limit"] == "max_generations_per_uid"
        assert as_other_user(d.socket_path, "theirs") == "ALLOWED"  # the others still can


def test_one_uid_cannot_reserve_every_byte(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__MAX_RESERVED_BYTES_PER_UID="1MiB")
    with d.client() as c, c.generation("a", 1, world_size=2) as gen:
        gen.put("x", os.urandom(600 << 10), deferred=True)  # held until the others drain
        with pytest.raises(Backpressure) as info:
            gen.put("y", os.urandom(600 << 10))
        assert info.value.details["limit"] == "max_reserved_bytes_per_uid"
        gen.put("z", os.urandom(300 << 10))  # what fits the share is taken


def test_a_memfd_waiting_for_staging_lets_go_when_its_generation_ends(make_daemon) -> None:  # type: ignore[no-untyped-def]
    size = 64 << 20
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACK="memory",
                                   CKPTDRAIN_LIMITS__MAX_MEMORY_BYTES="1GiB",
                                   CKPTDRAIN_LIMITS__MAX_STAGED_BYTES=str(size + size // 2),
                                   CKPTDRAIN_LIMITS__BLOCK_TIMEOUT_S="120")
    payload = os.urandom(size)
    with d.client() as c, c.generation("other", 1, world_size=2) as other:
        # Another job's shard fills staging (deferred: it stays until rank 1 comes).
        other.put("a", payload, deferred=True)
        wait_for(lambda: (c.status()["staged_bytes"], c.status()["memory_bytes"]) == (size, 0),
                 timeout_s=20)
        with c.generation("mem", 1) as gen:
            gen.put("b", payload)  # acknowledged in RAM; its persist waits for staging room
            assert c.status()["memory_bytes"] == size
            gen.abort("giving up on this step")
        # The generation ended: the RAM it held goes back now, not at block_timeout_s.
        wait_for(lambda: c.status()["memory_bytes"] == 0, timeout_s=10)


def test_an_abort_racing_a_begin_leaves_no_slot_held(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found in a long run with operator aborts: an abort that landed while a begin waited on
    # the journal ended the generation before it held its slot, and the begin then handed the
    # slot to the ended generation, which never gave it back. With one slot per job the job
    # refused every begin ("max_generations_in_flight stayed full") until a restart, and the
    # job could not be forgotten to make room under max_jobs. Raced here many times over.
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__MAX_GENERATIONS_IN_FLIGHT="1",
                                   CKPTDRAIN_LIMITS__BLOCK_TIMEOUT_S="2",
                                   CKPTDRAIN_LOG_LEVEL="info")
    operator = d.client(timeout_s=30)
    step = 0

    def save(step: int, rank: int, world_size: int) -> None:
        with contextlib.suppress(GenerationFailed), d.client(timeout_s=30) as c, \
                c.generation("raced", step, rank=rank, world_size=world_size) as gen:
            gen.put(f"r{rank}.bin", b"x" * 1000)

    for round_ in range(150):
        step += 1
        ranks = [threading.Thread(target=save, args=(step, r, 2)) for r in range(2)]
        for t in ranks:
            t.start()
        time.sleep((round_ % 7) * 0.004)
        with contextlib.suppress(DrainError):
            operator.abort_generation("raced", step, reason="raced")
        for t in ranks:
            t.join(60)
        step += 1
        try:
            save(step, 0, 1)  # a new step of the job still begins
        except Backpressure as exc:
            raise AssertionError(f"a slot was left held after round {round_}: {exc}") from None


def _pump_threads(pid: int) -> int:
    """The daemon's socket-pump threads alive now (named ``ckptdrain-pump`` in the kernel)."""
    count = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            count += (task / "comm").read_text().startswith("ckptdrain-pump")
    return count


def test_a_reload_raising_max_clients_gives_the_new_connections_pumps(  # type: ignore[no-untyped-def]
        make_daemon, tmp_path: Path) -> None:
    # Found attacking the reload: the socket pumps (one thread per connection) were sized by
    # the max_clients the daemon started with. A reload raising it admitted more connections,
    # and a hand-off beyond the first max_clients waited for a pump while the others' slow
    # clients held theirs, and was given up on as stalled (a `timeout` error) mid-save.
    config = tmp_path / "c.toml"
    limits = ('[limits]\nclient_min_bytes_per_s = 1\nclient_idle_timeout_s = 3\n'
              'pipe_handoff = false\n')
    config.write_text(limits + "max_clients = 2\nmax_clients_per_uid = 2\n")
    d: DaemonProcess = make_daemon(start=False, CKPTDRAIN_CONFIG=str(config))
    d.start()
    config.write_text(limits + "max_clients = 8\nmax_clients_per_uid = 8\n")
    os.kill(d.pid, signal.SIGHUP)
    wait_for(lambda: "event=reloaded" in d.log(), timeout_s=20)
    size = 1 << 20
    done = threading.Event()

    def trickle(job: str) -> None:
        # A slow client: a byte every 0.2 s, within its idle timeout, holding its pump.
        with RawClient(d.socket_path) as raw:
            raw.hello_begin(job=job)
            assert raw.call("put", job=job, step=1, rank=0, path="a", size=size).kind == "ok"
            raw.sock.sendall(frame({"type": "data"}, payload_len=size) + b"x")
            while not done.wait(0.2):
                raw.sock.sendall(b"x")

    slow = [threading.Thread(target=trickle, args=(f"slow{i}",), daemon=True) for i in range(2)]
    for t in slow:
        t.start()
    try:
        wait_for(lambda: _pump_threads(d.pid) >= 2, timeout_s=20)
        with RawClient(d.socket_path) as raw:
            raw.hello_begin(job="fast")
            assert raw.call("put", job="fast", step=1, rank=0, path="a", size=size).kind == "ok"
            # (Refused, the daemon answers and closes before it has read every byte.)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                raw.sock.sendall(frame({"type": "data"}, payload_len=size) + b"y" * size)
            reply = raw.reply()
            assert reply.kind == "ok", reply.fields
    finally:
        done.set()
        for t in slow:
            t.join(20)
