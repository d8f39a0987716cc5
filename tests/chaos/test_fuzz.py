"""The protocol fuzzer against a real daemon, with a well-behaved client saving alongside.

After every run: the daemon is still up and serving, its fd count is back near where it
started, every fuzzed session got well-formed replies and a close (never silence past the
idle timeout), and every generation of the well-behaved client committed intact.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ckptdrain.client import Client, DrainError, wire
from tests.chaos import invariants as inv
from tests.chaos.conftest import fuzz_seeds, fuzz_sessions
from tests.chaos.filetrace import FileTrace, written_paths
from tests.chaos.filetrace import outside as filetrace_outside
from tests.chaos.fuzzer import (
    TALLY,
    FdFactory,
    Limits,
    make_session,
    run_session,
)
from tests.chaos.killer import ChaosDaemon
from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(1800)

IDLE_S = 1.0
OPEN_RANK_IDLE_S = 2.0
ACKS = ("local", "memory")
SEEDS = fuzz_seeds()
SESSIONS = fuzz_sessions(len(SEEDS) * len(ACKS))
FUZZ_ENV = {
    "CKPTDRAIN_LIMITS__CLIENT_IDLE_TIMEOUT_S": str(IDLE_S),
    "CKPTDRAIN_LIMITS__OPEN_RANK_IDLE_TIMEOUT_S": str(OPEN_RANK_IDLE_S),
    "CKPTDRAIN_LIMITS__BLOCK_TIMEOUT_S": "0.5",
    "CKPTDRAIN_LIMITS__MAX_GENERATIONS_IN_FLIGHT": "4",
    "CKPTDRAIN_LIMITS__MAX_STAGED_BYTES": "256MiB",
    "CKPTDRAIN_RETENTION__KEEP_LAST": "100000",
    # The fuzzer sends nothing but bad frames, as fast as it is answered, and checks that each
    # session is answered within the idle timeout; the uid's error allowance would hold it
    # back (test_client_error_allowance.py tests that).
    "CKPTDRAIN_LIMITS__CLIENT_ERRORS_PER_S": "0",
}


def fuzz_daemon(root: Path, sock_dir: Path, **env: str) -> ChaosDaemon:
    return ChaosDaemon(root=root, socket_path=sock_dir / "fz.sock", dest_uri=f"file://{root / 'dest'}",
                       overrides=FUZZ_ENV | env)


class WellBehaved:
    """A training process saving generations the whole time; each must commit intact."""

    def __init__(self, daemon: ChaosDaemon, files: Path, job: str) -> None:
        self.daemon, self.files, self.job = daemon, files, job
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.sent: dict[int, dict[str, str]] = {}  # step -> path -> sha256
        self.thread = threading.Thread(target=self._run, name="well-behaved")

    def __enter__(self) -> WellBehaved:
        self.files.mkdir(exist_ok=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(120)

    def _run(self) -> None:
        step = 0
        with Client(self.daemon.socket_path, timeout_s=60) as c:
            while not self.stop.is_set() and not self.failures:
                step += 1
                blob, filed = os.urandom(48 << 10), os.urandom(20 << 10)
                path = self.files / f"{step}.bin"
                path.write_bytes(filed)
                try:
                    with c.generation(self.job, step, ack="local") as gen:
                        gen.put("model.bin", blob)
                        gen.put_file("optim.bin", path)
                    c.wait(self.job, step, timeout_s=60)
                except DrainError as exc:
                    self.failures.append(f"step {step}: {type(exc).__name__}: {exc}")
                    return
                self.sent[step] = {"model.bin": hashlib.sha256(blob).hexdigest(),
                                   "optim.bin": hashlib.sha256(filed).hexdigest()}

    def check(self, dest: inv.Destination) -> list[str]:
        bad = list(self.failures)
        if not self.sent:
            bad.append("the well-behaved client committed nothing")
        manifests = inv.committed_steps(dest, self.job)
        for step, shards in self.sent.items():
            manifest = manifests.get(step)
            if manifest is None or isinstance(manifest, str):
                bad.append(f"well-behaved step {step} has no valid manifest: {manifest}")
                continue
            for path, sha in shards.items():
                data = dest.read(inv.gen_prefix(self.job, step) + path)
                if data is None or hashlib.sha256(data).hexdigest() != sha:
                    bad.append(f"well-behaved step {step}: {path} is not what was sent")
        return bad


def fuzz_run(daemon: ChaosDaemon, root: Path, seed: int, sessions: int) -> list[str]:
    """``sessions`` fuzzed sessions, 8 at a time, beside a well-behaved client."""
    # Links a hostile user planted in the destination: nothing may be written through them.
    outside = root / "outside"
    outside.mkdir()
    (root / "dest" / "fz6").mkdir(parents=True)
    (root / "dest" / "fz6" / f"{5:020d}").symlink_to(outside)
    (root / "dest" / "fz7").symlink_to(outside)
    daemon.start()
    pid = daemon.pid
    baseline = inv.proc_fds(pid)
    fds = FdFactory(root)
    limits = Limits(IDLE_S, OPEN_RANK_IDLE_S)
    bad: list[str] = []
    with WellBehaved(daemon, root / "good", f"steady-{seed}") as good, \
            ThreadPoolExecutor(8, thread_name_prefix="fuzz") as pool:
        fetchable = (good.job, "model.bin")
        futures = [pool.submit(run_session, daemon.socket_path,
                               make_session(seed, i, fetchable=fetchable), fds, limits)
                   for i in range(sessions)]
        for f in futures:
            bad += f.result()
            TALLY["sessions"] += 1  # (this thread only)
            if not daemon.alive():
                break
    if not daemon.alive():
        return [*bad, f"the daemon died ({daemon.died_by()}); log tail:\n{daemon.log_excerpt(6000)}"]
    bad += good.check(inv.PosixDestination(root / "dest"))
    if written := sorted(str(p.relative_to(outside)) for p in outside.rglob("*")):
        bad.append(f"written through a link planted in the destination: {written[:10]}")
    if isinstance(daemon.injection, FileTrace):
        # Everything the daemon wrote, from the kernel's side: only staging, the destination
        # and its socket's directory (a planted link's target included, which a link-following
        # open would show under its real path).
        allowed = [daemon.staging, root / "dest", daemon.socket_path.parent]
        traced = [p for log in daemon.strace_logs for p in written_paths(log)]
        if not traced:
            bad.append("the file trace recorded no writes at all: the trace is not working")
        if stray := filetrace_outside(traced, allowed):
            bad.append(f"the daemon wrote outside staging and the destination: {stray[:10]}")
    try:
        with Client(daemon.socket_path, timeout_s=30) as c:
            c.status()  # still serving, and still able to say how it stands
    except DrainError as exc:
        bad.append(f"status after the run: {type(exc).__name__}: {exc}")
    if not inv.wait_until(lambda: inv.proc_fds(pid) <= baseline + 4, 15.0):
        bad.append(f"daemon fds: {inv.proc_fds(pid)} after the run, {baseline} before")
    rss = inv.proc_rss_bytes(pid)
    if rss > 768 << 20:
        bad.append(f"daemon RSS {rss >> 20} MiB after the run")
    return bad


@pytest.mark.parametrize("ack", ACKS)
@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed={s}")
def test_fuzz(seed: int, ack: str, tmp_path: Path, sock_dir: Path) -> None:
    """Fuzzed sessions against a daemon whose default boundary is ``ack``; the first seed's
    daemon runs under a file-syscall trace (filetrace.py)."""
    daemon = fuzz_daemon(tmp_path, sock_dir, CKPTDRAIN_ACK=ack, PYTHONDONTWRITEBYTECODE="1")
    if seed == SEEDS[0]:
        daemon.injection = FileTrace()  # type: ignore[assignment]
    try:
        bad = fuzz_run(daemon, tmp_path, seed, SESSIONS)
    finally:
        daemon.kill()
    assert not bad, (f"fuzz run failed; reproduce with CHAOS_SEED={seed} CHAOS_SESSIONS="
                     f"{SESSIONS * len(ACKS)} (ack={ack})\n" + "\n".join(bad[:20]))


# --- targeted cases: one hostile request each --------------------------------------------------


class Raw:
    """One raw connection: frames out (with fds), replies in, parsed by the client machine."""

    def __init__(self, daemon: ChaosDaemon) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(str(daemon.socket_path))
        self.conn = wire.Connection(wire.Role.CLIENT)

    def send(self, kind: str, fields: dict[str, object], fds: list[int] | None = None) -> None:
        frame = wire.encode_message(kind, fields)
        if fds:
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            sent = self.sock.sendmsg([frame], rights)
            self.sock.sendall(frame[sent:])
        else:
            self.sock.sendall(frame)

    def reply(self) -> wire.Message | None:
        """The next reply frame, or None when the daemon closed the connection."""
        while True:
            event = self.conn.next_event()
            if isinstance(event, wire.Message):
                return event
            if isinstance(event, wire.ConnectionClosed):
                return None
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                data = b""
            self.conn.receive_data(data)

    def call(self, kind: str, fields: dict[str, object], fds: list[int] | None = None) -> wire.Message | None:
        self.send(kind, fields, fds)
        return self.reply()

    def close(self) -> None:
        self.sock.close()


def hello_begin(raw: Raw, job: str, step: int = 1) -> None:
    assert (w := raw.call("hello", {"version": wire.PROTOCOL_VERSION})) and w.kind == "welcome"
    assert (b := raw.call("begin", {"job": job, "step": step, "rank": 0, "world_size": 1})) and b.kind == "ok", b


def still_serves(daemon: ChaosDaemon, job: str) -> None:
    assert daemon.alive(), f"the daemon died ({daemon.died_by()}):\n{daemon.log_excerpt()}"
    with Client(daemon.socket_path, timeout_s=30) as c:
        with c.generation(job, 99, ack="local") as gen:
            gen.put("after.bin", b"still here")
        c.wait(job, 99, timeout_s=30)


def test_write_only_memfd_on_put_memfd_is_refused(tmp_path: Path, sock_dir: Path) -> None:
    daemon = fuzz_daemon(tmp_path, sock_dir, CKPTDRAIN_ACK="memory").start()
    try:
        fd, close = FdFactory(tmp_path).make("memfd_wronly")
        raw = Raw(daemon)
        hello_begin(raw, "wronly")
        reply = raw.call("put_memfd", {"job": "wronly", "step": 1, "rank": 0, "path": "m.bin",
                                       "size": FdFactory.SIZES["memfd_wronly"]}, [fd])
        for f in close:
            os.close(f)
        raw.close()
        assert reply is not None and reply.kind == "error" and reply.fields["code"] == wire.BAD_REQUEST, reply
        still_serves(daemon, "wronly")
    finally:
        daemon.kill()


@pytest.mark.parametrize("frame", ["put_fd", "put_memfd"])
@pytest.mark.parametrize("kind", ["regular_wronly", "memfd_wronly", "opath"])
def test_unreadable_fd_is_a_bad_request(tmp_path: Path, sock_dir: Path, frame: str, kind: str) -> None:
    daemon = fuzz_daemon(tmp_path, sock_dir).start()
    try:
        fd, close = FdFactory(tmp_path).make(kind)
        raw = Raw(daemon)
        hello_begin(raw, "unreadable")
        reply = raw.call(frame, {"job": "unreadable", "step": 1, "rank": 0, "path": "u.bin",
                                 "size": FdFactory.SIZES[kind]}, [fd])
        for f in close:
            os.close(f)
        raw.close()
        assert reply is not None and reply.kind == "error", reply
        assert reply.fields["code"] == wire.BAD_REQUEST, reply.fields
        still_serves(daemon, "unreadable")
    finally:
        daemon.kill()


def test_fds_on_frames_that_take_none_are_closed(tmp_path: Path, sock_dir: Path) -> None:
    daemon = fuzz_daemon(tmp_path, sock_dir).start()
    try:
        pid = daemon.pid
        raw = Raw(daemon)
        assert (w := raw.call("hello", {"version": wire.PROTOCOL_VERSION})) and w.kind == "welcome"
        # One request without an fd first: what the daemon opens once, on its first request
        # or its first second of service, is not counted against the frames below.
        assert (s := raw.call("status", {})) and s.kind == "ok"
        baseline = inv.proc_fds(pid)
        for _ in range(40):
            fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            try:
                raw.send("status", {}, [fd])
            except (BrokenPipeError, ConnectionResetError):
                break  # refused and hung up: that is one right answer
            finally:
                os.close(fd)
            if raw.reply() is None:
                break
        # The connection stays open: whatever the daemon still holds, it holds for it. What
        # it keeps, not what a periodic task has open for a moment (CI once counted 3).
        held = [inv.proc_fds(pid) - baseline]
        with contextlib.suppress(AssertionError):
            wait_for(lambda: held.append(inv.proc_fds(pid) - baseline) or held[-1] <= 2,
                     timeout_s=10)
        raw.close()
        assert held[-1] <= 2, (f"the daemon holds {held[-1]} more fds for one connection after "
                               f"40 fds on status frames (counted {held})")
        still_serves(daemon, "fdleak")
    finally:
        daemon.kill()


def test_accept_survives_emfile(tmp_path: Path, sock_dir: Path) -> None:
    probe = fuzz_daemon(tmp_path / "probe", sock_dir).start()
    baseline = inv.proc_fds(probe.pid)
    probe.kill()
    # Room for a handful of connections past start-up, then EMFILE on accept.
    daemon = fuzz_daemon(tmp_path, sock_dir)
    daemon.nofile = baseline + 24
    daemon.start()
    held: list[socket.socket] = []
    try:
        for _ in range(60):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            try:
                s.connect(str(daemon.socket_path))
                s.sendall(wire.encode_message("hello", {"version": wire.PROTOCOL_VERSION}))
            except OSError:
                s.close()
                break
            held.append(s)
        # Every connection the daemon accepted is answered; the rest wait in the backlog.
        assert inv.wait_until(lambda: inv.proc_fds(daemon.pid) >= daemon.nofile - 2
                              or not daemon.alive(), 10)
        for s in held:
            s.close()
        held.clear()
        still_serves(daemon, "emfile")
    finally:
        for s in held:
            s.close()
        daemon.kill()
