"""Many small shards: the fsyncs, journal transactions and thread jobs they cost are shared
by batches (group commit of the journal, batched drains to a POSIX destination), never paid
once per shard where one batch serves; and a kill -9 in the middle of a batch loses nothing
that was acknowledged."""

from __future__ import annotations

import asyncio
import collections
import os
import re
import signal
import subprocess
import threading
import urllib.request
from pathlib import Path

import pytest

from ckptdrain.client import DrainError
from ckptdrain.client.manifest import Manifest
from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.backends.posix import PosixBackend
from ckptdrain.daemon.checksums import of_bytes
from ckptdrain.daemon.config import DestinationConfig
from tests.conftest import CKPTDRAIN, DaemonProcess, wait_for

RANKS = 8
PER_RANK = 32
N = RANKS * PER_RANK
PAUSED = {"CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S": "1"}


def blobs() -> dict[str, bytes]:
    return {f"r{r}/s{j}.bin": os.urandom(4096 + r * PER_RANK + j)
            for r in range(RANKS) for j in range(PER_RANK)}


def hand_off(d: DaemonProcess, job: str, data: dict[str, bytes]) -> None:
    """RANKS clients at once, one rank each, every shard acknowledged (ack=local), sealed."""
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            with d.client(timeout_s=120) as c, \
                    c.generation(job, 1, rank=r, world_size=RANKS) as gen:
                for path, payload in data.items():
                    if path.startswith(f"r{r}/"):
                        gen.put(path, payload)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(RANKS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors


def traced_start(d: DaemonProcess, trace: Path) -> subprocess.Popen[bytes]:
    """The daemon under ``strace -ff -y``, every fsync and fdatasync written with the path of
    its descriptor to ``<trace>.<tid>``, one file per thread (so no call is split in two)."""
    assert d.log_path is None or d.proc is None or d.proc.poll() is not None
    d.log_path = d.root / "traced.log"
    with open(d.log_path, "wb") as log:
        tracer = subprocess.Popen(
            ["strace", "-ff", "-qq", "-y", "-e", "trace=fsync,fdatasync", "-o", str(trace),
             CKPTDRAIN, "serve"], env=d.env(), stdout=log, stderr=subprocess.STDOUT)
    d.proc = tracer  # signals reach the daemon through strace, which exits with it
    wait_for(lambda: d.socket_path.exists() and _answers(d), 60)
    return tracer


def _answers(d: DaemonProcess) -> bool:
    try:
        with d.client(timeout_s=5) as c:
            c.status()
        return True
    except (OSError, DrainError):  # not up yet (DaemonUnavailable), or a stale socket
        return False


_FSYNC = re.compile(r"\b(?:fsync|fdatasync)\(\d+<([^>]*)>\) = 0")


def fsyncs_by_kind(trace: Path, d: DaemonProcess, job: str) -> collections.Counter[str]:
    gen_dir = str(d.dest / job / f"{1:020d}")
    shards_dir = str(d.staging / "shards")
    kinds: collections.Counter[str] = collections.Counter()
    lines = [line for part in trace.parent.glob(trace.name + ".*")
             for line in part.read_text().splitlines()]
    assert lines, f"nothing traced into {trace}.*"
    for line in lines:
        m = _FSYNC.search(line)
        if m is None:
            continue
        path = m.group(1)
        if path.startswith(gen_dir + "/r"):
            kinds["dest dir" if Path(path).is_dir() else "dest file"] += 1
        elif path.startswith(shards_dir + "/"):
            kinds["staged file"] += 1
        elif path == shards_dir:
            kinds["staging dir"] += 1
        elif path.endswith("-wal"):
            kinds["journal"] += 1
        else:
            kinds["other"] += 1
    return kinds


def stop_traced(d: DaemonProcess, tracer: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the daemon itself (strace's child); strace exits with it."""
    children = Path(f"/proc/{tracer.pid}/task/{tracer.pid}/children").read_text().split()
    assert len(children) == 1, children
    os.kill(int(children[0]), signal.SIGTERM)
    assert tracer.wait(60) == 0, d.log()


def test_many_small_shards_share_fsyncs_journal_commits_and_thread_jobs(make_daemon,  # type: ignore[no-untyped-def]
                                                                       tmp_path: Path) -> None:
    data = blobs()
    d: DaemonProcess = make_daemon(start=False, **PAUSED)
    # The hand-offs, concurrent, with the drain held back.
    trace = tmp_path / "handoff.trace"
    tracer = traced_start(d, trace)
    hand_off(d, "small", data)
    stop_traced(d, tracer)
    handoff = fsyncs_by_kind(trace, d, "small")
    # Every staged file's bytes are fsynced before its acknowledgement, each on its own...
    assert handoff["staged file"] == N, handoff
    # ... but the directory and the journal once per batch of concurrent acknowledgements
    # (how many share one depends on timing: 8 clients each waiting for its own ack).
    assert handoff["staging dir"] < N and handoff["journal"] < N, handoff

    # The drain, from a restart that finds every shard staged: the queue holds them all.
    d.overrides.clear()
    trace = tmp_path / "drain.trace"
    tracer = traced_start(d, trace)
    with d.client(timeout_s=120) as c:
        c.wait("small", 1, timeout_s=120)
        url = c.status()["metrics"]
        status = c.status()
    # Counted per batch, not per shard: every byte still is.
    with urllib.request.urlopen(url, timeout=10) as r:
        exposition = r.read().decode()
    drained = [float(line.rsplit(" ", 1)[1]) for line in exposition.splitlines()
               if line.startswith("ckptdrain_drained_bytes_total{") and 'job="small"' in line]
    assert drained == [float(sum(map(len, data.values())))], drained
    assert status["drain_rate_bytes_per_s"] > 0, status
    stop_traced(d, tracer)
    drain = fsyncs_by_kind(trace, d, "small")
    # Each shard's bytes are fsynced at the destination before its name appears ...
    assert drain["dest file"] == N, drain
    # ... and the names a batch linked into one directory by one fsync of it: a thread job
    # per batch of shards, not per shard. A batch takes whole directories (8 rank
    # directories of 32 shards, batches of up to 64): one fsync each, not one per batch
    # that wrote into it (32 when a batch took the 64 interleaved shards behind its first).
    assert drain["dest dir"] <= RANKS + 2, drain
    # The drained rows are group-committed: not a WAL fsync per shard.
    assert drain["journal"] <= N // 4, drain
    gen_dir = d.dest / "small" / f"{1:020d}"
    manifest = Manifest.from_json((gen_dir / "MANIFEST.json").read_bytes())
    assert {s.path: s.checksum for s in manifest.shards} == {p: of_bytes(b) for p, b in data.items()}
    for path, payload in data.items():
        assert (gen_dir / path).read_bytes() == payload


def test_kill_9_in_the_middle_of_a_drain_batch_loses_no_acknowledged_shard(make_daemon) -> None:  # type: ignore[no-untyped-def]
    data = blobs()
    d: DaemonProcess = make_daemon(**PAUSED)
    hand_off(d, "killed", data)
    d.stop()
    gen_dir = d.dest / "killed" / f"{1:020d}"
    d.overrides.clear()
    d.start()
    # kill -9 the moment the first names appear: batches are being linked, fsynced, journalled.
    wait_for(lambda: gen_dir.is_dir() and any(gen_dir.glob("r*/s*.bin")), 60, 0.001)
    d.kill()
    assert not (gen_dir / "MANIFEST.json").exists()
    on_disk = len(list(gen_dir.glob("r*/s*.bin")))
    assert on_disk < N, "the drain was over before the kill: nothing was tested"
    d.start()
    with d.client(timeout_s=120) as c:
        c.wait("killed", 1, timeout_s=120)
    manifest = Manifest.from_json((gen_dir / "MANIFEST.json").read_bytes())
    assert {s.path: s.checksum for s in manifest.shards} == {p: of_bytes(b) for p, b in data.items()}
    for path, payload in data.items():
        assert (gen_dir / path).read_bytes() == payload
    assert not list(d.dest.rglob("*.ckptdrain-tmp")), "temp file left at the destination"


def test_a_batch_writes_each_shard_or_says_why_not(tmp_path: Path) -> None:
    """put_files: per shard its checksum, its own error, or None for a name already taken
    (left as it was, for put_file's collision handling); one shard's trouble is its own."""
    root = tmp_path / "dest"
    root.mkdir()
    backend = PosixBackend(DestinationConfig(uri=f"file://{root}"), "gpu1")
    sources = tmp_path / "src"
    sources.mkdir()
    payloads = [os.urandom(1000 + i) for i in range(5)]
    fds = []
    for i, p in enumerate(payloads):
        (sources / str(i)).write_bytes(p)
        fds.append(os.open(sources / str(i), os.O_RDONLY))
    (root / "j" / "a").mkdir(parents=True)
    (root / "j" / "a" / "taken.bin").write_bytes(b"someone else's")
    short = os.open(sources / "0", os.O_RDONLY)  # declared longer than it is

    async def run() -> list[str | BackendError | None]:
        try:
            return await backend.put_files([
                ("j/a/s0.bin", fds[0], 1000), ("j/a/taken.bin", fds[1], 1001),
                ("j/b/s2.bin", fds[2], 1002), ("j/a/short.bin", short, 5000),
                ("j/b/s4.bin", fds[4], 1004)])
        finally:
            await backend.aclose()

    try:
        out = asyncio.run(run())
    finally:
        for fd in (*fds, short):
            os.close(fd)
    assert out[0] == of_bytes(payloads[0]) and out[2] == of_bytes(payloads[2])
    assert out[4] == of_bytes(payloads[4])
    assert out[1] is None
    assert isinstance(out[3], BackendError) and out[3].kind == "integrity", out[3]
    assert (root / "j" / "a" / "taken.bin").read_bytes() == b"someone else's"
    assert not (root / "j" / "a" / "short.bin").exists()
    for i in (0, 2, 4):
        assert (root / "j" / ("a" if i == 0 else "b") / f"s{i}.bin").read_bytes() == payloads[i]
    assert not list(root.rglob("*.ckptdrain-tmp")), "a temp file was left behind"


@pytest.fixture(autouse=True)
def _strace_needed() -> None:
    if subprocess.run(["strace", "-V"], capture_output=True).returncode != 0:
        pytest.fail("strace is required (make system-deps)")
