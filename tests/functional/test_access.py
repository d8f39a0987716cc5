"""Users kept to their own jobs on a shared node: who may connect (supplementary groups
count), what each user sees, and a socket group given by number."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptdrain.client import (
    Backpressure,
    Client,
    DaemonUnavailable,
    GenerationFailed,
    PermissionDenied,
)
from ckptdrain.daemon.fetcher import MAX_IDLE_FETCHERS
from tests.conftest import DaemonProcess, strace_attached, wait_for
from tests.functional import otheruser

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="dropping to another uid needs root (CI runs as root)")
OTHER_UID = 65534
SITE_GID = 4242
SERVICE_UID = 4301  # a daemon run as its own service user


def run_as(fn: Callable[[], str], uid: int = OTHER_UID, gid: int = OTHER_UID,
           groups: tuple[int, ...] = ()) -> str:
    """``fn()`` in a forked child running as ``uid``/``gid`` with supplementary ``groups``."""
    return otheruser.run_as(uid, fn, gid=gid, groups=groups)


def open_to_all(d: DaemonProcess) -> None:
    os.chmod(d.socket_path.parent, 0o755)


def save(socket_path: Path, job: str) -> str:
    with Client(socket_path, timeout_s=20).generation(job, 1) as gen:
        gen.put("w", b"bytes")
    return "SAVED"


def test_a_supplementary_group_is_allowed(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # What the deployment guide says to do: `usermod -aG site alice`. The group is alice's
    # supplementary group, not her primary one.
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACCESS__SOCKET_MODE="0666",
                                   CKPTDRAIN_ACCESS__ALLOWED_GIDS=f"[{SITE_GID}]")
    open_to_all(d)
    assert run_as(lambda: save(d.socket_path, "alice"), groups=(SITE_GID,)) == "SAVED"
    denied = run_as(lambda: save(d.socket_path, "mallory"))
    assert denied.startswith("DENIED") and str(OTHER_UID) in denied


def test_numeric_socket_group(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACCESS__SOCKET_GROUP=str(SITE_GID))
    assert d.socket_path.stat().st_gid == SITE_GID


def test_a_user_sees_only_their_own_jobs(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACCESS__SOCKET_MODE="0666",
                                   CKPTDRAIN_ACCESS__ALLOWED_UIDS=f"[{OTHER_UID}]")
    open_to_all(d)
    save(d.socket_path, "root-secret")
    Client(d.socket_path).wait("root-secret", 1, timeout_s=30)

    def look() -> str:
        c = Client(d.socket_path, timeout_s=20)
        save(d.socket_path, "mine")
        seen = sorted({g["job"] for g in c.status()["generations"]})
        out = [f"status={seen}"]
        for what, call in (("wait", lambda: c.wait("root-secret", 1, timeout_s=5)),
                           ("latest", lambda: c.latest("root-secret"))):
            try:
                out.append(f"{what}={call()}")
            except PermissionDenied as exc:
                out.append(f"{what}=denied:{'root-secret' in str(exc)}")
        return " ".join(out)

    assert run_as(look) == "status=['mine'] wait=denied:True latest=denied:True"
    # Root (an operator) sees every job.
    assert {g["job"] for g in Client(d.socket_path).status()["generations"]} == {"root-secret", "mine"}


def test_another_users_ranks_are_never_merged_into_a_job(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Two nodes, one destination: root saves rank 0 of "shared" on node a, and another user
    # claims rank 1 of the same job and step on node b.
    a: DaemonProcess = make_daemon("node-a")
    b: DaemonProcess = make_daemon("node-b", CKPTDRAIN_ACCESS__SOCKET_MODE="0666",
                                   CKPTDRAIN_ACCESS__ALLOWED_UIDS=f"[{OTHER_UID}]")
    open_to_all(b)
    with Client(a.socket_path).generation("shared", 1, rank=0, world_size=2) as gen:
        gen.put("rank0", b"root's bytes")

    def claim() -> str:
        with Client(b.socket_path, timeout_s=20).generation("shared", 1, rank=1,
                                                            world_size=2) as gen:
            gen.put("rank1", b"someone else's bytes")
        return "SEALED"

    assert run_as(claim) == "SEALED"
    for node in (a, b):
        with pytest.raises(GenerationFailed, match="different owners"):
            Client(node.socket_path).wait("shared", 1, timeout_s=60)
    assert not (a.dest / "shared" / f"{1:020d}" / "MANIFEST.json").exists()


def test_a_backpressure_error_names_no_other_users_shards(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACCESS__SOCKET_MODE="0666",
                                   CKPTDRAIN_ACCESS__ALLOWED_UIDS=f"[{OTHER_UID}]",
                                   CKPTDRAIN_LIMITS__MAX_STAGED_BYTES="32MiB",
                                   CKPTDRAIN_LIMITS__ON_FULL="reject")
    open_to_all(d)
    with Client(d.socket_path).generation("root-secret", 1, world_size=2) as gen:
        gen.put("held.bin", os.urandom(30 << 20), deferred=True)  # undrained until rank 1 comes

        def fill() -> str:
            with Client(d.socket_path, timeout_s=20).generation("mine", 1) as mine:
                mine.put("big.bin", os.urandom(8 << 20))
            return "SAVED"

        out = run_as(fill)
    assert "backpressure" in out and "root-secret" not in out, out


def test_one_users_refusals_do_not_hide_anothers(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking the daemon as a second user: refusals at a limit were logged once a
    # minute per limit, whoever met it, so a user knocking at their own max_clients_per_uid
    # hid that another user met it too.
    second = OTHER_UID - 1
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACCESS__SOCKET_MODE="0666",
                                   CKPTDRAIN_ACCESS__ALLOWED_UIDS=f"[{OTHER_UID}, {second}]",
                                   CKPTDRAIN_LIMITS__MAX_CLIENTS_PER_UID="1")
    open_to_all(d)

    def over_the_cap() -> str:
        held = Client(d.socket_path, timeout_s=20)
        held.status()  # one connection, kept in the client's pool
        try:
            Client(d.socket_path, timeout_s=20).status()
        except Backpressure as exc:
            return f"REFUSED {exc}"
        finally:
            held.close()
        return "SERVED"

    for uid in (OTHER_UID, OTHER_UID, second):
        out = run_as(over_the_cap, uid=uid, gid=uid)
        assert out.startswith("REFUSED") and "max_clients_per_uid" in out, out
    refused = [line for line in d.log().splitlines() if "event=client_refused" in line]
    assert any(f"uid={OTHER_UID}" in line for line in refused), refused
    assert any(f"uid={second}" in line for line in refused), refused
    assert len(refused) == 2, refused  # the first user's second refusal is held back


def test_the_daemons_own_uid_acts_for_any_owner(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As documented (root and the daemon's own uid act for any owner), but a begin or an
    # abort_generation from the daemon's uid (a unit's User=) of a user's job was refused:
    # the write check let only uid 0 through.
    svc = short_tmp / "svc"
    svc.mkdir()
    os.chown(svc, SERVICE_UID, SERVICE_UID)
    os.chmod(short_tmp, 0o755)
    # A daemon run as a service user that opens its own socket: its clients are told its uid
    # (they trust no other listener than root and themselves unless told).
    monkeypatch.setenv("CKPTDRAIN_DAEMON_UID", str(SERVICE_UID))
    d = DaemonProcess(root=svc, socket_path=svc / "d.sock", dest_uri=f"file://{svc / 'dest'}",
                      overrides={"CKPTDRAIN_ACCESS__SOCKET_MODE": "0666",
                                 "CKPTDRAIN_ACCESS__ALLOWED_UIDS": f"[{OTHER_UID}]"})
    log = svc / "daemon.log"
    pid = otheruser.serve_as(SERVICE_UID, d.env(), log, d.socket_path)
    try:
        def user_saves(step: int) -> str:
            c = Client(d.socket_path, timeout_s=20)
            with c.generation("theirs", step) as gen:
                gen.put("w", b"the user's bytes")
            c.wait("theirs", step, timeout_s=30)
            return "COMMITTED"

        def service_acts() -> str:
            c = Client(d.socket_path, timeout_s=20)
            with c.generation("theirs", 2) as gen:
                gen.put("w", b"saved by the operator")
            c.wait("theirs", 2, timeout_s=30)
            try:
                with c.generation("theirs", 3) as gen:
                    gen.put("w", b"to be aborted", deferred=True)
                    c.abort_generation("theirs", 3, reason="operator")
            except GenerationFailed as exc:
                return "ACTED" if "aborted by an operator" in str(exc) else f"FAILED {exc}"
            return "NOT ABORTED"

        assert run_as(lambda: user_saves(1)) == "COMMITTED"
        assert run_as(service_acts, uid=SERVICE_UID, gid=SERVICE_UID) == "ACTED"
        # The job is still the user's: the operator's save was made for its owner.
        assert run_as(lambda: user_saves(4)) == "COMMITTED"
        parts = list((svc / "dest" / "theirs" / f"{2:020d}" / "_parts").iterdir())
        assert parts and all(json.loads(p.read_text())["owner_uid"] == OTHER_UID for p in parts)
    finally:
        assert otheruser.stop(pid) == 0, log.read_text()


@pytest.mark.parametrize("layout", ["in_it", "own_dir", "link"])
def test_a_socket_another_user_put_in_a_shared_directory_is_refused(
    short_tmp: Path, layout: str
) -> None:
    # Found attacking: with no XDG_RUNTIME_DIR the client's default is /tmp/ckptdrain-<uid>.sock.
    # Another user listening there first (the sticky /tmp keeps the owner from removing it)
    # was sent shard bytes and the descriptors of put_file's source and a fetch's target, and
    # read one and overwrote the other. The client now asks the kernel who listens. Attacking
    # that: rules about where the socket lies were passed by a directory of the attacker's
    # own in /tmp (XDG_RUNTIME_DIR=/tmp/runtime-<uid>) and by a link there to one; only root,
    # the caller and a uid the caller names are trusted now.
    os.chmod(short_tmp, 0o755)
    shared = short_tmp / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # as /tmp
    where = {"in_it": shared, "own_dir": shared / f"runtime-{SERVICE_UID}",
             "link": shared / "ckd"}[layout]
    path = where / f"ckptdrain-{SERVICE_UID}.sock"

    def squat() -> str:
        import socket

        if layout == "own_dir":
            where.mkdir(mode=0o755)
        elif layout == "link":
            (shared / ".mine").mkdir(mode=0o711)
            where.symlink_to(shared / ".mine")
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        os.chmod(path, 0o777)
        server.listen(1)
        server.settimeout(20)
        conn, _ = server.accept()
        conn.settimeout(3)
        got = b""
        try:
            while chunk := conn.recv(65536):
                got += chunk
        except TimeoutError:
            pass
        server.accept()[0].close()  # the victim's daemon, looking whether the path is free
        return f"GOT {len(got)} bytes"

    squatter = otheruser.start_as(OTHER_UID, squat)
    wait_for(path.exists)  # the squatter listens

    def victim() -> str:
        try:
            Client(path, timeout_s=5).status()
        except DaemonUnavailable as exc:
            return f"REFUSED {exc}"
        return "CONNECTED"

    said = run_as(victim, uid=SERVICE_UID, gid=SERVICE_UID)
    assert said.startswith("REFUSED"), said
    assert f"served by uid {OTHER_UID}, neither you nor root" in said

    # Imported here: the child's uid may not read the library's files.
    from ckptdrain.daemon.startup import StartupError, socket_free

    def victims_daemon() -> str:
        try:
            socket_free(path)
        except StartupError as exc:
            return f"HELD {exc}"
        return "FREE"

    said = run_as(victims_daemon, uid=SERVICE_UID, gid=SERVICE_UID)
    assert f"held by a process of uid {OTHER_UID}, not this daemon's user" in said, said
    assert otheruser.answer(squatter) == "GOT 0 bytes"  # not even the hello


def test_one_users_calls_stuck_on_its_own_files_never_hold_up_another_users_saves(
        make_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Found attacking: the daemon's shared data-plane threads also ran the steps on a file a
    client passed (a fetch's target, a put_fd's source). A user's fetches into files on a
    frozen filesystem (fsfreeze; one it serves itself, sshfs or any FUSE mount, hangs at its
    will) held every one of those threads, and every other user's save waited behind them
    until the client timed out. Here strace holds each ftruncate of a fetch's target back, as
    a frozen filesystem does; the other user's save needs no ftruncate, only a thread."""
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACCESS__SOCKET_MODE="0666",
                                   CKPTDRAIN_ACCESS__ALLOWED_UIDS=f"[{OTHER_UID}]",
                                   CKPTDRAIN_LIMITS__IO_THREADS="4")
    open_to_all(d)

    def save_theirs() -> str:
        save(d.socket_path, "theirs")
        Client(d.socket_path, timeout_s=20).wait("theirs", 1, timeout_s=30)
        return "SAVED"

    assert run_as(save_theirs) == "SAVED"
    # Opened here and inherited by the child (its uid cannot reach tmp_path): more fetches
    # than the daemon has data-plane threads.
    targets = [os.open(tmp_path / f"target{i}", os.O_RDWR | os.O_CREAT, 0o600) for i in range(6)]

    def fetch_all() -> str:
        got: list[str] = []

        def fetch(fd: int) -> None:
            Client(d.socket_path, timeout_s=120).fetch_local("theirs", 1, "w", fd)
            got.append("fetched")

        threads = [threading.Thread(target=fetch, args=(fd,)) for fd in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return " ".join(got)

    try:
        with strace_attached(d.pid, "-e", "trace=ftruncate",
                             "-e", "inject=ftruncate:delay_enter=60000000"):
            fetcher = otheruser.start_as(OTHER_UID, fetch_all)
            c = Client(d.socket_path, timeout_s=15)
            wait_for(lambda: c.status()["io_threads"]["busy"] >= len(targets))
            # Not one of its fetches has come back (each is held for a minute), and root's
            # save goes through all the same.
            with c.generation("mine", 1, rank=0, world_size=1) as gen:
                gen.put("w", b"root's bytes")
            assert c.wait("mine", 1, timeout_s=30)["committed"]
        # Let go, the other user's fetches end too.
        assert otheruser.answer(fetcher) == " ".join(["fetched"] * len(targets))
    finally:
        for fd in targets:
            os.close(fd)


def test_one_users_fetches_stuck_writing_its_files_never_hold_up_another_users_fetch(
        make_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Found attacking: the reads from the destination for every client ran on one fetcher,
    whose backend writes into the client's file in a few threads (destination.max_concurrency
    + 4). A user's fetches into files on a frozen filesystem held them all, and every other
    user's fetch from the destination timed out behind them. Here the other user fetches
    into memfds, which the kernel copies into with sendfile (a memfd is not on the
    destination's filesystem), and strace holds each sendfile back as a frozen filesystem
    holds a write; root's fetch into a file beside the destination needs none."""
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACCESS__SOCKET_MODE="0666",
                                   CKPTDRAIN_ACCESS__ALLOWED_UIDS=f"[{OTHER_UID}]",
                                   CKPTDRAIN_DESTINATION__MAX_CONCURRENCY="1")
    open_to_all(d)
    stuck = 1 + 4 + 2  # more than the threads of one fetcher's POSIX backend

    def save_theirs() -> str:
        save(d.socket_path, "theirs")
        Client(d.socket_path, timeout_s=20).wait("theirs", 1, timeout_s=30)
        return "SAVED"

    assert run_as(save_theirs) == "SAVED"
    save(d.socket_path, "mine")
    c = Client(d.socket_path, timeout_s=15)
    c.wait("mine", 1, timeout_s=30)

    def fetch_all() -> str:
        got: list[str] = []

        def fetch() -> None:
            into = os.memfd_create("target")
            try:
                Client(d.socket_path, timeout_s=120).fetch_from_destination("theirs", 1, "w",
                                                                            into)
                got.append("fetched")
            finally:
                os.close(into)

        threads = [threading.Thread(target=fetch) for _ in range(stuck)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return " ".join(got)

    log = tmp_path / "strace.log"
    with strace_attached(d.pid, "-e", "trace=sendfile", "-e",
                         "inject=sendfile:delay_enter=60000000", log=log):
        fetcher = otheruser.start_as(OTHER_UID, fetch_all)
        # Every thread of a fetcher's backend is inside a held sendfile.
        wait_for(lambda: log.read_text().count("sendfile(") >= stuck - 2)
        mine = os.open(tmp_path / "mine.bin", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            assert c.fetch_from_destination("mine", 1, "w", mine)["size"] == len(b"bytes")
        finally:
            os.close(mine)
    # Let go, the other user's fetches end too.
    assert otheruser.answer(fetcher) == " ".join(["fetched"] * stuck)


def _threads_named(pid: int, prefix: str) -> int:
    """How many of the process's threads have a kernel name starting with ``prefix``."""
    count = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text()
        except OSError:  # ended meanwhile
            continue
        count += name.startswith(prefix)
    return count


def test_a_users_own_threads_end_with_its_last_connection(
        make_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Found attacking the per-uid lanes and fetchers: each uid that ever passed an fd kept
    its data-plane lane's threads, and each that ever read from the destination its fetcher
    (a thread, an event loop's fds, a backend: on s3:// an S3 client and its connections),
    to the daemon's end; on a node shared by many users over weeks, a thread count and fds
    that only grow. A uid's lane now ends with its last connection, and of the fetchers of
    uids with none, only the MAX_IDLE_FETCHERS most recently used are kept."""
    users = [OTHER_UID - 1 - i for i in range(MAX_IDLE_FETCHERS + 3)]
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACCESS__SOCKET_MODE="0666",
                                   CKPTDRAIN_ACCESS__ALLOWED_UIDS=str(users))
    open_to_all(d)
    (tmp_path / "source").write_bytes(b"theirs" * 1000)
    per_fetcher = 0
    for uid in users:
        # Opened here and inherited by the child (its uid cannot reach tmp_path).
        source = os.open(tmp_path / "source", os.O_RDONLY)
        target = os.open(tmp_path / f"target{uid}", os.O_RDWR | os.O_CREAT, 0o600)

        def save_and_read(job: str = f"theirs{uid}", source: int = source,
                          target: int = target) -> str:
            c = Client(d.socket_path, timeout_s=20)
            with c.generation(job, 1, rank=0, world_size=1) as gen:
                gen.put_file("w", source)  # its fstat and copy: in the uid's own lane
            c.wait(job, 1, timeout_s=30)
            got = c.fetch_from_destination(job, 1, "w", target)  # by the uid's fetcher
            return f"READ {got['size']}"

        try:
            assert run_as(save_and_read, uid=uid, gid=uid) == "READ 6000"
        finally:
            os.close(source)
            os.close(target)
        # Its process has ended, and its connections with it.
        wait_for(lambda: _threads_named(d.pid, "ckptdrain-fd") == 0)
        per_fetcher = per_fetcher or _threads_named(d.pid, "ckptdrain-fetch")
    assert per_fetcher
    wait_for(lambda: _threads_named(d.pid, "ckptdrain-fetch")
             <= per_fetcher * MAX_IDLE_FETCHERS)
