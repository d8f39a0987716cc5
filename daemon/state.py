"""Shard, rank and generation lifecycles: one transition table, pure.

Every state change in the daemon goes through :func:`advance`, so an illegal move (draining a
shard that was never staged, committing a failed generation) raises instead of corrupting the
journal.
"""

from __future__ import annotations

import enum
from typing import TypeVar


class ShardState(enum.StrEnum):
    HELD = "held"  # ack=memory: acknowledged, in a memfd the daemon holds, not yet on NVMe
    STAGED = "staged"  # fsynced in staging and journalled: acknowledged to the client
    DRAINING = "draining"  # being copied to the destination
    DRAINED = "drained"  # at the destination, checksum known
    FAILED = "failed"  # retry budget spent; the local copy is kept for `ckptdrain retry`
    DISCARDED = "discarded"  # generation cancelled or aborted; staging freed


class RankState(enum.StrEnum):
    OPEN = "open"  # a client is handing off this rank's shards
    SEALED = "sealed"  # the client finished the rank cleanly
    RECORDED = "recorded"  # this node's part record lists the rank
    ABORTED = "aborted"  # the client left with an exception, or disconnected before sealing


class GenerationState(enum.StrEnum):
    OPEN = "open"  # ranks still handing off or draining on this node
    RECORDED = "recorded"  # this node's part record is written; waiting for other nodes
    COMMITTED = "committed"  # MANIFEST.json exists at the destination
    FAILED = "failed"  # cannot commit from this node (aborted rank, drain failure, conflict)
    CANCELLED = "cancelled"  # superseded by a newer generation of the same job


class IllegalTransition(RuntimeError):
    """A lifecycle move the table does not allow: a bug, never a user error."""


_S, _R, _G = ShardState, RankState, GenerationState

TRANSITIONS: dict[type[enum.StrEnum], dict[enum.StrEnum, frozenset[enum.StrEnum]]] = {
    ShardState: {
        _S.HELD: frozenset({_S.STAGED, _S.DISCARDED}),
        _S.STAGED: frozenset({_S.DRAINING, _S.DISCARDED}),
        _S.DRAINING: frozenset({_S.DRAINED, _S.STAGED, _S.FAILED, _S.DISCARDED}),
        _S.DRAINED: frozenset({_S.DISCARDED}),
        _S.FAILED: frozenset({_S.STAGED, _S.DISCARDED}),
        _S.DISCARDED: frozenset(),
    },
    RankState: {
        _R.OPEN: frozenset({_R.SEALED, _R.ABORTED}),
        _R.SEALED: frozenset({_R.RECORDED, _R.ABORTED}),
        _R.RECORDED: frozenset(),
        _R.ABORTED: frozenset(),
    },
    GenerationState: {
        # RECORDED -> OPEN: another rank of the same generation began on this node after the
        # part record was written; the record is rewritten when that rank drains.
        _G.OPEN: frozenset({_G.RECORDED, _G.COMMITTED, _G.FAILED, _G.CANCELLED}),
        _G.RECORDED: frozenset({_G.OPEN, _G.COMMITTED, _G.FAILED, _G.CANCELLED}),
        _G.COMMITTED: frozenset(),
        # An operator's `ckptdrain retry` reopens a failed generation.
        _G.FAILED: frozenset({_G.OPEN}),
        _G.CANCELLED: frozenset(),
    },
}


def allowed(current: enum.StrEnum, new: enum.StrEnum) -> bool:
    table = TRANSITIONS[type(current)]
    return type(new) is type(current) and new in table[current]


S = TypeVar("S", bound=enum.StrEnum)


def advance(current: S, new: S) -> S:
    """``new`` if the table allows ``current -> new``; raises :class:`IllegalTransition`."""
    if not allowed(current, new):
        raise IllegalTransition(f"{type(current).__name__}: {current} -> {new} is not allowed")
    return new


TERMINAL_GENERATION = frozenset({_G.COMMITTED, _G.CANCELLED})
UNDRAINED_SHARD = frozenset({_S.HELD, _S.STAGED, _S.DRAINING, _S.FAILED})
