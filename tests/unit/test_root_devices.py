"""RootDevices: the filesystem each file:// destination root was on, kept on the node's disk
so that a restart before the node's mounts came back knows the root is not mounted."""

from __future__ import annotations

import json
from pathlib import Path

from ckptdrain.daemon.backends.beneath import RootDevices


def test_a_write_that_failed_is_made_at_the_next_note(tmp_path: Path) -> None:
    # Found fixing a full staging disk's restart: the file was written only when a root's
    # filesystem changed, and memory was updated first, so a write that failed (a full
    # staging disk) was never made again, and a restart did not know the root.
    kept = tmp_path / "destination-roots.json"
    devices = RootDevices()
    devices.keep_in(kept)
    blocker = tmp_path / "destination-roots.json.tmp"
    blocker.mkdir()  # the temp cannot be made: the write fails, as on a full disk
    (blocker / "x").write_text("")
    devices.note(Path("/lustre/ckpt"), 41)
    assert not kept.exists()
    assert devices.get(Path("/lustre/ckpt")) == 41  # the running daemon knows it meanwhile
    (blocker / "x").unlink()
    blocker.rmdir()
    devices.note(Path("/lustre/ckpt"), 41)  # nothing changed, but the file lacks it
    assert json.loads(kept.read_text()) == {"/lustre/ckpt": 41}
    again = RootDevices()
    again.keep_in(kept)
    assert again.get(Path("/lustre/ckpt")) == 41
