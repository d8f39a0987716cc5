"""Nothing overwrites a committed generation, whichever node the later attempt runs on."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from ckptdrain.client import AlreadyCommitted, GenerationFailed
from tests.conftest import CKPTDRAIN, DaemonProcess


def verify(d: DaemonProcess, job: str, step: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CKPTDRAIN, "verify", d.dest_uri, "--job", job, "--generation", str(step)],
                          env=d.env(), capture_output=True, text=True)


def test_a_later_attempt_on_another_node_cannot_begin_a_committed_step(make_daemon) -> None:  # type: ignore[no-untyped-def]
    n1: DaemonProcess = make_daemon("n1")
    n0: DaemonProcess = make_daemon("n0")
    with n1.client().generation("job", 5) as gen:
        gen.put("model.bin", b"committed bytes")
    n1.client().wait("job", 5, timeout_s=30)
    with pytest.raises(AlreadyCommitted, match="step 5 of job 'job' is committed; save a new step"):
        n0.client().generation("job", 5, attempt="restart-1").__enter__()
    assert (n1.dest / "job" / f"{5:020d}" / "model.bin").read_bytes() == b"committed bytes"
    assert verify(n1, "job", 5).returncode == 0
    assert n0.proc is not None and n0.proc.poll() is None


def test_an_attempt_that_drains_after_another_committed_fails_and_leaves_the_bytes(make_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    n1: DaemonProcess = make_daemon("n1")
    # n0 begins before the commit, so `begin` cannot know; its drain waits until released.
    config = tmp_path / "n0.toml"
    config.write_text("[drain]\nmax_bandwidth_bytes_per_s = 1\n")
    n0: DaemonProcess = make_daemon("n0", start=False, CKPTDRAIN_CONFIG=str(config))
    n0.start()
    late = n0.client()
    with late.generation("race", 5, attempt="restart-1") as gen:
        gen.put("model.bin", os.urandom(4096))
    with n1.client().generation("race", 5) as gen:
        gen.put("model.bin", b"committed bytes")
    n1.client().wait("race", 5, timeout_s=30)
    # Release n0's drain: its create-once write meets the committed shard.
    config.write_text("[drain]\nmax_bandwidth_bytes_per_s = 0\n")
    os.kill(n0.pid, signal.SIGHUP)
    with pytest.raises(GenerationFailed) as failed:
        late.wait("race", 5, timeout_s=60)
    assert (n1.dest / "race" / f"{5:020d}" / "model.bin").read_bytes() == b"committed bytes"
    assert verify(n1, "race", 5).returncode == 0
    assert "committed" in str(failed.value) and "save a new step" in str(failed.value)
    assert n0.proc is not None and n0.proc.poll() is None
