"""A process's file descriptor table filled up (EMFILE), for the tests of what the client does
when it cannot open one more: they run as subprocesses (``python -c``) that import this."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def fd_table_full(free: int = 0) -> Iterator[None]:
    """This process's fd table full but for ``free`` descriptors, for the block's length.
    Lower RLIMIT_NOFILE first: filled up to the usual limits, it takes a while."""
    held: list[int] = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    for _ in range(min(free, len(held))):
        os.close(held.pop())
    try:
        yield
    finally:
        for fd in held:
            os.close(fd)
