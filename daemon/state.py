"""Shard, rank and generation lifecycles: one transition table keyed by state and event, pure.

Callers say what happened (an event); the table says where that leads from where the record
is. A key the table lacks is a move the daemon must never make (draining a shard that was
never staged, committing a cancelled generation): :func:`transition` raises instead of letting
the journal record it. Where a record begins is not a transition: a shard is born HELD or
STAGED, a rank and a generation OPEN.
"""

from __future__ import annotations

import enum
from typing import Final, TypeAlias, overload

from ckptdrain.daemon.errors import DaemonError


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
    CANCELLED = "cancelled"  # superseded by a newer generation, or replaced by a new attempt


# Events are plain enums, not StrEnums: a StrEnum member equals (and hashes as) its string, so
# ("open", "recorded") would be one key for a rank and a generation alike, and a rank would
# silently take a generation's move. Events are never journalled; only states are.


class ShardEvent(enum.Enum):
    STAGED = enum.auto()  # an ack=memory shard's memfd was written to staging and journalled
    DRAIN_STARTED = enum.auto()  # a worker began copying it to the destination
    DRAINED = enum.auto()  # the destination holds it, checksum known
    DRAIN_GAVE_UP = enum.auto()  # its generation ended mid-copy: staged again, a retry sends it
    DRAIN_FAILED = enum.auto()  # a permanent error, or the retry budget is spent
    DISCARDED = enum.auto()  # its generation was aborted, cancelled or replaced
    RETRIED = enum.auto()  # `ckptdrain retry`: the kept local copy is queued again
    VANISHED = enum.auto()  # drained, then gone from the destination before the commit


class RankEvent(enum.Enum):
    SEALED = enum.auto()  # the client finished handing off the rank
    RECORDED = enum.auto()  # this node's part record now lists it
    ABORTED = enum.auto()  # the client failed or left before sealing, or the daemon restarted


class GenerationEvent(enum.Enum):
    RECORDED = enum.auto()  # every begun rank drained here and this node's part record is written
    REOPENED = enum.auto()  # another rank began on this node after the part record
    COMMITTED = enum.auto()  # the manifest is published (by this node or, matching, another)
    FAILED = enum.auto()  # cannot commit from here: a drain or commit failure, a conflict, a
    #                       rank of this node aborted, an ack=memory shard lost in a crash
    PEER_ABORTED = enum.auto()  # another node's part record says one of its ranks aborted
    EXPIRED = enum.auto()  # recorded, but not committed within drain.commit_wait_s
    CANCELLED = enum.auto()  # superseded by a newer step (on_full), or replaced by a new attempt
    SUPERSEDED_BY_COMMIT = enum.auto()  # a newer step of the job committed while it waited
    RETRIED = enum.auto()  # `ckptdrain retry` of a failed generation


State: TypeAlias = ShardState | RankState | GenerationState
Event: TypeAlias = ShardEvent | RankEvent | GenerationEvent


class IllegalTransition(DaemonError, RuntimeError):
    """A lifecycle move the table does not allow: a bug, never a user error."""


_S, _SE = ShardState, ShardEvent
_R, _RE = RankState, RankEvent
_G, _GE = GenerationState, GenerationEvent

TRANSITIONS: Final[dict[tuple[State, Event], State]] = {
    (_S.HELD, _SE.STAGED): _S.STAGED,
    (_S.HELD, _SE.DISCARDED): _S.DISCARDED,
    (_S.STAGED, _SE.DRAIN_STARTED): _S.DRAINING,
    (_S.STAGED, _SE.DISCARDED): _S.DISCARDED,
    (_S.DRAINING, _SE.DRAINED): _S.DRAINED,
    (_S.DRAINING, _SE.DRAIN_GAVE_UP): _S.STAGED,
    (_S.DRAINING, _SE.DRAIN_FAILED): _S.FAILED,
    (_S.DRAINING, _SE.DISCARDED): _S.DISCARDED,
    # A drained shard's local copy goes when a later rank of its generation aborts.
    (_S.DRAINED, _SE.DISCARDED): _S.DISCARDED,
    (_S.FAILED, _SE.RETRIED): _S.STAGED,
    # Deleted at the destination behind the daemon's back before its generation committed:
    # failed, so the generation ends saying so and `ckptdrain retry` drains the kept copy again.
    (_S.DRAINED, _SE.VANISHED): _S.FAILED,
    (_S.FAILED, _SE.DISCARDED): _S.DISCARDED,

    (_R.OPEN, _RE.SEALED): _R.SEALED,
    (_R.OPEN, _RE.ABORTED): _R.ABORTED,
    (_R.SEALED, _RE.RECORDED): _R.RECORDED,
    # Sealed but not yet recorded: its generation can still fail under it.
    (_R.SEALED, _RE.ABORTED): _R.ABORTED,
    # Recorded, and then given up on an operator's word (`ckptdrain abort`): this node's part
    # record is rewritten with the rank aborted, so no node commits the generation.
    (_R.RECORDED, _RE.ABORTED): _R.ABORTED,

    (_G.OPEN, _GE.RECORDED): _G.RECORDED,
    # Only a RECORDED generation publishes, but a rank may begin (REOPENED) while the publish
    # is in flight; the manifest is the truth, so it commits from OPEN too.
    (_G.OPEN, _GE.COMMITTED): _G.COMMITTED,
    (_G.OPEN, _GE.FAILED): _G.FAILED,
    # Read while recorded, but a rank may have begun here since: the abort stands regardless.
    (_G.OPEN, _GE.PEER_ABORTED): _G.FAILED,
    (_G.OPEN, _GE.CANCELLED): _G.CANCELLED,
    # The part record is rewritten when the new rank drains.
    (_G.RECORDED, _GE.REOPENED): _G.OPEN,
    (_G.RECORDED, _GE.COMMITTED): _G.COMMITTED,
    (_G.RECORDED, _GE.FAILED): _G.FAILED,
    (_G.RECORDED, _GE.PEER_ABORTED): _G.FAILED,
    # Only a generation waiting on other nodes has a commit wait, or can be overtaken by a
    # newer commit while it waits.
    (_G.RECORDED, _GE.EXPIRED): _G.FAILED,
    (_G.RECORDED, _GE.CANCELLED): _G.CANCELLED,
    (_G.RECORDED, _GE.SUPERSEDED_BY_COMMIT): _G.CANCELLED,
    # The only ways out of an ended state: an operator's word, and the manifest. A committed
    # step is final: one that failed here, but that another node committed with this node's
    # part as recorded before this node's failure record landed (seen where that record is
    # owed after the end or at start-up: FailureRecords.owed), is committed here too.
    (_G.FAILED, _GE.RETRIED): _G.OPEN,
    (_G.FAILED, _GE.COMMITTED): _G.COMMITTED,
}

# Which states an event's lifecycle moves: the table alone cannot tell a string that happens
# to equal a state's value from the state itself.
_LIFECYCLE: Final[dict[type[Event], type[State]]] = {
    ShardEvent: ShardState,
    RankEvent: RankState,
    GenerationEvent: GenerationState,
}


@overload
def transition(state: ShardState, event: ShardEvent) -> ShardState: ...
@overload
def transition(state: RankState, event: RankEvent) -> RankState: ...
@overload
def transition(state: GenerationState, event: GenerationEvent) -> GenerationState: ...
def transition(state: State, event: Event) -> State:
    """Where ``event`` takes a record in ``state``; raises :class:`IllegalTransition`."""
    kind = _LIFECYCLE.get(type(event))
    new = TRANSITIONS.get((state, event)) if type(state) is kind else None
    if new is None:
        raise IllegalTransition(
            f"{type(event).__name__}.{event.name} is not allowed in "
            f"{type(state).__name__}.{getattr(state, 'name', repr(state))}")
    return new


# Where each lifecycle begins (records are created in these states, not moved into them).
INITIAL_SHARD: Final = frozenset({_S.HELD, _S.STAGED})
INITIAL_RANK: Final = _R.OPEN
INITIAL_GENERATION: Final = _G.OPEN

# Ended: the daemon moves it no further. A failed generation keeps its local copies, and only
# an operator's `ckptdrain retry` (GenerationEvent.RETRIED) reopens it; only an operator's
# `ckptdrain abort` aborts a recorded rank. One that another node committed with this node's
# part meanwhile is moved to COMMITTED where that is seen (the manifest is the truth).
TERMINAL_SHARD: Final = frozenset({_S.DISCARDED})
TERMINAL_RANK: Final = frozenset({_R.RECORDED, _R.ABORTED})
TERMINAL_GENERATION: Final = frozenset({_G.COMMITTED, _G.FAILED, _G.CANCELLED})

# Bytes this node is still answerable for: what "age of the oldest undrained shard" measures.
UNDRAINED_SHARD: Final = frozenset({_S.HELD, _S.STAGED, _S.DRAINING, _S.FAILED})


def settled(state: ShardState, deferred: bool, has_checksum: bool) -> bool:
    """Ready for the part record: drained, or (deferred: drained only right before the
    manifest) a whole local copy whose checksum the record can already promise."""
    if deferred:
        return state in (_S.STAGED, _S.DRAINED) and has_checksum
    return state is _S.DRAINED


def journalled(state: ShardState) -> ShardState:
    """The state a shard is journalled in: a restart must drain a DRAINING shard again, since
    on disk it is only staged."""
    return _S.STAGED if state is _S.DRAINING else state
