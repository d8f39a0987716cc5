"""The POSIX destination against a real temp directory."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from ckptdrain.client.manifest import TMP_SUFFIX
from ckptdrain.daemon import filecopy
from ckptdrain.daemon.backends import posix, posixfs, posixlayout, posixremove
from ckptdrain.daemon.backends.base import BackendError, ObjectInfo, open_backend
from ckptdrain.daemon.backends.posix import PosixBackend, backend_error, temp_name
from ckptdrain.daemon.checksums import of_bytes
from ckptdrain.daemon.config import DestinationConfig

MiB = 1 << 20


_opened: list[PosixBackend] = []


def make(
    root: Path, node: str = "gpu1", *, stripe_count: int = -1, stripe_size_bytes: int = 4 * MiB
) -> PosixBackend:
    config = DestinationConfig(
        uri=f"file://{root}", stripe_count=stripe_count, stripe_size_bytes=stripe_size_bytes
    )
    backend = open_backend(config, node)
    assert isinstance(backend, PosixBackend)
    _opened.append(backend)
    return backend


@pytest_asyncio.fixture(autouse=True)
async def _close_backends() -> AsyncIterator[None]:
    yield
    while _opened:
        await _opened.pop().aclose()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "dest"


@pytest.fixture
def source(tmp_path: Path) -> Iterator[tuple[int, bytes]]:
    """An open fd on a file larger than one copy buffer (so the copy loops), and its bytes."""
    data = os.urandom(posix.COPY_RANGE_BYTES + 12345)
    path = tmp_path / "staged.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    yield fd, data
    os.close(fd)


def temps(root: Path) -> list[str]:
    return [
        os.path.join(d, n)
        for d, dirs, files in os.walk(root)
        for n in files + dirs
        if n.endswith(TMP_SUFFIX)
    ]


@pytest.mark.asyncio
async def test_put_file_writes_complete_file_and_returns_its_checksum(
    root: Path, source: tuple[int, bytes]
) -> None:
    fd, data = source
    backend = make(root)
    checksum = await backend.put_file("job/00000000000000000001/model/rank0.pt", fd, len(data))
    target = root / "job/00000000000000000001/model/rank0.pt"
    assert target.read_bytes() == data
    assert checksum == of_bytes(data)
    assert stat.S_IMODE(target.stat().st_mode) & 0o777 == 0o644 & ~_umask()
    assert temps(root) == []


@pytest.mark.asyncio
@pytest.mark.parametrize("parallel", [None, True])
async def test_a_large_shard_goes_in_segments_only_where_the_filesystem_takes_them(
    root: Path, tmp_path: Path, parallel: bool | None
) -> None:
    # Segments of one file written at once took its inode lock in turn on ext4: the drain to
    # a local disk cost 1.6-1.9x the CPU of one copy per file. A local filesystem (this temp
    # dir's) gets one copy per file; a parallel filesystem (Lustre, NFS, ...) gets segments.
    data = os.urandom(filecopy.PARALLEL_MIN_BYTES + 5 * MiB + 7)
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    backend = make(root)
    backend.parallel_writes = parallel
    backend.direct_writes = False  # this temp dir is on ext4, written direct otherwise
    fd = os.open(path, os.O_RDONLY)
    try:
        checksum = await backend.put_file("job/00000000000000000001/big.bin", fd, len(data))
    finally:
        os.close(fd)
    assert checksum == of_bytes(data)
    assert (root / "job/00000000000000000001/big.bin").read_bytes() == data
    if parallel is None:
        assert backend.parallel_writes is False  # asked of the filesystem: not a parallel one
        assert backend._segments is None  # no segment thread was started
    else:
        assert backend._segments is not None


def test_parallel_filesystems_are_told_apart_by_their_statfs_type(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        kind = posixlayout.filesystem_type(fd)
        assert kind is not None and kind == _statfs_type(tmp_path)
        assert not posixlayout.writes_in_parallel(fd)
    finally:
        os.close(fd)
    assert 0x0BD00BD0 in posixlayout.PARALLEL_WRITE_FILESYSTEMS  # Lustre's LL_SUPER_MAGIC


def _statfs_type(path: Path) -> int:
    # stat(1) reads the same field: %t is f_type in hex.
    out = subprocess.run(["stat", "-f", "-c", "%t", str(path)], check=True, capture_output=True,
                         text=True).stdout
    return int(out.strip(), 16)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.asyncio
async def test_put_file_of_a_prefix_of_the_source(root: Path, source: tuple[int, bytes]) -> None:
    fd, data = source
    backend = make(root)
    checksum = await backend.put_file("k/a", fd, 100)
    assert (root / "k/a").read_bytes() == data[:100]
    assert checksum == of_bytes(data[:100])
    await backend.put_file("k/empty", fd, 0)
    assert (root / "k/empty").read_bytes() == b""


@pytest.mark.asyncio
async def test_short_source_fails_and_leaves_nothing(root: Path, source: tuple[int, bytes]) -> None:
    fd, data = source
    backend = make(root)
    with pytest.raises(BackendError, match="ended at byte") as info:
        await backend.put_file("job/x.pt", fd, len(data) + 1)
    assert info.value.kind == "integrity"
    assert not (root / "job/x.pt").exists()
    assert temps(root) == []


@pytest.mark.asyncio
async def test_closed_fd_fails_and_leaves_no_temp(root: Path, tmp_path: Path) -> None:
    path = tmp_path / "gone.bin"
    path.write_bytes(b"x" * 10)
    fd = os.open(path, os.O_RDONLY)
    os.close(fd)  # a drain whose staged file was closed under it
    backend = make(root)
    with pytest.raises(BackendError) as info:
        await backend.put_file("job/x.pt", fd, 10)
    assert "Bad file descriptor" in str(info.value)
    assert not (root / "job/x.pt").exists()
    assert temps(root) == []


@pytest.mark.asyncio
@pytest.mark.parametrize("direct", [False, True], ids=["kernel-copy", "direct-io"])
async def test_cancelled_put_file_stops_its_thread_and_removes_the_temp(
    root: Path, source: tuple[int, bytes], monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    fd, data = source
    started = threading.Event()
    release = threading.Event()
    # The call each way of writing makes for its first range: copy_file_range, or the direct
    # write from the mapped staged pages (on a local block filesystem).
    name = "pwrite" if direct else "copy_file_range"
    real_copy = getattr(os, name)

    def held_copy(*args: Any) -> int:
        # Holds the worker thread inside the copy so the cancel lands mid-file. (It held
        # preadv once, which only the read/write loop calls: the test passed only after an
        # earlier test's closed fd had put the whole process on that loop.)
        started.set()
        release.wait(timeout=10)
        return int(real_copy(*args))

    monkeypatch.setattr(os, name, held_copy)
    backend = make(root)
    backend.direct_writes = direct
    task = asyncio.create_task(backend.put_file("job/big.pt", fd, len(data)))
    assert await asyncio.to_thread(started.wait, 10)
    assert len(temps(root)) == 1  # the temp exists while the copy runs
    task.cancel()
    await asyncio.sleep(0)
    assert not task.done()  # waits for the thread rather than abandoning it with our fd
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not (root / "job/big.pt").exists()
    assert temps(root) == []


@pytest.mark.asyncio
async def test_a_name_of_the_longest_allowed_length_still_gets_a_temp_name(
    root: Path, source: tuple[int, bytes]
) -> None:
    fd, data = source
    backend = make(root, "n" * 128)
    name = "x" * 255
    await backend.put_file(f"j/{name}", fd, 10)
    assert (root / "j" / name).read_bytes() == data[:10]
    assert len(temp_name(name, "n" * 128)) == 255
    assert await backend.sweep_orphans(set(), 0) == 0


@pytest.mark.asyncio
async def test_put_bytes_exclusive_creates_once(root: Path) -> None:
    backend = make(root)
    assert await backend.put_bytes(
        "job/00000000000000000001/MANIFEST.json", b"first", exclusive=True
    )
    assert not await backend.put_bytes(
        "job/00000000000000000001/MANIFEST.json", b"second", exclusive=True
    )
    assert await backend.get_bytes("job/00000000000000000001/MANIFEST.json") == b"first"
    assert temps(root) == []


@pytest.mark.asyncio
async def test_concurrent_exclusive_creates_from_two_nodes_have_one_winner(root: Path) -> None:
    nodes = [make(root, f"gpu{i}") for i in range(4)]
    results = await asyncio.gather(
        *(
            b.put_bytes(
                "j/00000000000000000007/MANIFEST.json", f"from {b.node_id}".encode(), exclusive=True
            )
            for b in nodes
            for _ in range(5)
        )
    )
    assert results.count(True) == 1
    winner = (root / "j/00000000000000000007/MANIFEST.json").read_bytes()
    assert winner.startswith(b"from gpu")
    assert temps(root) == []


@pytest.mark.asyncio
async def test_put_bytes_without_exclusive_replaces(root: Path) -> None:
    backend = make(root)
    assert await backend.put_bytes("job/LATEST", b"1\n")
    assert await backend.put_bytes("job/LATEST", b"2\n")
    assert await backend.get_bytes("job/LATEST") == b"2\n"


@pytest.mark.asyncio
async def test_get_bytes(root: Path) -> None:
    backend = make(root)
    assert await backend.get_bytes("nothing/here") is None
    await backend.put_bytes("a/b", b"x" * 100)
    # A directory takes the name of a key as no object does: found attacking gc, a directory
    # (or a FIFO) at an old MANIFEST.json read as no key, though no create could take it.
    with pytest.raises(BackendError, match="is not a regular file") as info:
        await backend.get_bytes("a")
    assert info.value.kind == "integrity"
    os.mkfifo(root / "fifo")
    with pytest.raises(BackendError, match="is not a regular file"):
        await backend.get_bytes("fifo")
    with pytest.raises(BackendError, match="over the 10-byte limit"):
        await backend.get_bytes("a/b", max_bytes=10)


@pytest.mark.asyncio
async def test_list_is_recursive_sorted_and_skips_temps(root: Path) -> None:
    backend = make(root)
    assert await backend.list("") == []  # the root does not exist yet
    for key in ("j/2/b", "j/1/z", "j/1/a/deep", "k/x", "j10/y"):
        await backend.put_bytes(key, key.encode())
    (root / "j/1" / temp_name("a", "gpu9")).write_bytes(b"partial")
    assert [i.key for i in await backend.list("")] == [
        "j/1/a/deep",
        "j/1/z",
        "j/2/b",
        "j10/y",
        "k/x",
    ]
    assert [i.key for i in await backend.list("j/")] == ["j/1/a/deep", "j/1/z", "j/2/b"]
    # Prefixes match like S3: by string, not by directory.
    assert [i.key for i in await backend.list("j")] == ["j/1/a/deep", "j/1/z", "j/2/b", "j10/y"]
    assert await backend.list("j/1/z") == [ObjectInfo("j/1/z", 5)]
    assert await backend.list("missing/") == []


@pytest.mark.asyncio
async def test_read_chunks_and_delete(root: Path, source: tuple[int, bytes]) -> None:
    fd, data = source
    backend = make(root)
    await backend.put_file("j/s", fd, len(data))
    chunks = [c async for c in backend.read_chunks("j/s", chunk_bytes=MiB)]
    assert b"".join(chunks) == data
    assert max(len(c) for c in chunks) == MiB
    await backend.delete("j/s")
    await backend.delete("j/s")  # a missing key is not an error
    assert await backend.get_bytes("j/s") is None
    with pytest.raises(BackendError, match="does not exist"):
        async for _ in backend.read_chunks("j/s"):
            pass


@pytest.mark.asyncio
async def test_delete_many_fsyncs_each_directory_once_and_removes_emptied_ones(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention's bulk delete: one directory fsync per directory of a batch (a delete per
    key fsynced its directory each time: 10,000 journal commits for a 10,000-shard
    generation), keys already gone are fine, and the directories it empties go (up to, not
    including, the job's)."""
    backend = make(root)
    keys = [f"j/00000000000000000001/model/rank{i:03d}.pt" for i in range(300)]
    keys += [f"j/00000000000000000001/optim/rank{i:03d}.pt" for i in range(300)]
    keys += ["j/00000000000000000001/MANIFEST.json"]
    for key in keys:
        await backend.put_bytes(key, b"x")
    await backend.put_bytes("j/00000000000000000002/model/rank000.pt", b"stays")
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(posixremove.os, "fsync", recording_fsync)
    await backend.delete_many([*keys, "j/00000000000000000001/model/never-written"])

    gen1 = root / "j" / "00000000000000000001"
    assert sorted(synced) == [str(gen1), str(gen1 / "model"), str(gen1 / "optim")]
    assert not gen1.exists() and (root / "j").is_dir()
    assert await backend.get_bytes("j/00000000000000000002/model/rank000.pt") == b"stays"
    await backend.delete_many(keys[:3])  # all gone already, and their directory too: fine


@pytest.mark.asyncio
async def test_a_directory_it_cannot_read_keeps_only_itself_and_those_above_it(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention's removal of empty generation directories: one directory it may not read
    (another user's, mode 0700) stopped the call, and every generation after it kept its
    empty directories; now that directory and its parents stay, the rest go."""
    backend = make(root)
    for step in (1, 2):
        (root / "j" / f"{step:020d}" / "model").mkdir(parents=True)
    (root / "j" / f"{1:020d}" / "private").mkdir()
    real_scandir = os.scandir

    def scandir(fd: int) -> Any:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/private"):
            raise PermissionError(13, "Permission denied")
        return real_scandir(fd)

    monkeypatch.setattr(posixremove.os, "scandir", scandir)
    later = time.time() + 3600
    await backend.remove_empty([f"j/{1:020d}/", f"j/{2:020d}/"], later)
    assert (root / "j" / f"{1:020d}" / "private").is_dir()
    assert not (root / "j" / f"{1:020d}" / "model").exists()
    assert not (root / "j" / f"{2:020d}").exists() and (root / "j").is_dir()


def test_a_stopped_removal_stops_between_files(root: Path) -> None:
    """A cancelled delete_many tells its thread to stop (PosixBackend._run), and the thread
    looks between files: a batch of thousands does not run on behind its caller."""
    backend = make(root)
    (root / "j" / "1").mkdir(parents=True)
    for i in range(5):
        (root / "j" / "1" / f"s{i}").write_bytes(b"")
    stop = threading.Event()
    stop.set()
    entries = [backend._entry(f"j/1/s{i}") for i in range(5)]
    posixremove.remove_many(backend.fs, entries, stop)
    assert sorted(os.listdir(root / "j" / "1")) == [f"s{i}" for i in range(5)]
    posixremove.remove_many(backend.fs, entries, threading.Event())
    assert not (root / "j" / "1").exists() and (root / "j").is_dir()


@pytest.mark.asyncio
async def test_keys_cannot_leave_the_root(root: Path) -> None:
    backend = make(root)
    for key in ("../x", "/etc/passwd", "a//b", "a/./b", ""):
        with pytest.raises(ValueError, match="invalid destination key"):
            await backend.put_bytes(key, b"x")


@pytest.fixture
def fake_lfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in `lfs` on PATH (there is no Lustre here): it records its arguments, the
    inode of the directory it was pointed at, and how many entries that directory held."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "lfs.log"
    script = bindir / "lfs"
    script.write_text(
        "#!/bin/sh\n"
        "for last; do :; done\n"
        f'echo "$* inode=$(stat -L -c %i "$last") entries=$(ls -A "$last" | wc -l)" >> {record}\n'
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    return record


@pytest.mark.asyncio
async def test_prepare_prefix_stripes_the_generation_dir_before_its_first_file(
    root: Path, fake_lfs: Path, source: tuple[int, bytes]
) -> None:
    fd, data = source
    backend = make(root, stripe_count=8, stripe_size_bytes=4 * MiB)
    gen = "llama/00000000000000001200/"
    await backend.prepare_prefix(gen)
    await backend.prepare_prefix(gen)  # already there: no second setstripe
    await backend.put_file(gen + "model/rank0.pt", fd, len(data))

    lines = fake_lfs.read_text().splitlines()
    assert len(lines) == 1
    args, inode, entries = lines[0].rsplit(" ", 2)
    assert args.startswith(f"setstripe -c 8 -S {4 * MiB} ")
    # The striped directory IS the generation directory (renamed into place), and it was
    # empty when striped: no file can have been created with the default layout.
    assert inode == f"inode={(root / gen).stat().st_ino}"
    assert entries == "entries=0"
    assert temps(root) == []


@pytest.mark.asyncio
async def test_two_nodes_preparing_one_generation_stripe_it_once(
    root: Path, fake_lfs: Path
) -> None:
    nodes = [make(root, f"gpu{i}", stripe_count=2) for i in range(6)]
    gen = "llama/00000000000000000005/"
    await asyncio.gather(*(n.prepare_prefix(gen) for n in nodes))
    assert (root / gen).is_dir()
    assert temps(root) == []
    # Every setstripe ran on an empty directory; whichever rename won left one striped dir.
    for line in fake_lfs.read_text().splitlines():
        assert line.startswith("setstripe -c 2 ")
        assert line.endswith("entries=0")


@pytest.mark.asyncio
async def test_a_failing_lfs_is_logged_not_fatal(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    bindir = tmp_path / "badbin"
    bindir.mkdir()
    (bindir / "lfs").write_text("#!/bin/sh\necho 'not a lustre fs' >&2\nexit 22\n")
    (bindir / "lfs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    backend = make(root)
    with caplog.at_level(logging.WARNING):
        await backend.prepare_prefix("j/00000000000000000001/")
    assert (root / "j/00000000000000000001").is_dir()
    assert "not a lustre fs" in caplog.text


@pytest.mark.asyncio
async def test_prepare_prefix_without_lfs_just_creates_the_dir(
    root: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    backend = make(root)
    await backend.prepare_prefix("j/00000000000000000001/")
    assert (root / "j/00000000000000000001").is_dir()


@pytest.mark.asyncio
async def test_sweep_removes_own_temps_and_other_nodes_temps_seen_unchanged_for_the_grace(
        root: Path) -> None:
    backend = make(root, "gpu1")
    now = [1000.0]
    backend.clock = lambda: now[0]
    await backend.put_bytes("j/00000000000000000001/keep.pt", b"data")
    gen = root / "j/00000000000000000001"
    mine = gen / temp_name("a.pt", "gpu1")
    theirs_written = gen / temp_name("b.pt", "gpu2")
    theirs_left = gen / temp_name("c.pt", "gpu2")
    similar_node = gen / temp_name("d.pt", "x.gpu1x")
    # Node ids may hold dots: "gpu1" once took "rack2.gpu1"'s temps for its own and removed
    # them while they were being written (found attacking).
    suffixed_node = gen / temp_name("e.pt", "rack2.gpu1")
    stripe_dir = root / "j" / temp_name("00000000000000000002", "gpu3")
    for path in (mine, theirs_written, theirs_left, similar_node, suffixed_node):
        path.write_bytes(b"partial")
    stripe_dir.mkdir()
    # Found attacking the clocks: a node whose clock ran two hours ahead took the temps other
    # nodes were writing for an hour old by their mtime and removed them, failing those
    # generations on every node of the job. Another node's temp goes only once this process
    # has seen it unchanged for the grace, whatever its mtime says.
    old = time.time() - 7200
    for path in (theirs_written, theirs_left, stripe_dir):
        os.utime(path, (old, old))

    assert await backend.sweep_orphans(set(), grace_s=3600) == 1
    assert not mine.exists()  # this node's own leftover: at once
    others = (theirs_written, theirs_left, similar_node, suffixed_node, stripe_dir)
    assert all(path.exists() for path in others)
    now[0] += 1800
    with open(theirs_written, "ab") as f:  # still being written
        f.write(b" more")
    assert await backend.sweep_orphans(set(), grace_s=3600) == 0
    now[0] += 1800
    assert await backend.sweep_orphans(set(), grace_s=3600) == 4
    assert theirs_written.exists()  # changed within the grace: its writer is alive
    assert not any(path.exists() for path in others if path != theirs_written)
    now[0] += 3600
    assert await backend.sweep_orphans(set(), grace_s=3600) == 1
    assert not theirs_written.exists()
    assert (gen / "keep.pt").read_bytes() == b"data"


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["put_bytes", "put_file", "put_files"])
async def test_a_temp_removed_under_the_write_is_sent_again_not_failed(
        root: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, how: str) -> None:
    # Found attacking the clocks: another node's sweep removed this node's temp while it was
    # written, and the final link's ENOENT failed the shard for good (on S3 the same is
    # retried). It is a transient error now: the drain sends the shard again.
    backend = make(root, "gpu1")
    removed: list[str] = []

    def swept_first(dir_fd: int, src: str, dst: str) -> None:
        if not removed:
            os.unlink(src, dir_fd=dir_fd)  # what the other node's sweep did
            removed.append(src)
        os.link(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)

    monkeypatch.setattr(posixfs, "link_in", swept_first)  # every create-if-absent's link
    key = "j/00000000000000000001/w.pt"
    source = tmp_path / "src"
    source.write_bytes(b"w" * 4096)

    async def put() -> object:
        if how == "put_bytes":  # part records and manifests (exclusive: link)
            return await backend.put_bytes(key, b"w" * 4096, exclusive=True)
        fd = os.open(source, os.O_RDONLY)
        try:
            if how == "put_file":  # one shard
                return await backend.put_file(key, fd, 4096)
            (outcome,) = await backend.put_files([(key, fd, 4096)])  # a batch of small ones
        finally:
            os.close(fd)
        if isinstance(outcome, BackendError):
            raise outcome
        return outcome

    with pytest.raises(BackendError, match="removed while it was written") as info:
        await put()
    assert info.value.transient
    assert removed and not (root / key).exists()
    await put()  # sent again, as the drain's retry does
    assert (root / key).read_bytes() == b"w" * 4096
    assert not [p for p in (root / key).parent.iterdir() if p.name.endswith(TMP_SUFFIX)]


@pytest.mark.asyncio
async def test_sweep_of_a_missing_root_finds_nothing(root: Path) -> None:
    assert await make(root).sweep_orphans(set(), 0) == 0


@pytest.mark.parametrize(
    ("code", "kind", "transient"),
    [
        (errno.ENOSPC, "full", False),
        (errno.EDQUOT, "full", False),
        (errno.EACCES, "auth", False),
        (errno.EPERM, "auth", False),
        (errno.EIO, "io", True),
        (errno.EAGAIN, "io", True),
        (errno.ETIMEDOUT, "timeout", True),
        (errno.EROFS, "io", False),
        # Out of file descriptors (idle connections of a same-node user, found attacking the
        # daemon): passes once they close; it failed an acknowledged generation at once.
        (errno.EMFILE, "io", True),
        (errno.ENFILE, "io", True),
    ],
)
def test_os_errors_map_to_backend_error_kinds(code: int, kind: str, transient: bool) -> None:
    error = backend_error(OSError(code, os.strerror(code)), "writing x")
    assert (error.kind, error.transient) == (kind, transient)
    assert str(error).startswith("writing x: ")


def test_a_read_only_destination_says_what_to_do() -> None:
    # Found attacking a file:// destination remounted read-only mid-drain: the generation
    # failed with a bare "Read-only file system", naming no way out.
    error = backend_error(OSError(errno.EROFS, os.strerror(errno.EROFS)), "writing x")
    assert "remount it read-write" in str(error) and "ckptdrain retry" in str(error)


@pytest.mark.asyncio
@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
async def test_unwritable_destination_is_an_auth_error(
    root: Path, source: tuple[int, bytes]
) -> None:
    fd, _ = source
    root.mkdir()
    root.chmod(0o500)
    try:
        with pytest.raises(BackendError) as info:
            await make(root).put_file("j/x", fd, 10)
        assert info.value.kind == "auth"
        assert "permission denied" in str(info.value)
    finally:
        root.chmod(0o700)


@pytest.mark.asyncio
async def test_stat_many_answers_as_stat_does_a_batch_per_thread_job(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit proves every shard with a stat: 10,000 small shards were 10,000 thread
    hops on the event loop. stat_many answers each key as stat does, in order, with one
    thread job per STAT_BATCH keys."""
    backend = make(root)
    gen = "job/00000000000000000001"
    keys = []
    for i in range(posixfs.STAT_BATCH + 7):
        key = f"{gen}/r{i % 3}/s{i}.bin"
        keys.append(key)
        if i % 5:  # every fifth absent
            assert await backend.put_bytes(key, f"bytes {i}".encode())
    (root / gen / "r0" / "adir").mkdir()
    keys.insert(3, f"{gen}/r0/adir")  # not a regular file: absent, as stat says
    one_by_one = [await backend.stat(k) for k in keys]
    jobs: list[str] = []
    real_run = backend._run

    async def counting(what: str, fn: Any, *args: object) -> Any:
        jobs.append(what)
        return await real_run(what, fn, *args)

    monkeypatch.setattr(backend, "_run", counting)
    monkeypatch.setattr(backend, "max_threads", 1)
    many = await backend.stat_many(keys)
    assert many == one_by_one
    assert sum(f is None for f in many) == len(range(0, posixfs.STAT_BATCH + 7, 5)) + 1
    assert many[1] is not None and many[1].checksum == of_bytes(b"bytes 1")
    assert jobs == [f"checking {posixfs.STAT_BATCH} shards", "checking 8 shards"]
    # A few shards go one to a job, as many at once as there are threads (a file without a
    # checksum xattr is hashed: large ones hash in parallel).
    jobs.clear()
    monkeypatch.setattr(backend, "max_threads", 8)
    assert await backend.stat_many(keys[:8]) == one_by_one[:8]
    assert jobs == ["checking 1 shards"] * 8
    assert await backend.stat_many([]) == []
