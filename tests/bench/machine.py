"""A description of the machine and the run, for the report (what the figures were measured on)."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import sys
from pathlib import Path


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


def _mem_total_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return 0.0


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
        f"CPU: {cpus} cores usable, {_cpu_model()}; RAM {_mem_total_gib():.0f} GiB; "
        f"load average at start {load} (a shared machine: other work may run meanwhile)",
        f"Kernel {platform.release()}; Python {sys.version.split()[0]}",
        f"Staging disk (work directory): {filesystem_of(work)}",
        f"RAM filesystem: {filesystem_of(shm) if shm else 'none (no writable /dev/shm)'}",
        f"Baselines: {_first_line(['cp', '--version'])}; "
        f"s5cmd {_first_line(['s5cmd', 'version'])}; "
        f"SeaweedFS {_first_line([str(Path(sys.executable).with_name('weed')), 'version'])}",
    ]
    return lines
