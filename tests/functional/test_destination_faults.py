"""A ``file://`` destination whose directories stop taking changes under the drain (made
immutable, as ``chattr +i`` does; a read-only or permission change acts the same way): the
write fails with the destination's error, and what it could not clean up is left to the
sweep, which removes it once the directory takes changes again.

Found attacking the destination: a directory made immutable while a shard's temp file was
written failed the write (``link`` refused, EPERM) and the temp's removal too; the failed
removal left the temp marked as being written, so no sweep ever took it, and the 16 MiB temp
stayed beside the shard the retry committed until the daemon restarted.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptdrain.client.manifest import TMP_SUFFIX
from ckptdrain.daemon.backends.base import BackendError, open_backend
from ckptdrain.daemon.backends.posix import PosixBackend, backend_error, temp_name
from ckptdrain.daemon.config import DestinationConfig


def temps(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.name.endswith(TMP_SUFFIX))


@contextlib.contextmanager
def immutable_allowed(tmp_path: Path) -> Iterator[list[Path]]:
    """Directories the test makes immutable (``chattr +i``), made mutable again at the end so
    the temp tree can be removed; skips where chattr cannot (not root, a filesystem without
    the flag)."""
    probe = tmp_path / "probe"
    probe.mkdir()
    out = subprocess.run(["chattr", "+i", str(probe)], capture_output=True)
    if out.returncode != 0:
        pytest.skip(f"cannot make a directory immutable here: {out.stderr.decode().strip()}")
    subprocess.run(["chattr", "-i", str(probe)], check=True)
    made: list[Path] = []
    try:
        yield made
    finally:
        for directory in made:
            subprocess.run(["chattr", "-i", str(directory)], check=False)


class FreezesOnFirstRange:
    """A drain's pacing that makes ``directory`` immutable before the first range is copied:
    the temp file exists and stays writable, but no name in its directory can change."""

    def __init__(self, directory: Path, made: list[Path]) -> None:
        self.directory, self.made = directory, made

    async def pace(self, nbytes: int) -> None:
        del nbytes
        if self.directory not in self.made:
            subprocess.run(["chattr", "+i", str(self.directory)], check=True)
            self.made.append(self.directory)

    def moved(self, nbytes: int) -> None:
        del nbytes


def make(root: Path) -> PosixBackend:
    backend = open_backend(DestinationConfig(uri=f"file://{root}"), "node-a")
    assert isinstance(backend, PosixBackend)
    return backend


@pytest.mark.asyncio
async def test_a_temp_its_write_could_not_remove_is_left_to_the_sweep(tmp_path: Path) -> None:
    with immutable_allowed(tmp_path) as made:
        root = tmp_path / "dest"
        gen = root / "j" / f"{1:020d}"
        gen.mkdir(parents=True)
        staged = tmp_path / "staged.bin"
        staged.write_bytes(os.urandom(256 << 10))
        backend = make(root)
        fd = os.open(staged, os.O_RDONLY)
        try:
            with pytest.raises(BackendError, match="permission denied") as info:
                await backend.put_file(f"j/{1:020d}/w.bin", fd, 256 << 10,
                                       flow=FreezesOnFirstRange(gen, made))
            assert info.value.kind == "auth"
            assert len(temps(root)) == 1  # the removal was refused too
            subprocess.run(["chattr", "-i", str(gen)], check=True)
            # This node's temp, written by no one now: the next sweep removes it. Before, it
            # stayed marked as being written, and every sweep passed over it.
            assert await backend.sweep_orphans(set(), grace_s=3600) == 1
            assert temps(root) == []
        finally:
            os.close(fd)
            await backend.aclose()


@pytest.mark.asyncio
async def test_a_temp_the_sweep_cannot_remove_does_not_stop_it(tmp_path: Path) -> None:
    # Found attacking: one temp in a directory made immutable (or unwritable to the daemon)
    # failed the whole sweep at it, every time, so every temp the walk met after it stayed.
    with immutable_allowed(tmp_path) as made:
        root = tmp_path / "dest"
        gen = root / "j" / f"{1:020d}"
        gen.mkdir(parents=True)
        stuck = root / temp_name("LATEST", "node-a")  # the walk meets the root first
        left = gen / temp_name("w.bin", "node-a")
        stuck.write_bytes(b"s")
        left.write_bytes(b"l")
        subprocess.run(["chattr", "+i", str(root)], check=True)
        made.append(root)
        backend = make(root)
        try:
            assert await backend.sweep_orphans(set(), grace_s=3600) == 1
            assert temps(root) == [stuck]
            subprocess.run(["chattr", "-i", str(root)], check=True)
            assert await backend.sweep_orphans(set(), grace_s=3600) == 1
            assert temps(root) == []
        finally:
            await backend.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("squatter", ["directory", "fifo"])
@pytest.mark.parametrize("size", [4096, 2 << 20])  # a small shard's batch, a put of its own
async def test_a_shard_name_taken_by_no_regular_file_fails_at_once_saying_so(
    tmp_path: Path, squatter: str, size: int,
) -> None:
    # Found attacking a generation directory someone else made first: a directory or a FIFO
    # at a shard's name read as "kept appearing and vanishing while it was written; something
    # else is writing or deleting it", transient, so the drain retried it for
    # drain.retry_budget_s (5 minutes) before failing with that wrong reason.
    root = tmp_path / "dest"
    gen = root / "j" / f"{1:020d}"
    gen.mkdir(parents=True)
    if squatter == "fifo":
        os.mkfifo(gen / "w.bin")
    else:
        (gen / "w.bin").mkdir()
        (gen / "w.bin" / "theirs").write_bytes(b"t")
    staged = tmp_path / "staged.bin"
    staged.write_bytes(os.urandom(size))
    backend = make(root)
    fd = os.open(staged, os.O_RDONLY)
    try:
        with pytest.raises(BackendError, match=f"(?i)is a {squatter}.*remove it") as info:
            if size < (1 << 20):
                [outcome] = await backend.put_files([(f"j/{1:020d}/w.bin", fd, size)])
                assert outcome is None  # taken: the drain sends it through put_file
            await backend.put_file(f"j/{1:020d}/w.bin", fd, size)
        assert not info.value.transient
        assert info.value.kind == "conflict"
        assert temps(root) == []
    finally:
        os.close(fd)
        await backend.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [4096, 2 << 20])  # a small shard's batch, a put of its own
async def test_a_destination_out_of_inodes_says_so(tmp_path: Path, size: int) -> None:
    # Found attacking the destination: with its filesystem out of inodes and bytes free (a
    # job's many small shards, another user's small files), a drain failed with "the
    # destination is full ...; free space or raise the quota", and `df -h` showed room.
    mnt = tmp_path / "few-inodes"
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,nr_inodes=8", "tmpfs",
                          str(mnt)], capture_output=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {out.stderr.decode().strip()}")
    staged = tmp_path / "staged.bin"
    staged.write_bytes(os.urandom(size))
    fd = os.open(staged, os.O_RDONLY)
    backend = make(mnt / "dest")
    try:
        (mnt / "dest" / "j" / f"{1:020d}").mkdir(parents=True)
        with contextlib.suppress(OSError):
            for n in range(100):
                (mnt / f"someone-else-{n}").touch()
        assert os.statvfs(mnt).f_favail == 0
        key = f"j/{1:020d}/w.bin"
        with pytest.raises(BackendError, match=r"out of inodes.*df -i") as info:
            if size < (1 << 20):
                [outcome] = await backend.put_files([(key, fd, size)])
                assert isinstance(outcome, BackendError)
                raise outcome
            await backend.put_file(key, fd, size)
        assert info.value.kind == "full"
        assert "free space or raise the quota" not in str(info.value)
    finally:
        os.close(fd)
        await backend.aclose()
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_out_of_inodes_and_bytes_is_said_as_full(tmp_path: Path) -> None:
    mnt = tmp_path / "full"
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=8", "tmpfs",
                          str(mnt)], capture_output=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {out.stderr.decode().strip()}")
    try:
        fd = os.open(mnt / "bytes", os.O_WRONLY | os.O_CREAT, 0o600)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, bytes(4096))
        os.close(fd)
        with contextlib.suppress(OSError):
            for n in range(100):
                (mnt / f"inode-{n}").touch()
        st = os.statvfs(mnt)
        assert (st.f_bavail, st.f_favail) == (0, 0)
        error = backend_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "writing x",
                              str(mnt))
        assert "free space or raise the quota" in str(error)
        assert "inodes" not in str(error)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.asyncio
async def test_a_checksum_not_recorded_is_still_checked_on_a_read_only_destination(
        small_tmpfs: Path) -> None:
    # Found attacking: a shard whose checksum was not recorded with it (an older version wrote
    # it, or it was copied in by hand) is hashed when checked, and the result recorded so the
    # next check is cheap; on a destination that takes no writes (read-only, full) that record
    # failed, and the check with it, though the record is only a convenience.
    root = small_tmpfs / "dest"
    (root / "j").mkdir(parents=True)
    (root / "j" / "a").write_bytes(b"x" * 1000)
    backend = make(root)
    try:
        subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
        try:
            read_only = await backend.stat("j/a")
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(small_tmpfs)], check=True)
        writable = await backend.stat("j/a")
    finally:
        await backend.aclose()
    assert read_only is not None and writable is not None
    assert read_only.checksum and read_only.checksum == writable.checksum
