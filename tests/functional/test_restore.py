"""Restore: from the destination, and the fast path from this node's local copy (never trusted
without the manifest's checksums: a corrupted local copy is detected and fetched remotely)."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ckptdrain.daemon import restore as restoring
from ckptdrain.daemon.backends.posix import PosixBackend, ReadSettings
from ckptdrain.daemon.cli_restore import _local_source
from tests.conftest import CKPTDRAIN, DaemonProcess


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def restore(d: DaemonProcess, to: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CKPTDRAIN, "restore", d.dest_uri, "--job", "rj", "--to", str(to),
                           "--socket", str(d.socket_path), *extra],
                          env=d.env(), capture_output=True, text=True)


def test_local_fast_path_equals_destination_and_catches_corruption(daemon: DaemonProcess, tmp_path: Path) -> None:
    with daemon.client().generation("rj", 5) as gen:
        for i in range(4):
            gen.put(f"dir{i % 2}/s{i}.bin", os.urandom(300_000 + i))
    daemon.client().wait("rj", 5, timeout_s=30)

    remote = restore(daemon, tmp_path / "remote", "--no-local")
    assert remote.returncode == 0, remote.stderr
    assert "local copy" not in remote.stdout
    local = restore(daemon, tmp_path / "local")
    assert local.returncode == 0, local.stderr
    assert "4 from this node's local copy" in local.stdout
    assert tree(tmp_path / "local") == tree(tmp_path / "remote")

    # Corrupt one staged copy: restore notices, takes that shard from the destination.
    staged = sorted((daemon.staging / "shards").glob("*.data"))
    assert len(staged) == 4
    data = bytearray(staged[0].read_bytes())
    data[100] ^= 0xFF
    staged[0].write_bytes(bytes(data))
    again = restore(daemon, tmp_path / "again")
    assert again.returncode == 0, again.stderr
    assert "3 from this node's local copy, 1 local copies failed their checksum" in again.stdout
    assert tree(tmp_path / "again") == tree(tmp_path / "remote")


def test_restore_with_a_progress_bar_and_without_a_daemon(daemon: DaemonProcess, tmp_path: Path) -> None:
    with daemon.client().generation("rj", 1) as gen:
        gen.put("w.bin", os.urandom(2 << 20))
    daemon.client().wait("rj", 1, timeout_s=30)
    daemon.stop()
    out = restore(daemon, tmp_path / "r", "--progress")
    assert out.returncode == 0, out.stderr
    assert "100.0%" in out.stderr and "[" in out.stderr
    assert (tmp_path / "r" / "w.bin").stat().st_size == 2 << 20


def test_a_named_socket_that_gives_no_local_copies_is_said_so(daemon: DaemonProcess,
                                                               tmp_path: Path) -> None:
    """Found as a new operator: `--socket` naming no daemon (a typo), or a daemon draining
    elsewhere, restored everything from the destination without a word. The default socket
    stays quiet: a machine with no daemon restores from the destination as a matter of course."""
    with daemon.client().generation("rj", 1) as gen:
        gen.put("w.bin", os.urandom(1 << 16))
    daemon.client().wait("rj", 1, timeout_s=30)
    base = [CKPTDRAIN, "restore", daemon.dest_uri, "--job", "rj"]
    typo = subprocess.run([*base, "--to", str(tmp_path / "a"), "--socket",
                           str(tmp_path / "no.sock")], env=daemon.env(), capture_output=True,
                          text=True)
    assert typo.returncode == 0, typo.stderr
    assert f"no local copies from {tmp_path / 'no.sock'}" in typo.stderr, typo.stderr
    assert "local copy" not in typo.stdout
    elsewhere = tmp_path / "other-dest"  # a copy of the destination: another destination
    shutil.copytree(daemon.dest_uri.removeprefix("file://"), elsewhere)
    other = subprocess.run([*base[:2], f"file://{elsewhere}", *base[3:], "--to",
                            str(tmp_path / "b"), "--socket", str(daemon.socket_path)],
                           env=daemon.env(), capture_output=True, text=True)
    assert other.returncode == 0, other.stderr
    assert "its local copies are not this destination's" in other.stderr, other.stderr
    assert "local copy" not in other.stdout
    quiet = subprocess.run([*base, "--to", str(tmp_path / "c")], capture_output=True, text=True,
                           env={**daemon.env(), "CKPTDRAIN_SOCKET": str(tmp_path / "no.sock")})
    assert quiet.returncode == 0, quiet.stderr
    assert "no local copies" not in quiet.stderr, quiet.stderr


STOPS = [  # (signals sent, SIGINT ignored as in a script's background job, exit, last words)
    ((signal.SIGTERM,), False, 143, "terminated"),
    ((signal.SIGHUP,), False, 129, "hung up"),
    ((signal.SIGINT, signal.SIGINT), False, 130, "interrupted"),
    ((signal.SIGTERM, signal.SIGTERM), True, 143, "terminated"),
]


@pytest.mark.parametrize(("signals", "int_ignored", "code", "said"), STOPS)
def test_a_stopped_restore_leaves_nothing_behind(daemon: DaemonProcess, tmp_path: Path,
                                                 signals: tuple[int, ...], int_ignored: bool,
                                                 code: int, said: str) -> None:
    # Found attacking the read side: Ctrl-C cleaned up, but SIGTERM (kill, timeout, a batch
    # system's time limit) and SIGHUP (a closed ssh session) killed the command outright and
    # left temp partials beside complete-looking files. Then, attacking that fix: with SIGINT
    # ignored (a script's background job) a SIGTERM could hang the command for good, and a
    # second signal cancelled its cleanup. Each now ends it once it has cleaned up.
    with daemon.client().generation("rj", 2) as gen:
        for i in range(8):
            gen.put(f"s{i}.bin", os.urandom(32 << 20))
    daemon.client().wait("rj", 2, timeout_s=60)

    def dispositions() -> None:
        # What the command starts with, whatever this run inherited (`nohup` ignores SIGHUP,
        # a shell's background job SIGINT, and the command keeps what it started ignoring).
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN if int_ignored else signal.default_int_handler)

    for attempt in range(5):  # a restore that ends before it is caught is tried again
        to = tmp_path / f"t{attempt}"
        proc = subprocess.Popen([CKPTDRAIN, "restore", daemon.dest_uri, "--job", "rj",
                                 "--to", str(to), "--no-local"], env=daemon.env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=dispositions)
        while proc.poll() is None and not (to.is_dir() and any(to.glob(".*.ckptdrain-tmp"))):
            time.sleep(0.001)
        if proc.poll() is not None:
            proc.communicate()
            continue
        for signum in signals:
            proc.send_signal(signum)
            time.sleep(0.002)
        _, err = proc.communicate(timeout=60)
        if proc.returncode == 0:
            continue  # it had finished meanwhile
        assert proc.returncode == code and err.strip().endswith(f"ckptdrain: {said}"), err
        assert "Traceback" not in err, err
        assert not to.exists() or not any(to.iterdir()), sorted(to.rglob("*"))
        return
    raise AssertionError("no restore was caught mid-way in 5 tries")


def test_a_rerun_over_a_killed_restore_leaves_exactly_the_checkpoint(daemon: DaemonProcess,
                                                                     tmp_path: Path) -> None:
    # Found attacking restore: after a restore was killed (kill -9), the rerun with
    # --overwrite that the docs advise left the killed run's temp files beside the restored
    # checkpoint (hundreds of MiB each). A rerun removes them from the directories it writes,
    # and nothing else: not a file of the user's, not one behind a planted link.
    shards = {"dir0/s0.bin": os.urandom(70_000), "top.bin": os.urandom(50_000)}
    with daemon.client().generation("rj", 3) as gen:
        for name, data in shards.items():
            gen.put(name, data)
    daemon.client().wait("rj", 3, timeout_s=30)
    into = tmp_path / "into"
    (into / "dir0").mkdir(parents=True)
    left = [into / "dir0" / ".s0.bin.0123456789ab.ckptdrain-tmp",
            into / ".top.bin.00000000beef.ckptdrain-tmp",
            into / ".other.bin.0000000000aa.ckptdrain-tmp"]  # another generation's shard
    for path in left:
        path.write_bytes(b"half a shard")
    (into / "keep.txt").write_text("the user's")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / ".x.bin.0123456789ab.ckptdrain-tmp").write_bytes(b"not the restore's")
    (into / "linked").symlink_to(outside)

    out = restore(daemon, into, "--no-local", "--overwrite")
    assert out.returncode == 0, out.stderr
    got = tree(into)
    assert got.pop("MANIFEST.json")
    assert got == {**shards, "keep.txt": b"the user's"}
    assert not any(path.exists() for path in left)
    assert (outside / ".x.bin.0123456789ab.ckptdrain-tmp").read_bytes() == b"not the restore's"
    # A shard's directory planted as a link out of the target: the restore refuses it, and
    # the sweep did not look behind it.
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "dir0").symlink_to(outside)
    (outside / ".s0.bin.0123456789ab.ckptdrain-tmp").write_bytes(b"not the restore's")
    refused = restore(daemon, planted, "--no-local", "--overwrite")
    assert refused.returncode == 1 and "outside" in refused.stderr, refused.stderr
    assert sorted(p.name for p in outside.iterdir()) == [
        ".s0.bin.0123456789ab.ckptdrain-tmp", ".x.bin.0123456789ab.ckptdrain-tmp"]


def save_top(daemon: DaemonProcess, step: int) -> None:
    """Step ``step`` of "rj": one shard, top.bin, committed."""
    with daemon.client().generation("rj", step) as gen:
        gen.put("top.bin", os.urandom(10_000))
    daemon.client().wait("rj", step, timeout_s=30)


def test_a_directory_where_a_shard_goes_is_named_as_the_shards_place(daemon: DaemonProcess,
                                                                     tmp_path: Path) -> None:
    # Found attacking restore: under --overwrite, a directory where a shard goes failed the
    # restore naming the temp file (".top.bin.<random>.ckptdrain-tmp: Is a directory").
    save_top(daemon, 4)
    into = tmp_path / "into"
    (into / "top.bin").mkdir(parents=True)
    out = restore(daemon, into, "--no-local", "--overwrite")
    assert out.returncode == 1, out.stderr
    assert f"{into / 'top.bin'}: Is a directory" in out.stderr, out.stderr
    assert "ckptdrain-tmp" not in out.stderr, out.stderr
    assert sorted(p.name for p in into.iterdir()) == ["top.bin"]


def test_a_second_restore_into_a_directory_being_restored_is_refused(daemon: DaemonProcess,
                                                                    tmp_path: Path) -> None:
    # Found attacking the removal of a killed restore's temp files: a second restore into
    # the same directory took the first one's temp files for leftovers and removed them; one
    # of the two failed, or left a MANIFEST.json over files the other's undo removed. A
    # restore holds a lock on its target: a second one is refused, and touches nothing.
    import fcntl

    save_top(daemon, 6)
    into = tmp_path / "into"
    into.mkdir()
    live = into / ".top.bin.0123456789ab.ckptdrain-tmp"  # the first restore's, being written
    live.write_bytes(b"half written")
    fd = os.open(into, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as the first restore holds it
        out = restore(daemon, into, "--no-local", "--overwrite")
    finally:
        os.close(fd)
    assert out.returncode == 1, out.stderr
    assert "another `ckptdrain restore` is writing into" in out.stderr, out.stderr
    assert sorted(p.name for p in into.iterdir()) == [live.name]
    again = restore(daemon, into, "--no-local", "--overwrite")  # the lock gone with its fd
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in into.iterdir()) == ["MANIFEST.json", "top.bin"]


def test_a_temp_file_a_live_restore_holds_is_left_by_another_restores_sweep(
        daemon: DaemonProcess, tmp_path: Path) -> None:
    # Found attacking the target lock: a restore into a parent (or a child) of another
    # restore's target swept that one's temp files as a killed restore's, and it failed. A
    # live restore holds a lock on each of its temp files; the sweep removes only unheld ones.
    import fcntl

    with daemon.client().generation("rj", 7) as gen:
        gen.put("sub/other.bin", os.urandom(10_000))
    daemon.client().wait("rj", 7, timeout_s=30)
    into = tmp_path / "into"
    (into / "sub").mkdir(parents=True)
    live = into / "sub" / ".big.bin.0123456789ab.ckptdrain-tmp"  # a restore into sub/'s
    stale = into / "sub" / ".old.bin.00000000beef.ckptdrain-tmp"  # a killed restore's
    live.write_bytes(b"being written")
    stale.write_bytes(b"left behind")
    fd = os.open(live, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        out = restore(daemon, into, "--no-local", "--overwrite")
        assert out.returncode == 0, out.stderr
        assert live.read_bytes() == b"being written" and not stale.exists()
    finally:
        os.close(fd)
    assert sorted(p.name for p in (into / "sub").iterdir()) == [live.name, "other.bin"]


def test_a_shard_of_the_longest_legal_name_restores(daemon: DaemonProcess, tmp_path: Path) -> None:
    # Found attacking restore: a shard whose last component is 228 to 255 bytes (the longest
    # a name may be) drained and committed, but every restore failed "File name too long":
    # the temp name `.<name>.<random>.ckptdrain-tmp` is 28 bytes longer. The name part of
    # the temp name is shortened, as the daemon's own are, and a killed restore's shortened
    # temp file is still swept by the rerun.
    longest, long = "n" * 255, "m" * 230
    shards = {f"d/{longest}": os.urandom(20_000), f"d/{long}": os.urandom(10_000),
              longest: b"at the top"}
    with daemon.client().generation("rj", 8) as gen:
        for name, data in shards.items():
            gen.put(name, data)
    daemon.client().wait("rj", 8, timeout_s=30)

    remote = restore(daemon, tmp_path / "remote", "--no-local")
    assert remote.returncode == 0, remote.stderr
    local = restore(daemon, tmp_path / "local")
    assert local.returncode == 0, local.stderr
    assert "3 from this node's local copy" in local.stdout, local.stdout
    for into in (tmp_path / "remote", tmp_path / "local"):
        got = tree(into)
        assert got.pop("MANIFEST.json")
        assert got == shards

    killed = tmp_path / "local" / "d" / f".{longest[:227]}.0123456789ab.ckptdrain-tmp"
    killed.write_bytes(b"half a shard")
    again = restore(daemon, tmp_path / "local", "--no-local", "--overwrite")
    assert again.returncode == 0, again.stderr
    assert not killed.exists()
    assert not list((tmp_path / "local").rglob("*.ckptdrain-tmp"))


def two_shards_one_nested(daemon: DaemonProcess, step: int, nested: str) -> None:
    """Step ``step`` of "rj": x.bin and ``nested``, committed."""
    with daemon.client().generation("rj", step) as gen:
        gen.put("x.bin", b"top-level x.bin " * 1000)
        gen.put(nested, b"nested " * 1000)
    daemon.client().wait("rj", step, timeout_s=30)


def test_a_link_inside_the_target_does_not_merge_two_shards(daemon: DaemonProcess,
                                                            tmp_path: Path) -> None:
    # Found attacking restore: with `a -> .` in the target, shards x.bin and a/x.bin were
    # written to one file, and the restore said "checksums verified", exit 0. A link in a
    # shard's directories is refused before anything is written, naming the link.
    two_shards_one_nested(daemon, 9, "a/x.bin")
    for extra in (("--no-local",), ()):
        into = tmp_path / f"into{len(extra)}"
        into.mkdir()
        (into / "a").symlink_to(".")
        out = restore(daemon, into, "--overwrite", *extra)
        assert out.returncode == 1, out.stdout
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert f"{into / 'a'} is a symbolic link" in out.stderr, out.stderr
        assert sorted(p.name for p in into.iterdir()) == ["a"]


def test_a_link_inside_the_target_makes_no_directory_where_it_leads(daemon: DaemonProcess,
                                                                   tmp_path: Path) -> None:
    # Found attacking restore: with `a -> /outside` in the target, a shard a/x/y/b.bin had
    # its directories made in /outside, through the link, before the restore refused the
    # path (its undo removed them; a kill in between left them there). Nothing is made
    # there now: `outside`'s time of change would say so.
    two_shards_one_nested(daemon, 10, "a/x/y/b.bin")
    into, outside = tmp_path / "into", tmp_path / "outside"
    into.mkdir()
    outside.mkdir()
    (into / "a").symlink_to(outside)
    os.utime(outside, (1_000_000_000, 1_000_000_000))
    out = restore(daemon, into, "--overwrite", "--no-local")
    assert out.returncode == 1, out.stdout
    assert list(outside.iterdir()) == []
    assert outside.stat().st_mtime == 1_000_000_000
    assert f"{into / 'a'} is a symbolic link" in out.stderr, out.stderr
    assert sorted(p.name for p in into.iterdir()) == ["a"]


def test_a_daemon_gone_part_way_through_leaves_the_restore_to_the_destination(
        daemon: DaemonProcess, tmp_path: Path) -> None:
    # Found attacking restore: this node's daemon killed (or hung, or restarted) after the
    # restore had asked it which destination it drains to failed the restore with "cannot
    # reach the ckptdrain daemon ...: start it with `ckptdrain serve`", and removed what it
    # had restored, though every shard was at the destination. The local copies are a fast
    # path only: the shards come from the destination instead. The restore runs in this
    # process, so that the daemon goes at that exact point.
    with daemon.client().generation("rj", 3) as gen:
        for i in range(4):
            gen.put(f"s{i}.bin", os.urandom(100_000 + i))
    daemon.client().wait("rj", 3, timeout_s=30)
    ns = argparse.Namespace(job="rj", dest=daemon.dest_uri, socket=daemon.socket_path,
                            config=None)
    local = _local_source(ns, 3)
    assert local is not None  # the daemon answered: it drains to this destination
    daemon.kill()
    backend = PosixBackend(ReadSettings(daemon.dest_uri, daemon.dest), "restorer")

    async def run() -> restoring.RestoreReport:
        try:
            return await restoring.restore(backend, "rj", 3, tmp_path / "r", local=local)
        finally:
            await backend.aclose()

    report = asyncio.run(run())
    assert (report.files, report.local_files) == (4, 0)
    committed = daemon.dest / "rj" / f"{3:020d}"
    assert tree(tmp_path / "r") == {name: data for name, data in tree(committed).items()
                                    if not name.startswith("_parts/")}
