"""Shared fixtures: real daemons in real processes, on real sockets and temp directories."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ckptdrain.client import Client, DaemonUnavailable
from tests.integration.seaweedfs import ACCESS_KEY, REGION, SECRET_KEY, SeaweedFS, find_weed

CKPTDRAIN = str(Path(sys.executable).with_name("ckptdrain"))

# Client.generation() takes rank and world_size from torchrun's RANK / WORLD_SIZE and has no
# default of its own; a test that saves as one rank without naming it runs as a one-rank
# launcher would. Tests of the rule itself clear these with monkeypatch.
os.environ.setdefault("RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")


def wait_for(predicate: Callable[[], object], timeout_s: float = 30.0,
             interval_s: float = 0.02, *, what: str = "") -> None:
    """Poll ``predicate`` until it holds; fail once ``timeout_s`` is over (never a bare sleep),
    saying ``what`` was not reached."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not reached in {timeout_s:g} s: {what}" if what \
            else "condition not met in time"
        time.sleep(interval_s)


@dataclass
class DaemonProcess:
    """One ``ckptdrain serve`` process configured through environment overrides."""

    root: Path
    socket_path: Path
    node_id: str = "node-a"
    dest_uri: str = ""
    overrides: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def staging(self) -> Path:
        return self.root / "staging"

    @property
    def dest(self) -> Path:
        return Path(self.dest_uri.removeprefix("file://"))

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTDRAIN_")}
        env.update({
            "CKPTDRAIN_NODE_ID": self.node_id,
            "CKPTDRAIN_SOCKET": str(self.socket_path),
            "CKPTDRAIN_STAGING_DIR": str(self.staging),
            "CKPTDRAIN_DESTINATION__URI": self.dest_uri,
            "CKPTDRAIN_METRICS__LISTEN": "127.0.0.1:0",
            "CKPTDRAIN_DRAIN__COMMIT_POLL_INTERVAL_S": "0.2",
            "CKPTDRAIN_DRAIN__RETRY_INITIAL_BACKOFF_S": "0.05",
            "CKPTDRAIN_LOG_LEVEL": "debug",
            "XDG_STATE_HOME": str(self.root / "xdg"),
        })
        env.update(self.overrides)
        return env

    def start(self, timeout_s: float = 30.0) -> DaemonProcess:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.log_path = self.root / f"daemon-{time.monotonic_ns()}.log"
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen([CKPTDRAIN, "serve"], env=self.env(), stdout=log,
                                     stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.log()}")
            try:
                with Client(self.socket_path, timeout_s=5) as c:
                    c.status()
                return self
            except DaemonUnavailable:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"daemon did not come up:\n{self.log()}")
            time.sleep(0.05)

    def client(self, **kw: float) -> Client:
        return Client(self.socket_path, **kw)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after the timeout; returns the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"daemon ignored SIGTERM for {timeout_s} s:\n{self.log()}") from None

    def kill(self) -> None:
        """kill -9: no cleanup of any kind runs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short directory for Unix sockets (sun_path is limited to 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="ckd-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_daemon(tmp_path: Path, short_tmp: Path) -> Iterator[object]:
    """Factory: ``make_daemon(node_id="node-a", dest=None, **overrides)`` -> DaemonProcess (started).

    Daemons made by one test share one ``file://`` destination unless ``dest`` is given.
    """
    made: list[DaemonProcess] = []
    shared_dest = tmp_path / "dest"

    def factory(node_id: str = "node-a", dest: str | None = None, start: bool = True,
                **overrides: str) -> DaemonProcess:
        root = tmp_path / node_id
        root.mkdir(exist_ok=True)
        d = DaemonProcess(root=root, socket_path=short_tmp / f"{node_id}.sock", node_id=node_id,
                          dest_uri=dest or f"file://{shared_dest}", overrides=dict(overrides))
        made.append(d)
        return d.start() if start else d

    yield factory
    for d in made:
        with contextlib.suppress(AssertionError):
            d.stop(timeout_s=20)


@pytest.fixture
def daemon(make_daemon: object) -> DaemonProcess:
    return make_daemon()  # type: ignore[operator,no-any-return]


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    weed = find_weed()  # raises WeedNotFound: a failure with the fix in its message
    aws_home = tmp_path_factory.mktemp("aws")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        env.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        env.delenv("AWS_SESSION_TOKEN", raising=False)
        env.delenv("AWS_PROFILE", raising=False)
        env.setenv("AWS_DEFAULT_REGION", REGION)
        # Hermetic: a developer's ~/.aws and the instance metadata service play no part.
        env.setenv("AWS_CONFIG_FILE", str(aws_home / "config"))
        env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(aws_home / "credentials"))
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")
        server = SeaweedFS(weed=weed)
        server.start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB filesystem of its own (a staging disk that others can fill); root only."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)],
                         capture_output=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {out.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill_up(directory: Path) -> None:
    """Write ``directory/filler`` until its filesystem is full (ENOSPC)."""
    with open(directory / "filler", "wb") as filler, pytest.raises(OSError):
        while True:
            filler.write(b"\0" * (1 << 20))
            filler.flush()


def traced(pid: int) -> bool:
    """Whether every thread of ``pid`` has a tracer attached (strace -f -p attaches them all)."""
    def tracer(tid: str) -> int:
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
                if line.startswith("TracerPid:"):
                    return int(line.split()[1])
        return 1
    return all(tracer(t) for t in os.listdir(f"/proc/{pid}/task"))


@contextlib.contextmanager
def strace_attached(pid: int, *options: str, log: Path | None = None) -> Iterator[None]:
    """``strace -f -p pid`` with ``options`` (``-e inject=...``) for the block's duration,
    attached to a daemon already running, so its start-up's syscalls are not tampered with
    (a delay on every unlink cost a daemon's start 9 s), and detached at the end."""
    if shutil.which("strace") is None:
        pytest.fail("strace is required (make system-deps)")
    tracer = subprocess.Popen(
        ["strace", "-f", "-qq", "-o", str(log or "/dev/null"), "-p", str(pid), *options],
        stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: traced(pid))
        yield
    finally:
        tracer.terminate()
        tracer.wait(10)
    wait_for(lambda: not traced(pid))
