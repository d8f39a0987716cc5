"""A commit step that fails for good (the part record cannot be written) fails that generation
only: the daemon stays up, serves other jobs, and a restart does not crash on it again."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client import DestinationError, GenerationFailed
from tests.conftest import CKPTDRAIN, DaemonProcess, wait_for


def block_part_records(d: DaemonProcess, job: str, step: int) -> Path:
    """Make ``_parts`` a regular file, so writing ``_parts/<node>.json`` fails with ENOTDIR:
    a destination error no retry can fix, like EXDEV or a full destination."""
    gen_dir = d.dest / job / f"{step:020d}"
    gen_dir.mkdir(parents=True, exist_ok=True)
    blocker = gen_dir / "_parts"
    blocker.write_bytes(b"not a directory")
    return blocker


def state_of(d: DaemonProcess, job: str, step: int) -> dict[str, object]:
    for g in d.client().status()["generations"]:
        if (g["job"], g["step"]) == (job, step):
            return g  # type: ignore[no-any-return]
    raise AssertionError(f"{job} step {step} not in status")


def assert_serves_another_job(d: DaemonProcess, job: str) -> None:
    with d.client().generation(job, 1) as g:
        g.put("w.bin", b"w" * 4096)
    d.client().wait(job, 1, timeout_s=30)
    assert (d.dest / job / f"{1:020d}" / "MANIFEST.json").exists()


def test_a_part_record_that_cannot_be_written_fails_the_generation_not_the_daemon(
    daemon: DaemonProcess,
) -> None:
    block_part_records(daemon, "blocked", 3)
    with daemon.client().generation("blocked", 3) as g:
        g.put("model.pt", b"m" * 10_000)
    with pytest.raises(GenerationFailed, match=r"part record.*_parts/node-a\.json"):
        daemon.client().wait("blocked", 3, timeout_s=30)
    assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log()
    assert state_of(daemon, "blocked", 3)["state"] == "failed"
    assert "_parts" in str(state_of(daemon, "blocked", 3)["error"])
    assert_serves_another_job(daemon, "other")
    # The failure is journalled: a restart comes up and reports it, nothing re-runs it.
    assert daemon.stop() == 0
    daemon.start()
    assert state_of(daemon, "blocked", 3)["state"] == "failed"
    assert_serves_another_job(daemon, "after-restart")


def test_a_restart_that_meets_an_unwritable_part_record_does_not_crash(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # 1 byte/s: the shard is acknowledged but not drained when the daemon dies.
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1")
    with d.client().generation("blocked-r", 5) as g:
        g.put("model.pt", b"m" * 50_000)
    d.kill()
    block_part_records(d, "blocked-r", 5)
    d.overrides.pop("CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S")
    # Recovery drains the shard and tries the part record: the generation fails, the daemon
    # stays up (before the fix it died here, on every restart).
    d.start()
    with pytest.raises(GenerationFailed, match="part record"):
        d.client().wait("blocked-r", 5, timeout_s=30)
    assert d.proc is not None and d.proc.poll() is None, d.log()
    assert_serves_another_job(d, "other-r")
    assert d.stop() == 0
    d.start()
    assert state_of(d, "blocked-r", 5)["state"] == "failed"


def test_a_failed_part_record_is_logged_once(daemon: DaemonProcess) -> None:
    block_part_records(daemon, "blocked-log", 1)
    with daemon.client().generation("blocked-log", 1) as g:
        g.put("a.bin", b"a" * 100)
    with pytest.raises(GenerationFailed):
        daemon.client().wait("blocked-log", 1, timeout_s=30)
    wait_for(lambda: "event=generation_failed" in daemon.log(), 10, what="the failure log line")
    lines = [line for line in daemon.log().splitlines() if "blocked-log" in line and "level=error" in line]
    assert sum("event=generation_failed" in line for line in lines) == 1, lines


@pytest.mark.parametrize("through_a_link", [False, True])
def test_a_destination_whose_filesystem_is_not_mounted_is_not_filled_locally(
        make_daemon: Any, tmp_path: Path, through_a_link: bool) -> None:
    # Found in a long run that renamed the destination away: a missing root was made again
    # with mkdir -p, and for file:///lustre/proj/ckpt with Lustre not mounted (/lustre an
    # empty directory) that drains checkpoints onto the node's own disk and commits them
    # where no other node or restart looks. Only the root itself is made now. A root that
    # is a link into the unmounted filesystem failed at once instead of waiting the same way
    # (found attacking that fix).
    mount_point = tmp_path / "lustre"
    mount_point.mkdir()
    root = mount_point / "proj" / "ckpt"
    if through_a_link:
        (tmp_path / "ckpt").symlink_to(root)
        root = tmp_path / "ckpt"
    d: DaemonProcess = make_daemon(dest=f"file://{root}", CKPTDRAIN_DRAIN__RETRY_BUDGET_S="2")
    with d.client().generation("job", 1) as g:
        g.put("w.bin", b"w" * 4096)
    with pytest.raises(GenerationFailed, match="is its filesystem mounted"):
        d.client().wait("job", 1, timeout_s=30)
    assert list(mount_point.iterdir()) == []
    assert "transient=true" in d.log()  # retried as the wait for a mount, not failed at once
    (mount_point / "proj").mkdir()  # mounted: the root's parent is there, the root is made
    if through_a_link:
        (mount_point / "proj" / "ckpt").mkdir()
    d.client().retry("job", 1)
    d.client().wait("job", 1, timeout_s=30)
    assert (mount_point / "proj" / "ckpt" / "job" / f"{1:020d}" / "MANIFEST.json").exists()


def test_a_root_one_directory_below_an_unmounted_mount_point_is_not_made_locally(
        make_daemon: Any, small_tmpfs: Path) -> None:
    # Found attacking: with the recommended layout (the root one directory below the mount
    # point), unmounting the filesystem left the mount point an empty directory of the node's
    # disk; the root was made there, step 2 was reported committed onto the node's own disk,
    # and `latest` answered "nothing committed"; so after a restart. A missing root that this
    # node last saw on another filesystem than its parent is on now (and the parent no mount
    # point) reads as a filesystem not mounted, remembered on the node's disk.
    root = small_tmpfs / "ckpt"
    d: DaemonProcess = make_daemon(dest=f"file://{root}", CKPTDRAIN_DRAIN__RETRY_BUDGET_S="2")
    client = d.client()
    with client.generation("job", 1) as g:  # mounted: the root is made in the mount point
        g.put("w.bin", b"w" * 4096)
    client.wait("job", 1, timeout_s=30)

    def not_mounted_says_so(step: int) -> None:
        client = d.client()
        with pytest.raises(DestinationError, match="is its filesystem mounted"):
            client.latest("job")
        with client.generation("job", step) as g:
            g.put("w.bin", b"w" * 4096)
        with pytest.raises(GenerationFailed, match="is its filesystem mounted"):
            client.wait("job", step, timeout_s=30)

    subprocess.run(["umount", "-l", str(small_tmpfs)], check=True)
    try:
        not_mounted_says_so(2)
        assert d.proc is not None and d.proc.poll() is None, d.log()
        d.kill()  # a node rebooted before its mounts came back
        d.start()
        not_mounted_says_so(3)
        assert list(small_tmpfs.iterdir()) == []  # nothing written onto the node's disk
    finally:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(small_tmpfs)],
                       check=True)
    # Mounted again (empty: a fresh filesystem), the root is made as for a new destination.
    client = d.client()
    client.retry("job", 2)
    client.wait("job", 2, timeout_s=30)
    assert (root / "job" / f"{2:020d}" / "MANIFEST.json").exists()


def test_a_root_that_is_itself_an_unmounted_mount_point_is_not_written_locally(
        make_daemon: Any, small_tmpfs: Path, tmp_path: Path) -> None:
    # Found attacking the check above: with the root itself the mount point, unmounted, the
    # root is an empty directory of the node's disk that opens fine: step 2 was committed
    # into it, `latest` said "nothing committed", and the filesystem remembered was
    # overwritten with the node's. An empty root that is no mount point, on another
    # filesystem than this node last saw it on, reads as not mounted now. The file that
    # remembers it is never written through a link planted at its temp name either.
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    staging = tmp_path / "node-a" / "staging"
    staging.mkdir(parents=True)
    (staging / "destination-roots.json.tmp").symlink_to(victim)
    d: DaemonProcess = make_daemon(dest=f"file://{small_tmpfs}", CKPTDRAIN_DRAIN__RETRY_BUDGET_S="2")
    client = d.client()
    with client.generation("job", 1) as g:
        g.put("w.bin", b"w" * 4096)
    client.wait("job", 1, timeout_s=30)
    assert victim.read_text() == "untouched"
    assert not (staging / "destination-roots.json").is_symlink()
    subprocess.run(["umount", "-l", str(small_tmpfs)], check=True)
    try:
        for restarted in (False, True):
            if restarted:
                d.kill()
                d.start()
            client = d.client()
            with pytest.raises(DestinationError, match="is its filesystem mounted"):
                client.latest("job")
            with client.generation("job", 2 + restarted) as g:
                g.put("w.bin", b"w" * 4096)
            with pytest.raises(GenerationFailed, match="is its filesystem mounted"):
                client.wait("job", 2 + restarted, timeout_s=30)
        assert list(small_tmpfs.iterdir()) == []  # nothing written onto the node's disk
    finally:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(small_tmpfs)],
                       check=True)


def test_a_root_that_is_itself_a_mount_point_is_warned_of(
        make_daemon: Any, small_tmpfs: Path) -> None:
    # Found attacking: with the destination root the mount point itself (file:///lustre),
    # an unmounted filesystem leaves an empty directory: nothing reads as missing, `latest`
    # answers "nothing committed" and writes land on the node's disk. Nothing at the
    # destination can tell that apart from a job deleted on purpose (a check on it refused
    # `latest` for good after an operator removed the only job), so the daemon says at
    # start-up to put the destination one directory below the mount point.
    at_mount: DaemonProcess = make_daemon("node-a", dest=f"file://{small_tmpfs}")
    below: DaemonProcess = make_daemon("node-b", dest=f"file://{small_tmpfs}/ckpt")
    assert "event=destination_root_is_a_mount_point" in at_mount.log()
    assert f"{small_tmpfs.as_uri()}/ckpt" in at_mount.log()
    assert "destination_root_is_a_mount_point" not in below.log()


def test_status_says_what_a_generation_is_retrying_during_an_outage(
        make_daemon: Any, tmp_path: Path) -> None:
    # Found attacking the operator's view: through an outage `status` showed the generation
    # "open", its shards draining at 0 B/s and no error, until it failed minutes later; the
    # cause was only in the log. It shows what is being retried, and how often, meanwhile.
    root = tmp_path / "lustre" / "proj" / "ckpt"
    (tmp_path / "lustre").mkdir()
    d: DaemonProcess = make_daemon(dest=f"file://{root}")
    with d.client().generation("job", 1) as g:
        g.put("w.bin", b"w" * 4096)
    wait_for(lambda: "is its filesystem mounted" in str(state_of(d, "job", 1)["retrying"]),
             what="the retried error in status")
    assert state_of(d, "job", 1)["error"] == ""
    shown = subprocess.run([CKPTDRAIN, "status", "--socket", str(d.socket_path)],
                           capture_output=True, text=True, timeout=30, check=True).stdout
    assert "    retrying: io: the destination root" in shown and "(try " in shown
    (tmp_path / "lustre" / "proj").mkdir()  # mounted
    d.client().wait("job", 1, timeout_s=60)
    assert state_of(d, "job", 1)["retrying"] == ""


@pytest.mark.parametrize("through_a_link", [False, True])
def test_a_destination_whose_filesystem_is_not_mounted_is_no_answer_to_latest(
        make_daemon: Any, tmp_path: Path, through_a_link: bool) -> None:
    # Found attacking DCP: with the destination's filesystem not mounted (a node rebooted
    # before Lustre's automount), `latest` answered "nothing committed" (None) while the
    # daemon's own status listed the job's commits, so the documented resume recipe started
    # training again from step 0. A read of a root that looks unmounted fails like a write.
    mount_point = tmp_path / "lustre"
    (mount_point / "proj").mkdir(parents=True)
    root = mount_point / "proj" / "ckpt"
    if through_a_link:
        (mount_point / "proj" / "ckpt").mkdir()
        (tmp_path / "ckpt").symlink_to(root)
        root = tmp_path / "ckpt"
    d: DaemonProcess = make_daemon(dest=f"file://{root}")
    client = d.client()
    assert client.latest("job") is None  # a new destination (only the root missing): empty
    with client.generation("job", 200) as g:
        g.put("w.bin", b"w" * 4096)
    client.wait("job", 200, timeout_s=30)
    assert client.latest("job") == 200
    (mount_point / "proj").rename(tmp_path / "proj.unmounted")
    for ask in (lambda: client.latest("job"), lambda: client.latest_path("job")):
        with pytest.raises(DestinationError, match="is its filesystem mounted"):
            ask()
    assert d.proc is not None and d.proc.poll() is None, d.log()
    (tmp_path / "proj.unmounted").rename(mount_point / "proj")  # mounted again
    assert client.latest("job") == 200


def test_a_drained_shard_deleted_before_the_commit_fails_the_generation_at_once(
    make_daemon: Any,
) -> None:
    # Found attacking: an operator freeing room removed a drained shard of a generation still
    # waiting for its commit. The daemon waited silently for drain.commit_wait_s (an hour by
    # default), then said "the manifest never appeared", and `retry` re-sent only shards that
    # had failed before, so it could never commit. Now the generation ends at its commit
    # naming the shard, and `retry` drains it again from the kept local copy. The drain is
    # paced so that copy takes a second or two: the retry published before it ended, and
    # failed again (found attacking the fix).
    daemon: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="400000")
    gen_dir = daemon.dest / "lost" / f"{1:020d}"
    client = daemon.client()
    with client.generation("lost", 1, rank=0, world_size=2) as g:
        g.put("rank0.bin", b"0" * 600_000)
    wait_for(lambda: (gen_dir / "rank0.bin").exists(), what="rank 0's shard drained")
    (gen_dir / "rank0.bin").unlink()
    with client.generation("lost", 1, rank=1, world_size=2) as g:
        g.put("rank1.bin", b"1" * 600_000)
    with pytest.raises(GenerationFailed, match=r"'rank0\.bin'.*missing at the destination.*"
                                               r"ckptdrain retry lost 1"):
        client.wait("lost", 1, timeout_s=60)  # not drain.commit_wait_s (3600 s)
    assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log()

    assert client.retry("lost", 1)["requeued"] == 1
    client.wait("lost", 1, timeout_s=30)
    assert (gen_dir / "rank0.bin").read_bytes() == b"0" * 600_000
    assert (gen_dir / "MANIFEST.json").exists()
    # Both copies kept for a fast restore, not only the re-sent one's (found attacking: the
    # failure dropped the drained shards' copies).
    assert client.status()["kept_copy_bytes"] == 2 * 600_000
    assert_serves_another_job(daemon, "other")


def test_another_nodes_failure_keeps_what_to_do_however_long_its_paths(
        make_daemon: Any, small_tmpfs: Path) -> None:
    # Found attacking: a rank's abort reason went into its node's part record cut at its end
    # (1024 characters), and with a long destination and shard path the other nodes said the
    # generation could not commit without the words "the destination is full" or what to do.
    dest = small_tmpfs / ("d" * 200) / "ckpt"
    dest.mkdir(parents=True)
    a: DaemonProcess = make_daemon("node-a", dest=dest.as_uri())
    b: DaemonProcess = make_daemon("node-b", dest=dest.as_uri())
    (small_tmpfs / "filler").write_bytes(b"\0" * (62 << 20))  # of 64 MiB
    job = "j" * 100
    path = "/".join(["p" * 200] * 3) + "/w.bin"
    with a.client().generation(job, 1, rank=0, world_size=2) as gen:
        gen.put("small.bin", b"x" * 1000)
    wait_for(lambda: (dest / job / f"{1:020d}" / "_parts" / "node-a.json").exists())
    with b.client().generation(job, 1, rank=1, world_size=2) as gen:
        gen.put(path, b"y" * (4 << 20))
    with pytest.raises(GenerationFailed) as failed:
        a.client().wait(job, 1, timeout_s=60)
    said = failed.value.message
    assert "aborted on node 'node-b'" in said and "the destination is full" in said, said
    assert "free space" in said, said
