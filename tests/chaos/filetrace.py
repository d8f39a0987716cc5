"""Every path a daemon creates, writes, renames, links or removes, read from strace.

The fuzzer runs one daemon under ``strace -f -y`` tracing the file-modifying calls and then
checks that every path they touched lies under the directories the daemon may write (staging,
the destination, its socket's directory): a hostile request must never make a root daemon
write anywhere else, whatever links or names it plants.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tests.chaos.killer import STRACE

# The calls that create, change or remove a name or a file's bytes (open only with a write
# flag: reading is not writing).
CALLS = ("open", "openat", "creat", "mkdir", "mkdirat", "rename", "renameat", "renameat2",
         "link", "linkat", "symlink", "symlinkat", "unlink", "unlinkat", "truncate",
         "fchmodat", "fchownat")
_LINE = re.compile(r"^(?:\d+\s+)?(\w+)\((.*)\)\s+=\s+(-?\d+)")
# An argument: "string" or <fd></annotated/path> or AT_FDCWD</cwd>.
_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"|(?:\d+|AT_FDCWD)<([^>]*)>|([^,\s][^,]*)')
_WRITE_FLAGS = ("O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC")


@dataclass(frozen=True)
class FileTrace:
    """An Injection-shaped wrapper (ChaosDaemon calls ``argv``) that only traces."""

    def describe(self) -> str:
        return "file-modifying syscalls traced"

    def argv(self, log_path: Path) -> list[str]:
        if STRACE is None:
            raise RuntimeError("strace is not installed: run `make system-deps`")
        return [STRACE, "-f", "-qq", "-y", "--seccomp-bpf", "-s", "4096", "-o", str(log_path),
                "-e", f"trace={','.join(CALLS)}", "--"]


def _args(text: str) -> list[tuple[str, str]]:
    """(kind, value): ("str", a path string), ("fd", the path an fd names), ("raw", other)."""
    out = []
    for m in _ARG.finditer(text):
        if m.group(1) is not None:
            out.append(("str", m.group(1)))
        elif m.group(2) is not None:
            out.append(("fd", m.group(2)))
        elif m.group(3).strip():
            out.append(("raw", m.group(3).strip()))
    return out


def _join(base: str | None, name: str) -> str:
    return name if name.startswith("/") or base is None else f"{base.rstrip('/')}/{name}"


def written_paths(log: Path) -> list[str]:
    """Every path a successful file-modifying call in ``log`` touched."""
    found: list[str] = []
    for line in log.read_text(errors="replace").splitlines():
        m = _LINE.match(line)
        if m is None or int(m.group(3)) < 0:
            continue
        call, args = m.group(1), _args(m.group(2))
        strings = [v for k, v in args if k == "str"]
        dirs = [v for k, v in args if k == "fd"]
        if call in ("open", "creat", "openat"):
            if call != "creat" and not any(f in m.group(2) for f in _WRITE_FLAGS):
                continue
            if strings:
                found.append(_join(dirs[0] if dirs else None, strings[0]))
        elif call in ("mkdir", "unlink", "truncate", "rename", "link", "symlink"):
            found.extend(strings[1:] if call == "symlink" else strings)
        elif call in ("mkdirat", "unlinkat", "fchmodat", "fchownat"):
            if strings:
                found.append(_join(dirs[0] if dirs else None, strings[0]))
        elif call in ("renameat", "renameat2", "linkat"):
            for i, name in enumerate(strings[:2]):
                found.append(_join(dirs[i] if i < len(dirs) else None, name))
        elif call == "symlinkat" and len(strings) == 2:
            found.append(_join(dirs[0] if dirs else None, strings[1]))
    return found


def outside(paths: list[str], allowed: list[Path]) -> list[str]:
    """The paths not under any of ``allowed`` (resolved: the trace shows real paths)."""
    roots = [str(a.resolve()).rstrip("/") + "/" for a in allowed]
    return sorted({p for p in paths if not any((p.rstrip("/") + "/").startswith(r)
                                               for r in roots)})
