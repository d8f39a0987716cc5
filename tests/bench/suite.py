"""The benchmark suite: the registry of benchmarks and the context each one runs in.

The context owns every resource a benchmark makes (directories, daemons, the SeaweedFS
server) through one ExitStack: each is registered for cleanup where it is created, so an
interrupted or failed benchmark leaves no process and no directory behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tests.bench.processes import BenchDaemon
from tests.bench.report import GiB, Section

if TYPE_CHECKING:
    from tests.integration.seaweedfs import SeaweedFS

# Room kept free on any filesystem a benchmark writes to, beyond what it plans to write.
FREE_MARGIN_BYTES = 2 * GiB


@dataclass
class Context:
    quick: bool
    runs_override: int | None
    work: Path                    # on the disk that stages shards ("the same disk")
    shm: Path | None              # a directory on /dev/shm, when there is one
    stack: contextlib.ExitStack
    say: Callable[[str], None]
    # --versus: another ckptdrain tree the benchmarks that can also run side by side.
    versus: Path | None = None
    _seaweed: SeaweedFS | None = None
    _sockets: Path | None = None
    _counter: int = 0
    aws_env: dict[str, str] = field(default_factory=dict)

    def runs(self, full: int, quick: int = 1) -> int:
        """How many times to repeat a measurement: ``--runs`` wins, then the mode's default."""
        if self.runs_override is not None:
            return self.runs_override
        return quick if self.quick else full

    def pick(self, full: int, quick: int) -> int:
        return quick if self.quick else full

    def fresh(self, name: str, *, shm: bool = False) -> Path:
        """A new empty directory on the work disk (or on /dev/shm when ``shm`` and there is one)."""
        self._counter += 1
        base = self.shm if shm and self.shm is not None else self.work
        path = base / f"{self._counter:03d}-{name}"
        path.mkdir(parents=True)
        self.stack.callback(shutil.rmtree, path, True)
        return path

    def socket_path(self, name: str) -> Path:
        """A short path for a Unix socket (sun_path holds 108 bytes; the work dir may be long)."""
        if self._sockets is None:
            self._sockets = Path(tempfile.mkdtemp(prefix="ckb-", dir="/tmp"))
            self.stack.callback(shutil.rmtree, self._sockets, True)
        self._counter += 1
        return self._sockets / f"{self._counter}-{name}.sock"

    def daemon(self, name: str, dest_uri: str, *, staging_dir: Path | None = None,
               root: Path | None = None, socket_path: Path | None = None, start: bool = True,
               overrides: Mapping[str, str] | None = None,
               code: Path | None = None) -> BenchDaemon:
        """A ``ckptdrain serve`` (started unless ``start=False``), killed when the benchmark
        ends; ``overrides`` are ``CKPTDRAIN_*`` settings; ``code`` another ckptdrain tree to
        run instead of this checkout (--versus)."""
        d = BenchDaemon(root=root or self.fresh(f"{name}-root"),
                        socket_path=socket_path or self.socket_path(name), dest_uri=dest_uri,
                        staging_dir=staging_dir, overrides=dict(overrides or {}),
                        extra_env=self.aws_env, code=code)
        self.stack.callback(d.kill)
        return d.start() if start else d

    def seaweed(self) -> SeaweedFS:
        """One SeaweedFS S3 server for the suite, started on first use."""
        if self._seaweed is None:
            from tests.integration.seaweedfs import ACCESS_KEY, REGION, SECRET_KEY, SeaweedFS

            self.say("starting SeaweedFS")
            aws_home = self.fresh("aws")
            self.aws_env.update({
                "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true",
                # Hermetic: a developer's ~/.aws plays no part.
                "AWS_CONFIG_FILE": str(aws_home / "config"),
                "AWS_SHARED_CREDENTIALS_FILE": str(aws_home / "credentials"),
            })
            # Room for the whole suite: a deleted object frees no volume space until a vacuum,
            # and the peak-RSS row alone writes 16 GiB (64 volumes of 256 MiB filled up).
            server = SeaweedFS(volume_max=192)
            self.stack.callback(server.stop)
            server.start()
            self._seaweed = server
        return self._seaweed

    def env_with_aws(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("AWS_", "CKPTDRAIN_"))}
        env.update(self.aws_env)
        return env


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@dataclass(frozen=True)
class Benchmark:
    name: str
    title: str
    what: str
    run: Callable[[Context, Section], None]


def registry() -> dict[str, Benchmark]:
    """Every benchmark, in the order a full run takes them (cheapest and S3-free first)."""
    from tests.bench import (
        dcpbench,
        drain,
        footprint,
        handoff,
        hostile,
        restore,
        scaling,
        smallshards,
        throughput,
    )

    benches = [
        handoff.HANDOFF, handoff.MEMORY, throughput.SOCKET, scaling.RANKS, smallshards.SMALL,
        smallshards.COMMIT,
        footprint.RSS, drain.POSIX, drain.S3, scaling.BUSY, restore.RESTORE, hostile.HOSTILE,
        dcpbench.DCP,
    ]
    return {b.name: b for b in benches}


@contextlib.contextmanager
def workdir(base: Path | None) -> Iterator[Path]:
    """A fresh work directory under ``base`` (default: the system temp dir), removed afterwards."""
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="ckptdrain-bench-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def shm_dir() -> Iterator[Path | None]:
    if not Path("/dev/shm").is_dir() or not os.access("/dev/shm", os.W_OK):
        yield None
        return
    path = Path(tempfile.mkdtemp(prefix="ckptdrain-bench-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
