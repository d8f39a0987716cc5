"""Loaded by the daemons the benchmarks start (their PYTHONPATH names this directory): every
Python thread gets its name in the kernel too (``/proc/<pid>/task/<tid>/comm``, 15 bytes), so
the harness can read the daemon's CPU by thread: ``journal_0``, ``posix-dest_3``,
``asyncio_1`` (the default executor) besides the data plane's own ``ckptdrain-io_*`` and
``ckptdrain-pump_*`` (which the daemon names itself). Measurement only: nothing else changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Any

_PR_SET_NAME = 15

_prctl: Any
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _prctl = None

if _prctl is not None:
    _bootstrap_inner = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def _named_bootstrap(self: threading.Thread) -> None:
        with contextlib.suppress(Exception):  # a name is a nicety, never a failure
            _prctl(_PR_SET_NAME, ctypes.c_char_p(self.name.encode()[:15]), 0, 0, 0)
        _bootstrap_inner(self)

    threading.Thread._bootstrap_inner = _named_bootstrap  # type: ignore[attr-defined]
