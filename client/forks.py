"""What a process forked from a training process (a DataLoader worker, a multiprocessing
child) must let go of: its copies of the parent's conversations with the daemon.

A child shares every descriptor its parent had at the fork. Kept, a pooled connection was read
by both processes (each got the other's replies), a pooled memfd was filled by both (a
committed shard held the other's bytes), and a copy of a generation's socket or of a hand-off
pipe's write end hid the parent's death from the daemon, which then kept a killed trainer's
rank open for as long as the child lived (all found attacking from the training side).

Every object that owns such descriptors registers here when it creates them, inside
:func:`creating`, which a fork waits for: so no fork falls between a descriptor's creation
and its owner's registration. Right after a fork the child (one thread then) calls each
live owner's ``_forget_in_child``, which closes the child's copies only: the parent's stay
open and in use.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Protocol


class Inherited(Protocol):
    def _forget_in_child(self) -> None:
        """In a child just forked: close this process's copies; never touch the parent's."""


_owners: weakref.WeakSet[Inherited] = weakref.WeakSet()
# Re-entrant: a signal handler that saves (a new connection, a pipe) or forks while its
# thread is inside creating() would otherwise wait on itself for good (found attacking).
_lock = threading.RLock()


@contextlib.contextmanager
def creating() -> Iterator[None]:
    """Around creating descriptors and registering their owner: a fork waits for both."""
    with _lock:
        yield


def register(owner: Inherited) -> None:
    """``owner`` lets go of its descriptors in a child forked from now on (call it inside
    :func:`creating`, with the descriptors' creation)."""
    _owners.add(owner)


def _before() -> None:
    _lock.acquire()


def _after_in_parent() -> None:
    _lock.release()


def _after_in_child() -> None:
    global _lock
    _lock = threading.RLock()  # the parent's is held (by _before), and stays so here
    for owner in list(_owners):
        owner._forget_in_child()


os.register_at_fork(before=_before, after_in_parent=_after_in_parent,
                    after_in_child=_after_in_child)
