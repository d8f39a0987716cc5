"""The SeaweedFS test server's own hygiene: work directories of dead owners are swept."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.integration.seaweedfs import OWNER_FILE, sweep_orphaned_workdirs


def _workdir(root: Path, name: str, owner: int | None) -> Path:
    d = root / name
    (d / "data").mkdir(parents=True)
    (d / "data" / "volume.dat").write_bytes(b"x" * 4096)
    if owner is not None:
        (d / OWNER_FILE).write_text(str(owner))
    return d


def test_a_dead_owners_workdir_is_swept_and_nothing_else(tmp_path: Path) -> None:
    # Found this session: 28 GB of /tmp/weed-* left by killed servers (weed died with its
    # owner, its data did not) cost a benchmark its 8 x 2 GiB row (staging clamped to the
    # free space).
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = _workdir(tmp_path, "weed-dead", gone.pid)
    live = _workdir(tmp_path, "weed-live", os.getppid())
    mine = _workdir(tmp_path, "weed-mine", os.getpid())
    unowned = _workdir(tmp_path, "weed-unowned", None)
    garbled = _workdir(tmp_path, "weed-garbled", None)
    (garbled / OWNER_FILE).write_text("not a pid")
    other = _workdir(tmp_path, "not-weed", gone.pid)
    assert sweep_orphaned_workdirs(tmp_path) == [dead]
    assert not dead.exists()
    assert all(d.exists() for d in (live, mine, unowned, garbled, other))
