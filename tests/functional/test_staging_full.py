"""The staging filesystem fills (another user fills the disk): what the daemon did is
recorded once there is room again, new work is refused as backpressure, an acknowledged
memory hand-off waits for room, and nothing acknowledged is lost across a restart.

Found attacking the staging side: a drain whose ``drained`` record could not be written (SQLite
"database or disk is full") failed its generation as an internal error, its staged copy was
removed because memory already counted the shard drained, and the restart then found the
journal's ``staged`` row with no file: the acknowledged step could never commit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client import Backpressure, DaemonUnavailable
from tests.chaos.killer import STRACE, ChaosDaemon, Injection
from tests.conftest import DaemonProcess, traced, wait_for

MiB = 1 << 20


def fill(mnt: Path) -> Path:
    """Write a file until the filesystem has no byte left; returns it."""
    filler = mnt / "someone-else"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (bytes(MiB), bytes(4096), bytes(1)):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, chunk)
    finally:
        os.close(fd)
    return filler


def _staged_data(d: DaemonProcess, mnt: Path) -> list[str]:
    return [n for n in os.listdir(mnt / "staging" / "shards") if n.endswith(".data")]


@pytest.mark.parametrize("then", ["room", "kill -9, room, restart"])
def test_a_drain_recorded_while_the_journal_is_full_waits_for_room(
    make_daemon: Any, small_tmpfs: Path, then: str
) -> None:
    d: DaemonProcess = make_daemon(CKPTDRAIN_STAGING_DIR=str(small_tmpfs / "staging"),
                                   CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="2MiB")
    c = d.client(timeout_s=30)
    data = os.urandom(8 * MiB)
    with c.generation("j", 1) as gen:
        gen.put("a", data)  # acknowledged: on the staging disk, journalled
    filler = fill(small_tmpfs)
    drained = d.dest / "j" / f"{1:020d}" / "a"
    wait_for(drained.exists, timeout_s=60)  # the bytes reached the destination ...
    wait_for(lambda: "event=journal_full" in d.log(), timeout_s=60)  # ... its record cannot
    # Nothing was given up meanwhile: the step is not failed, its staged copy is kept.
    (step,) = [g for g in c.status()["generations"] if g["job"] == "j"]
    assert step["state"] not in ("failed", "cancelled"), step
    assert len(_staged_data(d, small_tmpfs)) == 1
    assert "drain_crashed" not in d.log() and "internal" not in step.get("error", "")
    if then == "room":
        filler.unlink()
    else:
        d.kill()
        filler.unlink()
        d.start()
    c = d.client(timeout_s=30)
    c.wait("j", 1, timeout_s=120)
    assert drained.read_bytes() == data
    assert c.latest("j") == 1
    if then == "room":
        assert "event=journal_writable" in d.log()


def test_new_work_while_the_journal_is_full_is_backpressure(
    make_daemon: Any, small_tmpfs: Path
) -> None:
    d: DaemonProcess = make_daemon(CKPTDRAIN_STAGING_DIR=str(small_tmpfs / "staging"))
    c = d.client(timeout_s=30)
    with c.generation("j", 1) as gen:
        gen.put("a", b"before")
    c.wait("j", 1, timeout_s=60)
    filler = fill(small_tmpfs)
    # A new step records a new generation: refused as the full disk it is, not an internal
    # error, and the daemon goes on answering.
    with pytest.raises(Backpressure, match="full") as info, c.generation("j", 2) as gen:
        gen.put("a", b"during")
    assert info.value.details["limit"] == "staging_filesystem"
    assert c.status()["generations"] is not None
    assert "request_crashed" not in d.log() and "Traceback" not in d.log()
    filler.unlink()
    with c.generation("j", 3) as gen:
        gen.put("a", b"after")
    c.wait("j", 3, timeout_s=60)
    assert (d.dest / "j" / f"{3:020d}" / "a").read_bytes() == b"after"


def test_a_memory_handoff_waits_out_a_moment_without_disk_room(
    make_daemon: Any, small_tmpfs: Path
) -> None:
    # Found attacking the staging disk: another user's file filled it for a few seconds just
    # as an acknowledged ack=memory shard was to be written there; the generation failed at
    # once (a paging drain failure, and no retry: its bytes were only in RAM), though a full
    # max_staged_bytes is waited out for limits.block_timeout_s.
    d: DaemonProcess = make_daemon(CKPTDRAIN_STAGING_DIR=str(small_tmpfs / "staging"),
                                   CKPTDRAIN_ACK="memory",
                                   CKPTDRAIN_LIMITS__MAX_MEMORY_BYTES="256MiB",
                                   CKPTDRAIN_LIMITS__BLOCK_TIMEOUT_S="60")
    c = d.client(timeout_s=30)
    other = small_tmpfs / "someone-else"
    other.write_bytes(os.urandom(50 * MiB))
    data = os.urandom(20 * MiB)
    with c.generation("mem", 1) as gen:
        gen.put("a", data)  # acknowledged in RAM
    wait_for(lambda: "event=memory_handoff_waits_for_disk" in d.log(), timeout_s=30)
    other.unlink()
    c.wait("mem", 1, timeout_s=60)
    assert (d.dest / "mem" / f"{1:020d}" / "a").read_bytes() == data


def test_a_staging_directory_removed_under_the_daemon_is_made_again(daemon: DaemonProcess) -> None:
    # Found attacking the staging side: every hand-off after an `rm -rf` of the shards
    # directory failed as an internal error until a restart.
    c = daemon.client(timeout_s=30)
    shutil.rmtree(daemon.staging / "shards")
    with c.generation("j", 1) as gen:
        gen.put("a", b"after the rm")
    c.wait("j", 1, timeout_s=60)
    assert (daemon.dest / "j" / f"{1:020d}" / "a").read_bytes() == b"after the rm"
    assert "event=staging_dir_recreated" in daemon.log()
    assert os.stat(daemon.staging / "shards").st_mode & 0o777 == 0o700


@pytest.mark.skipif(STRACE is None, reason="strace is not installed: run `make system-deps`")
def test_a_memory_handoff_waits_out_a_disk_filled_during_its_copy(
    tmp_path: Path, short_tmp: Path, small_tmpfs: Path
) -> None:
    # Found attacking the fix above: the wait covered the moment before the copy only; a
    # disk filled while the memfd was copied (ENOSPC from the copy itself) still failed the
    # acknowledged generation for good. Each copy is held back a second here, and the disk is
    # filled as soon as the staged temp file exists.
    d = ChaosDaemon(root=tmp_path / "d", socket_path=short_tmp / "mc.sock",
                    dest_uri=f"file://{tmp_path / 'dest'}",
                    overrides={"CKPTDRAIN_STAGING_DIR": str(small_tmpfs / "staging"),
                               "CKPTDRAIN_ACK": "memory",
                               "CKPTDRAIN_LIMITS__MAX_MEMORY_BYTES": "256MiB",
                               "CKPTDRAIN_LIMITS__BLOCK_TIMEOUT_S": "60"},
                    injection=Injection("copy_file_range", persistent=True,
                                        delay_enter_us=1_000_000))
    shards = small_tmpfs / "staging" / "shards"
    filled: list[Path] = []

    def fill_during_the_copy() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not filled:
            if any(name.endswith(".tmp") for name in os.listdir(shards)):
                filled.append(fill(small_tmpfs))

    try:
        d.start()
        filler = threading.Thread(target=fill_during_the_copy)
        filler.start()
        data = os.urandom(20 * MiB)
        with d.client(timeout_s=30).generation("mem", 1) as gen:
            gen.put("a", data)  # acknowledged in RAM
        filler.join(30)
        assert filled, "the staged temp file never showed"
        wait_for(lambda: "event=memory_handoff_waits_for_disk" in d.log(), timeout_s=30)
        filled[0].unlink()
        d.client(timeout_s=30).wait("mem", 1, timeout_s=120)
        assert (tmp_path / "dest" / "mem" / f"{1:020d}" / "a").read_bytes() == data
    finally:
        d.kill()


@pytest.mark.skipif(os.geteuid() != 0, reason="runs clients as other uids (root)")
def test_a_begin_refused_for_a_full_journal_claims_no_job(
    make_daemon: Any, small_tmpfs: Path
) -> None:
    # Found attacking a full disk: the refused begin left its new job claimed by its uid in
    # memory, so another uid's begin of that job was denied ("belongs to another user")
    # until a restart, though nothing of it was ever journalled.
    from ckptdrain.client import Client, PermissionDenied
    from tests.functional.otheruser import run_as

    first, second = 65534, 65533
    d: DaemonProcess = make_daemon(CKPTDRAIN_STAGING_DIR=str(small_tmpfs / "staging"),
                                   CKPTDRAIN_ACCESS__SOCKET_MODE="0666",
                                   CKPTDRAIN_ACCESS__ALLOWED_UIDS=f"[{first}, {second}]")
    os.chmod(d.socket_path.parent, 0o755)

    def begin() -> str:
        try:
            with Client(d.socket_path, timeout_s=30).generation("shared", 1) as gen:
                gen.put("a", b"mine")
        except Backpressure as exc:
            return f"BACKPRESSURE {exc.details['limit']}"
        except PermissionDenied as exc:
            return f"DENIED {exc}"
        return "OK"

    filler = fill(small_tmpfs)
    assert run_as(first, begin) == "BACKPRESSURE staging_filesystem"
    filler.unlink()
    assert run_as(second, begin) == "OK"


@pytest.mark.parametrize("left", [0, 1], ids=["no-inode-left", "one-inode-left"])
@pytest.mark.parametrize("size", [10, 2 * MiB], ids=["put_bytes", "put"])
def test_a_staging_filesystem_out_of_inodes_says_so(
    make_daemon: Any, tmp_path: Path, size: int, left: int
) -> None:
    # Found attacking the staging side: with the staging filesystem out of inodes (another
    # user's tiny files) and bytes free, a put was refused as "staging disk full ... lower
    # limits.max_staged_bytes", which frees no inode.
    mnt = tmp_path / "few-inodes"
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,nr_inodes=200", "tmpfs",
                          str(mnt)], capture_output=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {out.stderr.decode().strip()}")
    try:
        d: DaemonProcess = make_daemon(CKPTDRAIN_STAGING_DIR=str(mnt / "staging"))
        c = d.client(timeout_s=30)
        (mnt / "other").mkdir()
        with contextlib.suppress(OSError):
            for n in range(1000):
                (mnt / "other" / f"f{n}").touch()
        for n in range(left):  # one left: the file is created, the room check refuses it
            (mnt / "other" / f"f{n}").unlink()
        assert os.statvfs(mnt).f_favail == left
        with pytest.raises(Backpressure) as info, c.generation("j", 1) as gen:
            gen.put("a", os.urandom(size))
        assert info.value.details["limit"] == "staging_filesystem"
        assert "inodes" in info.value.message, info.value.message
        assert "or lower limits.max_staged_bytes" not in info.value.message, info.value.message
        d.stop()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("ack", ["local", "memory"])
def test_a_staging_directory_that_refuses_new_files_is_no_internal_error(
    daemon: DaemonProcess, ack: str
) -> None:
    # Found attacking the staging side: with the shards directory refusing new files (made
    # immutable here; a filesystem remounted read-only after a disk error, its permissions
    # changed), every hand-off was refused as `internal`, which the docs call a daemon bug,
    # and the message did not name the staging directory or what to do.
    shards = daemon.staging / "shards"
    if subprocess.run(["chattr", "+i", str(shards)], capture_output=True).returncode != 0:
        pytest.skip("cannot make a directory immutable here (needs root, and a filesystem "
                    "with the flag)")
    c = daemon.client(timeout_s=30)
    try:
        with pytest.raises(DaemonUnavailable, match=r"staging directory.*refuses new files") \
                as info, c.generation("j", 1, ack=ack) as gen:
            gen.put("a", os.urandom(3 * MiB))
        assert str(shards) in info.value.message
        assert info.value.code == "unavailable"
    finally:
        subprocess.run(["chattr", "-i", str(shards)], check=True)
    with c.generation("j", 2, ack=ack) as gen:
        gen.put("a", b"after")
    c.wait("j", 2, timeout_s=60)


@contextlib.contextmanager
def refusing_writes(d: DaemonProcess, path: Path) -> Iterator[None]:
    """Every write to ``path`` fails with EROFS for the block's duration, as on a filesystem
    remounted read-only (strace attached to the running daemon; the daemon may stop in it)."""
    tracer = subprocess.Popen(
        ["strace", "-f", "-qq", "-o", "/dev/null", "-p", str(d.pid), "-P", str(path),
         "-e", "trace=pwrite64,write", "-e", "inject=pwrite64,write:error=EROFS"],
        stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: traced(d.pid))
        yield
    finally:
        tracer.terminate()
        tracer.wait(10)
    if d.proc is not None and d.proc.poll() is None:
        wait_for(lambda: not traced(d.pid))


@pytest.mark.parametrize("then", ["writable", "stop, restart"])
def test_a_drain_recorded_while_the_journal_refuses_writes_waits_for_it(
        make_daemon: Any, then: str) -> None:
    # Found attacking restarts and the journal: a staging filesystem that goes read-only
    # under the daemon (ext4's errors=remount-ro after a disk error) fails the open -wal's
    # writes with EROFS, which SQLite reports as "disk I/O error". The drained record of a
    # drain that had gone through failed, and ended its generation as an internal error
    # ("failed unexpectedly (OperationalError: disk I/O error)") while the journal still held
    # it open, and a begin was "an internal error". Now such a record waits, as one on a full
    # disk does, and new work is backpressure naming the cause.
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="2MiB")
    c = d.client(timeout_s=30)
    data = os.urandom(8 * MiB)
    with c.generation("j", 1) as gen:
        gen.put("a", data)
    wal = d.staging / "journal.sqlite3-wal"
    drained = d.dest / "j" / f"{1:020d}" / "a"
    with refusing_writes(d, wal):
        wait_for(drained.exists, timeout_s=60)
        wait_for(lambda: "event=journal_unwritable" in d.log(), timeout_s=60)
        (step,) = [g for g in c.status()["generations"] if g["job"] == "j"]
        assert step["state"] not in ("failed", "cancelled"), step
        assert "drain_crashed" not in d.log()
        with pytest.raises(Backpressure, match=r"cannot be written .* read-only"), \
                c.generation("j", 2) as gen:
            gen.put("b", b"b")
        if then != "writable":
            assert d.stop() == 0
    if then != "writable":
        d.start()
        c = d.client(timeout_s=30)
    c.wait("j", 1, timeout_s=120)
    assert drained.read_bytes() == data
    assert c.latest("j") == 1
