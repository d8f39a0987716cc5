"""The staging lock: who holds it, and whether its last owner stopped cleanly."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptdrain.daemon.errors import StartupError
from ckptdrain.daemon.staginglock import LOCK_NAME, StagingLock


def test_a_lock_held_before_its_pid_is_written_names_no_pid(tmp_path: Path) -> None:
    # Between taking the directory's lock and writing its pid, a daemon's lock file holds
    # what the last one left: after a clean stop, "-", which the refusal named as "pid -".
    first = StagingLock(tmp_path)
    first.acquire()
    try:
        (tmp_path / LOCK_NAME).write_bytes(b"-\n")
        with pytest.raises(StartupError, match=r"\(pid unknown\)"):
            StagingLock(tmp_path).acquire()
    finally:
        first.release()


def test_a_clean_release_is_told_from_a_crash(tmp_path: Path) -> None:
    lock = StagingLock(tmp_path)
    lock.acquire()
    assert not lock.unclean  # a new staging directory
    lock.release()
    again = StagingLock(tmp_path)
    again.acquire()
    assert not again.unclean
    again.release()
    (tmp_path / LOCK_NAME).write_bytes(b"4242\n")  # what a killed daemon leaves
    after_crash = StagingLock(tmp_path)
    after_crash.acquire()
    assert after_crash.unclean
    after_crash.release()  # recovery never settled: the crash stays on record
    assert (tmp_path / LOCK_NAME).read_bytes().strip().isdigit()
