"""The attempt at a step that every rank of a run agrees on without talking:
``$CKPTDRAIN_ATTEMPT``, else what the launchers in the environment name this start of the run
(torchrun, Slurm, a PMIx launcher), else "". A step's ranks commit together only under one
attempt, and a restarted run saving the same step again must be a new one.

:class:`~ckptdrain.client.generation.Generation` takes it by default, and
``ckptdrain.client.generation.default_attempt`` stays importable.
"""

from __future__ import annotations

import hashlib
import os

from ckptdrain.client import wire
from ckptdrain.client.errors import RejectedInput

__all__ = ["default_attempt"]


def default_attempt() -> str:
    """The attempt at a step every rank of a run agrees on without talking: $CKPTDRAIN_ATTEMPT,
    else what the launchers say of this run (:func:`_launch_ids`), else ""."""
    explicit = os.environ.get("CKPTDRAIN_ATTEMPT")
    if explicit:
        # Checked here, where the variable can be named: sent as it was, a long or unprintable
        # value failed every begin and wait as an ``internal`` error (found attacking).
        if len(explicit) > wire.MAX_ATTEMPT_CHARS or not explicit.isprintable():
            raise RejectedInput(
                f"$CKPTDRAIN_ATTEMPT must be printable text of at most {wire.MAX_ATTEMPT_CHARS} "
                f"characters (it is {len(explicit)} characters{_unprintable(explicit)}); set it "
                "to a short run name, the same on every rank"
            )
        return explicit
    ids = _launch_ids()
    attempt = "+".join(ids)
    if len(attempt) > wire.MAX_ATTEMPT_CHARS or not attempt.isprintable():
        # torchrun takes any --rdzv-id: a long or odd one is named by its digest, which
        # every rank of the run (and a waiter in it) computes alike.
        # The environment's bytes as they are: a value that is not UTF-8 comes as surrogates,
        # which encode() refused (a bare UnicodeEncodeError: found attacking).
        digest = hashlib.sha256("+".join(i.partition(":")[2] for i in ids).encode(
            "utf-8", "surrogateescape")).hexdigest()[:32]
        attempt = "+".join(i.partition(":")[0] for i in ids) + f":sha256:{digest}"
    return attempt


def _launch_ids() -> list[str]:
    """Each launcher's name for this start of the run, the same on every rank of it and new
    at each restart: torchrun's run id and restart count; Slurm's job, job step (one per
    ``srun``) and requeue count; a PMIx launcher's namespace (``mpirun`` of Open MPI, ``srun
    --mpi=pmix``). Without one (""), a restarted job that saves a step again is the same
    attempt as the killed one, and the two runs' ranks could commit as one checkpoint (found
    attacking: a rank of the first run sealed on one node, its peer died before saving; the
    restarted peer's save committed beside the old rank's shard)."""
    env = os.environ
    ids = []
    run_id, restarts = env.get("TORCHELASTIC_RUN_ID"), env.get("TORCHELASTIC_RESTART_COUNT")
    if run_id and restarts is not None:
        ids.append(f"torchelastic:{run_id}:{restarts}")
    job = env.get("SLURM_JOB_ID")
    if job:
        ids.append(f"slurm:{job}.{env.get('SLURM_STEP_ID', 'batch')}:"
                   f"{env.get('SLURM_RESTART_COUNT', '0')}")
    namespace = env.get("PMIX_NAMESPACE")
    if namespace:
        ids.append(f"pmix:{namespace}")
    return ids


def _unprintable(text: str) -> str:
    return "" if text.isprintable() else ", some of them not printable"
