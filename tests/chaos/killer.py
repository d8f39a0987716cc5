"""How a chaos trial hurts the daemon: ``kill -9``, and syscall faults injected with strace.

:class:`ChaosDaemon` is the shared fixture's :class:`DaemonProcess` that can run under a
wrapper (``strace -f ... -e inject=...``) and with a lowered ``RLIMIT_NOFILE``. Under strace
the process we start is strace itself; :attr:`ChaosDaemon.pid` is always the daemon's own pid
(strace's child), which is what we kill and what we read ``/proc`` for.

Two facts about ``strace -e inject`` that shape the specs below (measured with strace 6.1):

- ``when=N`` counts per traced *thread*, not per process: every thread's N-th matching call
  is tampered with. The daemon runs its disk work in thread pools, so "the 5th fsync" means
  "the 5th fsync of any worker thread". Seeds still reproduce the spec exactly; which file
  the fault lands on can vary with scheduling, and the strace log says which one it was.
- ``-P PATH`` matches a syscall whose *first* path argument (or an fd argument) is PATH, not
  the target of a rename, comparing the path argument as the string passed. The POSIX
  destination reaches every path one component at a time from a directory fd
  (``openat(dir_fd, "LATEST")``, ``mkdirat(dir_fd, "_parts")``), so a targeted fault names
  that component (``-P LATEST``) or a directory whose fd a call takes (``fsync`` of
  ``_parts/``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import resource
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ckptdrain.client import Client, DaemonUnavailable, Timeout
from tests.conftest import CKPTDRAIN, DaemonProcess

STRACE = shutil.which("strace")
_setpriv = shutil.which("setpriv")
SETPRIV = [_setpriv, "--pdeathsig", "KILL"] if _setpriv else []

# Syscalls a kill or an errno is injected at (those the daemon makes, by strace -c), with the
# errnos each can really return. (rename/link EXDEV: a staging dir or destination that
# straddles mounts; ENOSPC from fsync: a thin-provisioned or network disk failing writeback;
# accept4 EMFILE: the fd table is full. Not write: most of the daemon's writes go to its
# event loop's eventfd and to sockets, where an EIO is impossible and libuv rightly aborts.)
# The *at calls are the POSIX destination's (it reaches every path from a directory fd);
# the plain ones, staging's.
KILL_SYSCALLS = ("fsync", "fdatasync", "rename", "renameat", "openat", "write", "pwrite64",
                 "unlink", "unlinkat", "link", "linkat", "copy_file_range", "splice", "mkdir",
                 "mkdirat", "preadv2", "recvmsg", "sendto", "accept4", "getdents64", "statfs")
ERRNO_SYSCALLS = {
    "fsync": ("EIO", "ENOSPC"),
    "fdatasync": ("EIO", "ENOSPC"),
    "rename": ("EIO", "EXDEV", "ENOSPC"),
    "renameat": ("EIO", "EXDEV", "ENOSPC"),
    "openat": ("EIO", "ENOSPC", "EMFILE"),
    "pwrite64": ("EIO", "ENOSPC"),
    "link": ("EIO", "EXDEV", "ENOSPC"),
    "linkat": ("EIO", "EXDEV", "ENOSPC"),
    "mkdir": ("EIO", "ENOSPC"),
    "mkdirat": ("EIO", "ENOSPC"),
    "unlink": ("EIO",),
    "unlinkat": ("EIO",),
    "preadv2": ("EIO",),
    "copy_file_range": ("EIO", "EXDEV", "ENOSPC"),
    "splice": ("EIO", "ENOSPC"),
    "accept4": ("EMFILE", "ENFILE"),
    "getdents64": ("EIO",),
}
# Per-thread call counts (see above) are small: most threads make a handful of each call.
WHEN_CHOICES = (1, 1, 2, 2, 3, 4, 6, 9)


@dataclass(frozen=True)
class Injection:
    """One strace tampering: ``syscall`` gets ``errno`` (or ``signal``) at its ``when``-th call
    in each thread (``persistent``: from then on); ``paths`` narrows it to those files;
    ``delay_exit_us`` only slows the call down (after it took effect), ``delay_enter_us``
    before it does."""

    syscall: str
    when: int = 1
    errno: str | None = None
    signal: str | None = None
    persistent: bool = False
    paths: tuple[str, ...] = ()
    delay_exit_us: int = 0
    delay_enter_us: int = 0

    def describe(self) -> str:
        what = (self.errno or self.signal
                or (f"delay {self.delay_enter_us} us before" if self.delay_enter_us else "")
                or f"delay {self.delay_exit_us} us")
        where = f" on {list(self.paths)}" if self.paths else ""
        return f"{self.syscall} #{self.when}{'+' if self.persistent else ''} -> {what}{where}"

    def argv(self, log_path: Path) -> list[str]:
        if STRACE is None:
            raise RuntimeError("strace is not installed: run `make system-deps` (apt-get install strace)")
        when = f"{self.when}+" if self.persistent else str(self.when)
        if self.errno:
            action = f"error={self.errno}"
        elif self.signal:
            action = f"signal={self.signal}"
        elif self.delay_enter_us:
            action = f"delay_enter={self.delay_enter_us}"
        else:
            action = f"delay_exit={self.delay_exit_us}"
        argv = [STRACE, "-f", "-qq", "-y", "--seccomp-bpf", "-o", str(log_path),
                "-e", f"trace={self.syscall}",
                "-e", f"inject={self.syscall}:{action}:when={when}"]
        for p in self.paths:
            argv += ["-P", p]
        return [*argv, "--"]


def random_injection(rng: random.Random) -> Injection:
    """A seeded syscall fault: a kill at a syscall, or an errno (once or from then on)."""
    if rng.random() < 0.5:
        return Injection(rng.choice(KILL_SYSCALLS), when=rng.choice(WHEN_CHOICES), signal="SIGKILL")
    syscall = rng.choice(sorted(ERRNO_SYSCALLS))
    return Injection(syscall, when=rng.choice(WHEN_CHOICES),
                     errno=rng.choice(ERRNO_SYSCALLS[syscall]), persistent=rng.random() < 0.3)


@dataclass
class ChaosDaemon(DaemonProcess):
    """A daemon that may run under strace and with a small fd limit."""

    injection: Injection | None = None
    nofile: int | None = None
    strace_logs: list[Path] = field(default_factory=list)
    _daemon_pid: int | None = None
    _wrapped: bool = False

    def _preexec(self) -> None:
        # Runs in the child before exec. If pytest dies without cleanup, the kernel kills the
        # child (daemon or strace) too; under strace, setpriv does the same for the daemon.
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if self.nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def start(self, timeout_s: float = 30.0) -> ChaosDaemon:
        """As DaemonProcess.start (same readiness check), with the wrapper and rlimit."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.root.mkdir(parents=True, exist_ok=True)
        stamp = time.monotonic_ns()
        self.log_path = self.root / f"daemon-{stamp}.log"
        argv = [CKPTDRAIN, "serve"]
        if self.injection is not None:
            trace = self.root / f"strace-{stamp}.log"
            self.strace_logs.append(trace)
            argv = self.injection.argv(trace) + SETPRIV + argv
        self._daemon_pid = None
        self._wrapped = self.injection is not None
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=self._preexec)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.log()}")
            try:
                with Client(self.socket_path, timeout_s=5, connect_timeout_s=5) as c:
                    c.status()
                return self
            except (DaemonUnavailable, Timeout):
                pass  # not listening yet, or (an injected accept fault) not accepting yet
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"daemon did not come up:\n{self.log()}")
            time.sleep(0.02)

    @property
    def pid(self) -> int:
        """The daemon's pid (under strace: strace's only child)."""
        assert self.proc is not None
        if not self._wrapped:
            return self.proc.pid
        if self._daemon_pid is None:
            deadline = time.monotonic() + 10
            while self._daemon_pid is None:
                with contextlib.suppress(OSError, ValueError):
                    children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
                    if children.split():
                        self._daemon_pid = int(children.split()[0])
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("strace started no daemon")
                time.sleep(0.01)
        return self._daemon_pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM to the daemon itself (strace would only detach), SIGKILL after the timeout."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        with contextlib.suppress(ProcessLookupError, RuntimeError):
            os.kill(self.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"daemon ignored SIGTERM for {timeout_s} s:\n{self.log()}") from None

    def kill(self) -> None:
        """kill -9 of the daemon itself; strace (if any) exits with its tracee."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, RuntimeError):
            os.kill(self.pid, signal.SIGKILL)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:  # strace stuck: it is ours, kill it by its pid too
            self.proc.kill()
            self.proc.wait(10)

    def died_by(self) -> str:
        """How the last run ended, for reports: 'running', 'exit N' or 'signal N'."""
        if self.proc is None or self.proc.poll() is None:
            return "running"
        rc = self.proc.returncode
        return f"signal {-rc}" if rc < 0 else f"exit {rc}"

    def injected(self) -> list[str]:
        """The syscalls strace tampered with in this daemon's runs (its own log lines)."""
        lines: list[str] = []
        for path in self.strace_logs:
            with contextlib.suppress(OSError):
                lines += [ln for ln in path.read_text(errors="replace").splitlines()
                          if "INJECTED" in ln or "DELAYED" in ln or "killed by" in ln]
        return lines

    def tampered_with(self) -> set[str]:
        """Which of the daemon's files the injected errnos hit: "journal" (its SQLite files),
        "staging" (shard files), "destination", "impossible" (an EIO on an eventfd, socket or
        pipe: no kernel returns that, and libuv rightly aborts), or "other" (logs, libraries)."""
        kinds = set()
        for line in self.injected():
            if "INJECTED" not in line:
                continue
            if "journal.sqlite3" in line:
                kinds.add("journal")
            elif str(self.staging) in line:
                kinds.add("staging")
            elif self.dest_uri.startswith("file://") and str(self.dest) in line:
                kinds.add("destination")
            elif (any(t in line for t in ("<anon_inode:", "<socket:", "<pipe:", "<UNIX"))
                  and any(e in line for e in (" EIO ", " ENOSPC ", " EXDEV "))):
                kinds.add("impossible")
            else:
                kinds.add("other")
        return kinds

    def log_excerpt(self, n_chars: int = 4000) -> str:
        """The tail of every log this daemon wrote (all restarts), tracebacks included."""
        parts = []
        for path in sorted(self.root.glob("daemon-*.log")):
            text = path.read_text(errors="replace")
            parts.append(f"--- {path.name} ---\n{text[-n_chars:]}")
        return "\n".join(parts)


class Killer:
    """Kills a daemon once: when ``trigger()`` is called (the workload's N-th acknowledged
    put), after ``after_s`` seconds, or at the latest when ``finish()`` says the workload is
    done. Kills happen on this object's thread, never in a client thread mid-call."""

    def __init__(self, daemon: ChaosDaemon, *, after_s: float | None = None,
                 restart: bool = False) -> None:
        """``restart``: the target is the next start of ``daemon`` (kill during recovery)."""
        self.daemon = daemon
        self._old_proc = daemon.proc if restart else object()
        self.after_s = after_s
        self.killed = threading.Event()
        self._go = threading.Event()
        self.reason = ""
        self.was_alive = False  # whether our kill found it running (else it died before)
        self._thread = threading.Thread(target=self._run, name="killer", daemon=True)

    def start(self) -> Killer:
        self._thread.start()
        return self

    def _run(self) -> None:
        # Waiting on an Event with a timeout: the kill moment, not an assertion.
        fired = self._go.wait(self.after_s)
        if not self.reason:
            self.reason = "timer" if not fired else "trigger"
        # A kill aimed at a restart may fire before its Popen: wait for the new process.
        deadline = time.monotonic() + 10
        while self.daemon.proc is self._old_proc and time.monotonic() < deadline:
            time.sleep(0.005)
        self.was_alive = self.daemon.alive()
        self.daemon.kill()
        self.killed.set()

    def trigger(self, reason: str = "trigger") -> None:
        if not self._go.is_set():
            self.reason = self.reason or reason
            self._go.set()

    def finish(self) -> None:
        """The workload ended: kill now if nothing did yet, and wait for the kill."""
        self.trigger("end of workload")
        self._thread.join(30)


def on_ack_kill(killer: Killer, n_acks: int) -> Callable[[int], None]:
    """A callback for the workload: kill at the ``n_acks``-th acknowledged put."""

    def seen(total: int) -> None:
        if total >= n_acks:
            killer.trigger(f"ack #{n_acks}")

    return seen
