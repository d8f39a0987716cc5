"""Which attempt a DCP save goes under, the same on every rank.

A generation commits only when every rank saved it under one attempt name. ``DrainWriter``'s
coordinator names a fresh one for each save and hands it to every rank in its plan
(:func:`save_attempt`); a plan reused by DCP's plan caching is told apart on each rank by how
many saves of that step came before (:func:`this_save`). :func:`agreed_attempt` gives a run
that saves through the client itself one attempt for all its ranks.

Apart from dcp.py, which keeps the ``StorageWriter``, because these are the rules for the name
ranks and nodes must agree on, not the writing of a checkpoint's files. Like dcp.py, it imports
torch; ``agreed_attempt`` stays importable from :mod:`ckptdrain.client.dcp`.
"""

from __future__ import annotations

import collections
import hashlib
import uuid

import torch.distributed as dist

from ckptdrain.client.attempts import default_attempt
from ckptdrain.client.errors import RejectedInput
from ckptdrain.client.wire import MAX_ATTEMPT_CHARS

__all__ = ["agreed_attempt", "save_attempt", "this_save"]


def save_attempt(run: str) -> str:
    """One save's attempt: a fresh token, under the run's attempt when there is one."""
    token = f"dcp:{uuid.uuid4().hex}"
    if not run:
        return token
    # The run's name is kept whole (a waiter of the run matches on it); the token gives way.
    room = MAX_ATTEMPT_CHARS - len(run) - 1 - len("dcp:")
    if room < 16:
        run = hashlib.sha256(run.encode()).hexdigest()[:32]
        room = MAX_ATTEMPT_CHARS - len(run) - 1 - len("dcp:")
    return f"{run}/{token[:len('dcp:') + room]}"


# Saves this process began, by job, step and the attempt their plan named. DCP's plan caching
# (DefaultSavePlanner(enable_plan_caching=True)) hands later saves the first one's plan, and
# the attempt the coordinator put in it with it: a failed step saved again came as the failed
# attempt, refused for good (found attacking). Every rank counts its own saves, and DCP saves
# on every rank alike, so each rank comes to the same attempt.
_PLANNED: collections.Counter[tuple[str, int, str]] = collections.Counter()


def this_save(job: str, step: int, planned: str) -> str:
    """This save's attempt: the plan's, its last characters replaced by how many saves of
    ``job`` and ``step`` under it came before (none: the plan's as it is)."""
    earlier = _PLANNED[(job, step, planned)]
    _PLANNED[(job, step, planned)] += 1
    return planned if not earlier else f"{planned[:-8]}{earlier:08x}"


def agreed_attempt(group: dist.ProcessGroup | None = None) -> str:
    """This run's attempt, the same on every rank of ``group`` (default: the whole job): rank
    0's :func:`~ckptdrain.client.attempts.default_attempt`, sent to the others. Pass it as
    ``generation(..., attempt=...)`` when saving through the client on several nodes under
    torchrun: its restart count is each node's own (an agent whose workers were healthy
    restarts them without counting), so after a restart each node's ``default_attempt()`` may
    differ and no step saved on several nodes would commit. A collective: every rank calls it,
    once per process start. Without an initialized process group, ``default_attempt()``.
    (``DrainWriter`` needs none of this: its coordinator names each save's attempt.)"""
    if not (dist.is_available() and dist.is_initialized()):
        return default_attempt()
    box: list[object] = [default_attempt() if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(box, group=group, group_src=0)
    attempt = box[0]
    if not isinstance(attempt, str):  # another program's object on the wire
        raise RejectedInput(f"rank 0 sent {type(attempt).__name__} for the run's attempt")
    return attempt
