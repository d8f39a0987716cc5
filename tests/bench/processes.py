"""The processes a benchmark runs and what it reads about them from /proc.

:class:`BenchDaemon` is one real ``ckptdrain serve`` configured through environment overrides
(as the functional tests do), stopped by PID: SIGTERM, then SIGKILL after a timeout.
:func:`run_timed` runs a baseline command and returns its wall time and its own CPU time
(``wait4`` rusage of that one child, so daemons exiting meanwhile are not counted).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ckptdrain.client import Client, DaemonUnavailable

CKPTDRAIN = str(Path(sys.executable).with_name("ckptdrain"))
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_TS_RE = re.compile(r"^ts=(\S+)Z level=\S+ event=(\S+)")


class BenchError(RuntimeError):
    """A benchmark could not measure what it set out to (the message says what failed)."""


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (/proc/<pid>/stat utime + stime)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        # The command name may hold spaces and parentheses: split after the last ')'.
        fields = f.read().rpartition(b")")[2].split()
    # fields[0] is the state (field 3); utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def children(pid: int) -> list[int]:
    """Live child processes of ``pid`` (the daemon's S3 workers)."""
    found: list[int] = []
    try:
        tasks = list(os.scandir(f"/proc/{pid}/task"))
    except FileNotFoundError:
        return found
    for task in tasks:
        try:
            with open(f"{task.path}/children", "rb") as f:
                found.extend(int(c) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and its live children (the daemon and its S3 workers)."""
    total = cpu_seconds(pid)
    for child in children(pid):
        try:
            total += cpu_seconds(child)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def thread_times(pid: int) -> dict[tuple[int, int], float]:
    """CPU seconds so far of every thread of ``pid`` and of its children, by (pid, tid): the
    busiest thread over a span is the largest difference of two of these."""
    out: dict[tuple[int, int], float] = {}
    for proc in (pid, *children(pid)):
        try:
            tasks = list(os.scandir(f"/proc/{proc}/task"))
        except FileNotFoundError:
            continue
        for task in tasks:
            try:
                with open(f"{task.path}/stat", "rb") as f:
                    fields = f.read().rpartition(b")")[2].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            out[(proc, int(task.name))] = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    return out


def busiest_thread_s(before: dict[tuple[int, int], float],
                     after: dict[tuple[int, int], float]) -> float:
    return max((cpu - before.get(key, 0.0) for key, cpu in after.items()), default=0.0)


# The daemon's threads by kind: the event loop is the main thread (its tid is the pid); the
# data plane names its pool threads in the kernel (dataplane.name_os_thread, 15 bytes).
# The other threads are named in the kernel by tests/bench/threadnames/sitecustomize.py, which
# every daemon the benchmarks start loads (BenchDaemon.env).
THREAD_KINDS = ("loop", "pump", "io", "journal", "drain", "fetch", "other")
_THREAD_PREFIXES = ((b"ckptdrain-pump", "pump"), (b"ckptdrain-pipe", "pump"),
                    (b"ckptdrain-fetch", "fetch"),
                    (b"ckptdrain-io", "io"), (b"journal", "journal"),
                    (b"posix-segment", "drain"),
                    (b"posix-dest", "drain"), (b"asyncio", "drain"), (b"uvloop", "drain"))
THREAD_NAMES_DIR = Path(__file__).resolve().parent / "threadnames"


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of ``pid`` so far by kind of thread (/proc/<pid>/task/*/stat utime +
    stime): ``loop`` (the main thread: the event loop), ``pump`` (``ckptdrain-pump_*``:
    socket -> file; ``ckptdrain-pipe_*``: a client's pipe -> file),
    ``io`` (``ckptdrain-io_*``: copies, fsyncs), ``journal`` (SQLite's
    thread), ``drain`` (``posix-dest_*`` and the default executor's ``asyncio_*`` or
    ``uvloop_*``: reading and hashing staged shards), ``fetch`` (``ckptdrain-fetch``: the
    event loop reading the destination for clients' fetches; ``ckptdrain-fetch-w_*``: its
    writes into the readers' files), ``other`` (every other thread still
    alive), and ``all`` (the process total)."""
    out = dict.fromkeys(THREAD_KINDS, 0.0)
    try:
        tasks = list(os.scandir(f"/proc/{pid}/task"))
    except FileNotFoundError:
        raise BenchError(f"process {pid} is gone") from None
    for task in tasks:
        try:
            with open(f"{task.path}/stat", "rb") as f:
                raw = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile: counted in the process total below
        head, _, tail = raw.rpartition(b")")
        comm = head.partition(b"(")[2]
        fields = tail.split()
        cpu = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
        if int(task.name) == pid:
            out["loop"] += cpu
            continue
        out[next((kind for prefix, kind in _THREAD_PREFIXES if comm.startswith(prefix)),
                 "other")] += cpu
    # The process total also counts threads already gone, and is rounded per process, not
    # per thread: it may differ from the sum above by a few clock ticks.
    out["all"] = cpu_seconds(pid)
    return out


def code_path(code: Path | None) -> list[str]:
    """PYTHONPATH entries that make a child import ckptdrain from ``code`` (a tree holding
    ``ckptdrain/client`` and ``ckptdrain/daemon``, as ``git archive`` writes them) ahead of
    this checkout's editable install; none for this checkout."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return ([str(code)] if code is not None else []) + inherited


def thread_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def status_bytes(pid: int, key: str) -> int:
    """A ``kB`` line of /proc/<pid>/status (``VmHWM``, ``VmRSS``) in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise BenchError(f"/proc/{pid}/status has no {key} line")


def tree_peak_rss(pid: int) -> int:
    """Peak RSS (VmHWM) of ``pid`` plus that of each live child: an upper bound on the peak of
    the daemon and its S3 workers together (their peaks need not coincide)."""
    total = status_bytes(pid, "VmHWM")
    for child in children(pid):
        try:
            total += status_bytes(child, "VmHWM")
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


@dataclass
class BenchDaemon:
    """One ``ckptdrain serve`` for a benchmark; ``overrides`` are ``CKPTDRAIN_*`` variables."""

    root: Path
    socket_path: Path
    dest_uri: str
    staging_dir: Path | None = None
    overrides: Mapping[str, str] = field(default_factory=dict)
    extra_env: Mapping[str, str] = field(default_factory=dict)
    # Another ckptdrain tree to run (``DIR/ckptdrain/{client,daemon}``), for --versus.
    code: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def staging(self) -> Path:
        return self.staging_dir or self.root / "staging"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTDRAIN_")}
        env.update(self.extra_env)
        env.update({
            "CKPTDRAIN_NODE_ID": "bench-node",
            "CKPTDRAIN_SOCKET": str(self.socket_path),
            "CKPTDRAIN_STAGING_DIR": str(self.staging),
            "CKPTDRAIN_DESTINATION__URI": self.dest_uri,
            # No metrics listener: nothing a benchmark measures needs it.
            "CKPTDRAIN_METRICS__LISTEN": "",
            "CKPTDRAIN_DRAIN__COMMIT_POLL_INTERVAL_S": "0.2",
            "CKPTDRAIN_LOG_LEVEL": "info",
            # Benchmarks commit many generations: no retention deletes racing the next run,
            # and no local copies filling the staging disk.
            "CKPTDRAIN_RETENTION__KEEP_LAST": "1000",
            "CKPTDRAIN_RETENTION__KEEP_LOCAL_COPY": "false",
            "XDG_STATE_HOME": str(self.root / "xdg"),
            # Kernel names for every thread, so thread_cpu can tell them apart.
            "PYTHONPATH": os.pathsep.join([str(THREAD_NAMES_DIR), *code_path(self.code)]),
        })
        env.update(self.overrides)
        return env

    def start(self, timeout_s: float = 60.0, *, wait_ready: bool = True) -> BenchDaemon:
        if self.proc is not None and self.proc.poll() is None:
            raise BenchError("this daemon is already running")
        self.root.mkdir(parents=True, exist_ok=True)
        self.log_path = self.root / f"daemon-{time.monotonic_ns()}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([CKPTDRAIN, "serve"], env=self.env(), stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        if wait_ready:
            self.wait_answering(timeout_s)
        return self

    def wait_answering(self, timeout_s: float) -> None:
        """Until the daemon answers ``status`` on its socket."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"the daemon exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with Client(self.socket_path, timeout_s=10, connect_timeout_s=2) as c:
                    c.status()
                return
            except DaemonUnavailable:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise BenchError(f"the daemon did not answer within {timeout_s} s:\n{self.log_tail()}")
            time.sleep(0.02)

    def client(self, timeout_s: float = 600.0) -> Client:
        return Client(self.socket_path, timeout_s=timeout_s)

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise BenchError("the daemon was never started")
        return self.proc.pid

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def log_tail(self, n_chars: int = 4000) -> str:
        return self.log_text()[-n_chars:]

    def events(self, event: str) -> list[tuple[float, str]]:
        """(epoch seconds, the whole line) of every log line of ``event``, in order."""
        found = []
        for line in self.log_text().splitlines():
            m = _TS_RE.match(line)
            if m and m.group(2) == event:
                stamp = _dt.datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%f")
                found.append((stamp.replace(tzinfo=_dt.UTC).timestamp(), line))
        return found

    def event_time(self, event: str, *, last: bool = False) -> float | None:
        """Epoch seconds of the first (or last) log line of ``event``; None if not logged."""
        found = self.events(event)
        if not found:
            return None
        return found[-1 if last else 0][0]

    def wait_event(self, event: str, timeout_s: float, poll_s: float = 0.005) -> None:
        """Until ``event`` appears in the log (polled: the daemon flushes each line)."""
        assert self.proc is not None and self.log_path is not None
        needle = f" event={event}".encode()
        deadline = time.monotonic() + timeout_s
        offset = 0
        carry = b""
        with open(self.log_path, "rb") as f:
            while True:
                f.seek(offset)
                chunk = f.read()
                offset += len(chunk)
                text = carry + chunk
                if needle in text:
                    return
                carry = text[-len(needle):]
                if self.proc.poll() is not None:
                    raise BenchError(f"the daemon exited with {self.proc.returncode} before "
                                     f"{event}:\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise BenchError(f"no {event} from the daemon within {timeout_s} s:\n"
                                     f"{self.log_tail()}")
                time.sleep(poll_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM by PID, SIGKILL after ``timeout_s``."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            stacks = _stacks(proc.pid)
            self.kill()
            raise BenchError(f"the daemon ignored SIGTERM for {timeout_s} s:\n{self.log_tail()}"
                             f"\n{stacks}") from None

    def kill(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _stacks(pid: int) -> str:
    """Where a stuck daemon's threads are (py-spy, where installed), for the error message."""
    spy = shutil.which("py-spy")
    if spy is None:
        return "(install py-spy to see where it was stuck)"
    try:
        done = subprocess.run([spy, "dump", "--subprocesses", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(py-spy dump failed: {exc})"
    return done.stdout + done.stderr


@dataclass(frozen=True)
class Timed:
    wall_s: float
    cpu_s: float


def run_timed(argv: Sequence[str], *, timeout_s: float, env: Mapping[str, str] | None = None,
              cwd: Path | None = None) -> Timed:
    """Run ``argv``; its wall time and the CPU time of that process and its waited children.

    Fails with the command's output if it exits non-zero; killed (SIGKILL by PID) after
    ``timeout_s``.
    """
    with tempfile.TemporaryFile() as out:
        started = time.perf_counter()
        proc = subprocess.Popen(list(argv), env=dict(env) if env is not None else None, cwd=cwd,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        killer = threading.Timer(timeout_s, _kill_pid, (proc.pid,))
        killer.start()
        try:
            # wait4 reaps exactly this child and returns its own rusage (and its children's).
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            killer.cancel()
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        output = out.read().decode(errors="replace")
    if proc.returncode == -signal.SIGKILL:
        raise BenchError(f"{argv[0]} did not finish within {timeout_s} s: {output[-2000:]}")
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(argv)} exited {proc.returncode}: {output[-2000:]}")
    return Timed(wall, usage.ru_utime + usage.ru_stime)


def run_sampled(argv: Sequence[str], *, timeout_s: float,
                env: Mapping[str, str] | None = None) -> tuple[Timed, float]:
    """Run ``argv`` as :func:`run_timed` does; also the CPU seconds of its busiest thread, in
    it or in its children (``restore --readers``), sampled every 20 ms: a thread's last
    moments before it exits are not counted (under 20 ms of CPU each)."""
    with tempfile.TemporaryFile() as out:
        started = time.perf_counter()
        proc = subprocess.Popen(list(argv), env=dict(env) if env is not None else None,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        seen: dict[tuple[int, int], float] = {}
        deadline = started + timeout_s
        try:
            while proc.poll() is None:
                seen.update(thread_times(proc.pid))
                if time.perf_counter() > deadline:  # killed below
                    raise BenchError(f"{argv[0]} did not finish within {timeout_s} s")
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                _kill_pid(proc.pid)
                proc.wait()
        wall = time.perf_counter() - started
        out.seek(0)
        output = out.read().decode(errors="replace")
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(argv)} exited {proc.returncode}: {output[-2000:]}")
    # Total CPU as sampled (the same under-count): the process tree's threads together.
    return Timed(wall, sum(seen.values())), max(seen.values(), default=0.0)


def _kill_pid(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
