"""Destination confinement: nothing the POSIX backend creates, opens, renames, lists or deletes
is reached through a symbolic link a user planted in the destination. Findings of the
shared-node campaign: the daemon (often root) created files wherever such a link pointed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptdrain.client import GenerationFailed
from ckptdrain.daemon.backends.beneath import Beneath, UnsafePath, kernel_has_openat2
from ckptdrain.daemon.backends.posix import PosixBackend
from tests.conftest import DaemonProcess
from tests.functional.test_failure_boundary import still_serves
from tests.functional.test_posix_backend import make

STEP1 = f"{1:020d}"


def tree(path: Path) -> list[str]:
    """Every entry under ``path`` (links not followed), relative."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.fixture
def elsewhere(tmp_path: Path) -> Iterator[Path]:
    """A directory outside the destination a hostile user points links at; it holds one file
    that must survive and be read by nobody."""
    path = tmp_path / "elsewhere"
    (path / STEP1).mkdir(parents=True)
    (path / STEP1 / "secret").write_bytes(b"root only")
    yield path
    assert tree(path) == [STEP1, f"{STEP1}/secret"], "something was written outside the root"
    assert (path / STEP1 / "secret").read_bytes() == b"root only"


@pytest.fixture(params=["openat2", "walk"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> PosixBackend:
    """The backend with each way of resolving: openat2, and the per-component walk."""
    if request.param == "openat2" and not kernel_has_openat2():
        pytest.skip("this kernel has no openat2")
    b = make(tmp_path / "dest")
    b.fs.openat2 = request.param == "openat2"
    b.root.mkdir(parents=True)
    return b


@pytest.fixture
def staged(tmp_path: Path) -> Iterator[tuple[int, int]]:
    path = tmp_path / "staged.bin"
    path.write_bytes(b"payload")
    fd = os.open(path, os.O_RDONLY)
    yield fd, 7
    os.close(fd)


@pytest.mark.asyncio
async def test_a_link_planted_at_a_generation_directory(
    backend: PosixBackend, elsewhere: Path, staged: tuple[int, int]
) -> None:
    (backend.root / "eviljob").mkdir()
    (backend.root / "eviljob" / STEP1).symlink_to(elsewhere)
    gen = f"eviljob/{STEP1}/"
    with pytest.raises(UnsafePath, match="symbolic link"):
        await backend.put_file(gen + "cron.d/payload", *staged)
    with pytest.raises(UnsafePath):
        await backend.put_bytes(gen + "_parts/node.json", b"{}")
    with pytest.raises(UnsafePath):
        await backend.put_bytes(gen + "MANIFEST.json", b"{}", exclusive=True)
    with pytest.raises(UnsafePath):
        await backend.prepare_prefix(gen)
    # Reads refuse it too: a restore must not hand out what the link points at.
    with pytest.raises(UnsafePath):
        await backend.get_bytes(gen + "secret")
    with pytest.raises(UnsafePath):
        await backend.stat(gen + "secret")
    with pytest.raises(UnsafePath):
        _ = [c async for c in backend.read_chunks(gen + "secret")]
    with pytest.raises(UnsafePath):
        await backend.list(gen)
    assert await backend.list_dirs("eviljob/") == []  # a link is not a generation directory
    with pytest.raises(UnsafePath):
        await backend.delete(gen + "secret")
    with pytest.raises(UnsafePath):
        await backend.delete_many([gen + "secret", gen + "MANIFEST.json"])


@pytest.mark.asyncio
async def test_a_link_planted_at_a_job_directory(
    backend: PosixBackend, elsewhere: Path, staged: tuple[int, int]
) -> None:
    (backend.root / "victimjob").symlink_to(elsewhere)
    with pytest.raises(UnsafePath):
        await backend.put_file(f"victimjob/{STEP1}/model.pt", *staged)
    with pytest.raises(UnsafePath):
        await backend.put_bytes("victimjob/LATEST", b"1\n")
    with pytest.raises(UnsafePath):
        await backend.put_bytes(f"victimjob/{STEP1}.tombstone", b"{}")
    with pytest.raises(UnsafePath):
        await backend.list("victimjob/")
    assert await backend.list("") == []  # the walk lists no link and goes into none
    assert await backend.list_dirs("") == []
    with pytest.raises(UnsafePath):
        await backend.delete(f"victimjob/{STEP1}/secret")
    with pytest.raises(UnsafePath):
        await backend.delete_many([f"victimjob/{STEP1}/secret"])


@pytest.mark.asyncio
async def test_a_link_at_a_file_name_is_replaced_or_refused_never_followed(
    backend: PosixBackend, elsewhere: Path, staged: tuple[int, int]
) -> None:
    gen = backend.root / "job" / STEP1
    gen.mkdir(parents=True)
    (gen / "MANIFEST.json").symlink_to(elsewhere / STEP1 / "secret")
    (backend.root / "job" / "LATEST").symlink_to(elsewhere / STEP1 / "secret")
    (gen / "model.pt").symlink_to(elsewhere / STEP1 / "secret")
    # Create-once: the name is taken (by the link), and what it points at is never read.
    assert not await backend.put_bytes(f"job/{STEP1}/MANIFEST.json", b"{}", exclusive=True)
    with pytest.raises(UnsafePath):
        await backend.get_bytes(f"job/{STEP1}/MANIFEST.json")
    with pytest.raises(UnsafePath):
        await backend.put_file(f"job/{STEP1}/model.pt", *staged)
    # A rewritten record replaces the name itself: the link goes, its target stays.
    assert await backend.put_bytes("job/LATEST", b"1\n")
    assert not (backend.root / "job" / "LATEST").is_symlink()
    assert await backend.get_bytes("job/LATEST") == b"1\n"
    # Retention removes the link, not its target (the elsewhere fixture checks).
    await backend.delete(f"job/{STEP1}/model.pt")
    assert not (gen / "model.pt").is_symlink()


@pytest.mark.asyncio
async def test_the_temp_sweep_does_not_follow_links(backend: PosixBackend, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    leftover = outside / f".x.{backend.node_id}.0123456789ab.ckptdrain-tmp"
    leftover.write_bytes(b"not ours")
    (backend.root / "job").mkdir()
    (backend.root / "job" / STEP1).symlink_to(outside)
    assert await backend.sweep_orphans(set(), 0.0) == 0
    assert leftover.exists()


def test_both_ways_of_resolving_agree(tmp_path: Path) -> None:
    root = tmp_path / "r"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f").write_bytes(b"f")
    (root / "a" / "l").symlink_to(root / "a" / "b")
    ways = [False, *([True] if kernel_has_openat2() else [])]
    for use in ways:
        fs = Beneath(root, use_openat2=use)
        fd = fs.open(["a", "b", "f"])
        assert os.read(fd, 10) == b"f"
        os.close(fd)
        with fs.dir(["a", "new", "deeper"], create=True) as dir_fd:
            assert os.fstat(dir_fd).st_ino == (root / "a" / "new" / "deeper").stat().st_ino
        for parts in (["a", "l", "f"], ["a", "l"]):
            with pytest.raises(UnsafePath):
                fs.open(parts)
        with pytest.raises(UnsafePath), fs.dir(["a", "l", "c"], create=True):
            pass
        with pytest.raises(FileNotFoundError):
            fs.open(["a", "missing"])
    assert not (root / "a" / "b" / "c").exists()


# --- through the daemon ---------------------------------------------------------------------


@pytest.mark.parametrize("plant", ["generation", "job"])
def test_the_daemon_fails_the_generation_and_writes_nothing_outside(
    make_daemon, tmp_path: Path, plant: str  # type: ignore[no-untyped-def]
) -> None:
    d: DaemonProcess = make_daemon()
    elsewhere = tmp_path / "root-only"
    elsewhere.mkdir()
    job = "eviljob" if plant == "generation" else "victimjob"
    if plant == "generation":
        (d.dest / job).mkdir(parents=True)
        (d.dest / job / STEP1).symlink_to(elsewhere)
    else:
        d.dest.mkdir(parents=True, exist_ok=True)
        (d.dest / job).symlink_to(elsewhere)
    c = d.client()
    # The shard may fail its drain before the seal (which then says so) or after it.
    with pytest.raises(GenerationFailed) as failed:
        with c.generation(job, 1) as gen:
            gen.put("cron.d/payload", b"* * * * * root sh -c evil\n")
        c.wait(job, 1, timeout_s=60)
    assert "symbolic link" in str(failed.value), failed.value
    assert tree(elsewhere) == []
    assert "destination_symlink_refused" in d.log()
    still_serves(d)


def test_without_openat2_the_walk_takes_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A kernel before 5.6, or a seccomp filter, answers ENOSYS: the per-component walk serves.
    from ckptdrain.daemon.backends import beneath

    monkeypatch.setattr(beneath, "_syscall", None)
    root = tmp_path / "r"
    (root / "a").mkdir(parents=True)
    (root / "a" / "f").write_bytes(b"f")
    (root / "l").symlink_to(root / "a")
    fs = Beneath(root, use_openat2=True)
    fd = fs.open(["a", "f"])
    os.close(fd)
    assert fs.openat2 is False
    with pytest.raises(UnsafePath):
        fs.open(["l", "f"])
