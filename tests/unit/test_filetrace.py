"""The strace reader the fuzzer uses to prove the daemon writes nowhere else."""

from __future__ import annotations

from pathlib import Path

from tests.chaos.filetrace import outside, written_paths

LOG = """\
4242  openat(AT_FDCWD</srv>, "/srv/staging/journal.sqlite3", O_RDWR|O_CREAT|O_CLOEXEC, 0600) = 7</srv/staging/journal.sqlite3>
4242  openat(AT_FDCWD</srv>, "/etc/passwd", O_RDONLY|O_CLOEXEC) = 8</etc/passwd>
4243  openat(9</srv/dest/job/00000000000000000001>, "w.bin.tmp", O_WRONLY|O_CREAT|O_EXCL|O_CLOEXEC, 0644) = 10</srv/dest/job/00000000000000000001/w.bin.tmp>
4243  linkat(9</srv/dest/job/00000000000000000001>, "w.bin.tmp", 9</srv/dest/job/00000000000000000001>, "w.bin", 0) = 0
4243  mkdirat(11</etc>, "cron.d", 0755) = 0
4243  renameat2(12</srv/dest/job>, "a", 13</root>, "b", 0) = 0
4243  unlinkat(14</srv/dest>, "gone", 0) = -1 ENOENT (No such file or directory)
"""


def test_written_paths_follow_directory_fds_and_skip_reads_and_failures(tmp_path: Path) -> None:
    log = tmp_path / "strace.log"
    log.write_text(LOG)
    assert written_paths(log) == [
        "/srv/staging/journal.sqlite3",
        "/srv/dest/job/00000000000000000001/w.bin.tmp",
        "/srv/dest/job/00000000000000000001/w.bin.tmp",
        "/srv/dest/job/00000000000000000001/w.bin",
        "/etc/cron.d",
        "/srv/dest/job/a",
        "/root/b",
    ]


def test_outside_names_what_lies_under_no_allowed_root(tmp_path: Path) -> None:
    log = tmp_path / "strace.log"
    log.write_text(LOG)
    assert outside(written_paths(log), [Path("/srv/staging"), Path("/srv/dest")]) == [
        "/etc/cron.d", "/root/b"]
