"""PyTorch Distributed Checkpoint (DCP) through ckptdrain: :class:`DrainWriter`.

``dcp.save(state_dict, storage_writer=DrainWriter(job, step))`` (or ``dcp.async_save``) hands
every rank's files to the ckptdrain daemon on its node instead of writing them to a shared
filesystem. The files and their names are exactly those of torch's ``FileSystemWriter``
(``__<rank>_<n>.distcp`` data files and one ``.metadata``), so the committed generation
directory ``<dest>/<job>/<step:020d>/`` is a standard DCP checkpoint that torch's stock
``FileSystemReader`` loads.

How one save maps onto the ckptdrain protocol:

- ``write_data`` (every rank): begin this rank's part of generation ``step`` (rank and world
  size are those of the process group DCP saves with), serialize each data file into memory
  with FileSystemWriter's own serializer and ``put`` its bytes. Nothing touches the training
  node's disk. Every rank but the coordinator then seals its part.
- ``finish`` (the coordinator only, after every rank's ``write_data`` succeeded): ``put`` the
  pickled ``.metadata`` with ``deferred=True``, so the daemon writes it to the destination only
  after every rank's data is there (a directory with ``.metadata`` looks loadable), then seal.
- Any exception aborts the rank's part, and with it the generation: it never commits, and the
  previous committed generation stays the latest.

Which attempt each save goes under, the same on every rank, is :mod:`.dcpattempts`'s.

This module and the other ``dcp*`` modules import torch; the rest of :mod:`ckptdrain.client`
uses the standard library only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import threading
import uuid
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckptdrain.client import dcpfiles, dcpstaging, names
from ckptdrain.client.attempts import default_attempt
from ckptdrain.client.client import Client
from ckptdrain.client.dcpattempts import agreed_attempt, save_attempt, this_save
from ckptdrain.client.dcpfiles import METADATA_NAME
from ckptdrain.client.dcpreader import DrainReader
from ckptdrain.client.errors import DrainError, RejectedInput
from ckptdrain.client.generation import Generation

# agreed_attempt (dcpattempts.py) stays importable from here, where the docs name it.
__all__ = ["METADATA_NAME", "DrainReader", "DrainWriter", "agreed_attempt"]

# DCP's name for the checkpoint's metadata file (torch.distributed.checkpoint.filesystem).
# The format version FileSystemWriter stamps into .metadata (filesystem.CURRENT_DCP_VERSION).
_DCP_VERSION = "1.0.0"


@dataclasses.dataclass(frozen=True)
class _RankPlan:
    """What the coordinator tells each rank in its plan: its file prefix and who it is.

    The rank and world size come from the coordinator's list of plans, i.e. from the process
    group DCP saves with, which may be a subgroup: ``torch.distributed.get_world_size()`` of
    the default group would be wrong there.
    """

    prefix: str
    rank: int
    world_size: int
    attempt: str = ""


def _abort_part(stack: contextlib.ExitStack, reason: str) -> None:
    """Leave an open part through its ``with`` exit as if ``reason`` had been raised: abort."""
    error = DrainError(reason)
    with contextlib.suppress(DrainError, OSError):
        stack.__exit__(DrainError, error, None)


class DrainWriter(StorageWriter, AsyncStager):
    """A DCP ``StorageWriter`` that hands each rank's files to its node's ckptdrain daemon.

    ``job`` and ``step`` name the generation: it commits at ``<dest>/<job>/<step:020d>/``.
    ``client`` is a :class:`~ckptdrain.client.Client` to use (it stays the caller's to
    close); otherwise one is made on ``socket_path`` (default: ``$CKPTDRAIN_SOCKET``, see
    ``Client``). ``ack`` ("local" or "memory") overrides the daemon's failure boundary.
    ``single_file_per_rank`` and ``thread_count`` mean what they mean for torch's
    ``FileSystemWriter`` and give the same files: by default one ``__<rank>_0.distcp`` per
    rank. Each file is serialized straight into a memfd that is passed to the daemon (with
    ``ack="memory"`` the daemon keeps that memfd as it is); ``thread_count`` files are
    serialized at once. Passed to ``dcp.async_save``, the writer is also its ``AsyncStager``:
    the staging copy is serialized into the memfd the daemon takes over, and the state dict
    DCP saves from is views of it, so there is no second copy (see :mod:`.dcpstaging`).

    One writer saves one generation. Use it with ``with`` (or call :meth:`close`) so that a
    save that failed on another rank, which DCP does not report to this writer, also aborts
    this rank's part at once instead of when the writer is collected.
    """

    def __init__(
        self,
        job: str,
        step: int,
        *,
        client: Client | None = None,
        socket_path: str | os.PathLike[str] | None = None,
        ack: str | None = None,
        single_file_per_rank: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
    ) -> None:
        super().__init__()
        self.job = names.validate_job(job)
        self.step = names.validate_step(step)
        if client is not None and socket_path is not None:
            raise RejectedInput(
                "pass either client or socket_path to DrainWriter, not both "
                "(a Client already names its socket)"
            )
        if isinstance(thread_count, bool) or not isinstance(thread_count, int) or thread_count < 1:
            raise RejectedInput(f"thread_count is {thread_count!r}; use an integer >= 1")
        self.ack = ack
        self.single_file_per_rank = bool(single_file_per_rank)
        self.thread_count = thread_count
        self.per_thread_copy_ahead = per_thread_copy_ahead
        self._owns_client = client is None
        self._client = client if client is not None else Client(socket_path)
        self.save_id = str(uuid.uuid4())
        self.is_coordinator = False
        self._staged: dcpstaging.Staged | None = None  # async_save's staging copy
        # The coordinator's part stays open from write_data to finish; the ExitStack is its
        # ``with`` block. The finalizer aborts it if the writer is dropped in between.
        self._open: contextlib.ExitStack | None = None
        self._part: Generation | None = None
        self._finalizer: weakref.finalize[[contextlib.ExitStack, str], DrainWriter] | None = None
        self._attempt: str | None = None  # this save's, once its plan named it
        self._state = "new"  # new -> writing -> open (coordinator) -> sealed | failed | aborted

    # -- identity ----------------------------------------------------------------------------
    @property
    def checkpoint_id(self) -> str:
        """``<job>/<step:020d>``: the generation's directory relative to the destination."""
        return f"{self.job}/{self.step:020d}"

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        # DCP never picks this writer from a checkpoint_id: it is always passed explicitly.
        return False

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def __repr__(self) -> str:
        return (
            f"DrainWriter(job={self.job!r}, step={self.step}, "
            f"socket={self._client.socket_path!r}, state={self._state!r})"
        )

    # -- the StorageWriter protocol ------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            raise RejectedInput(
                f"DrainWriter names its generation by job and step ({self.checkpoint_id}); "
                "call dcp.save/async_save without checkpoint_id"
            )
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise RejectedInput(
                "DrainWriter needs use_collectives=True: the coordinator's .metadata is what "
                "completes a ckptdrain generation"
            )
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        world_size = len(plans)
        # One token per save, chosen here and handed to every rank in its plan: a restarted
        # job saving the same step again is a new attempt, never mixed with the old one.
        # Named under the run's own attempt (torchrun's restart count, $CKPTDRAIN_ATTEMPT), so
        # a `wait` of the restarted run waits for this save, not for the crashed run's.
        attempt = save_attempt(default_attempt())
        return [
            dataclasses.replace(
                plan, storage_data=_RankPlan(f"__{rank}_", rank, world_size, attempt)
            )
            for rank, plan in enumerate(plans)
        ]

    # -- the AsyncStager protocol (async_save) ---------------------------------------------------
    # Staging is done when stage() returns: nothing for DCP to wait on afterwards.
    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """async_save's staging copy, serialized straight into a memfd the daemon takes
        over: the state dict DCP plans with is views of those bytes, so staging is the only
        copy (no DCP stager copy, then a file copy of it)."""
        if self._state != "new" or self._staged is not None:
            raise RejectedInput(
                f"this DrainWriter already saved {self.checkpoint_id} ({self._state}); "
                "create a DrainWriter(job, step) for each save"
            )
        staged_dict, self._staged = dcpstaging.stage(state_dict, "staged")
        return staged_dict  # type: ignore[no-any-return]

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once the copy is made."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rank_plan = plan.storage_data
        if not isinstance(rank_plan, _RankPlan):
            raise RejectedInput(
                f"the save plan carries {type(rank_plan).__name__} storage data, not "
                "DrainWriter's: use one DrainWriter for prepare_global_plan and write_data"
            )
        if self._state != "new":
            raise RejectedInput(
                f"this DrainWriter already saved {self.checkpoint_id} ({self._state}); "
                "create a DrainWriter(job, step) for each save"
            )
        self._state = "writing"
        self._attempt = this_save(self.job, self.step, rank_plan.attempt)
        generation = self._client.generation(
            self.job, self.step, rank=rank_plan.rank, world_size=rank_plan.world_size,
            ack=self.ack, attempt=self._attempt,
        )
        try:
            with contextlib.ExitStack() as stack:
                # Entering begins the rank's part; leaving the stack seals it, or aborts it
                # when an exception leaves with it.
                stack.enter_context(generation)
                results = self._hand_off(generation, plan, planner, rank_plan.prefix)
                if self.is_coordinator:
                    # Kept open for finish(): sealed once .metadata has joined the part.
                    self._keep_open(stack.pop_all(), generation)
        except BaseException:
            self._state = "failed"
            raise
        self._state = "open" if self.is_coordinator else "sealed"
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self._open is None or self._state != "open":
            raise RejectedInput(
                f"finish() of {self.checkpoint_id} needs this writer's own write_data to have "
                f"run as the coordinator first (state: {self._state})"
            )
        stack, self._open = self._open, None
        generation, self._part = self._part, None
        assert generation is not None and self._finalizer is not None
        self._finalizer.detach()
        try:
            with stack:  # seals the part, or aborts it if the hand-off raised
                generation.put(METADATA_NAME, self._metadata_bytes(metadata, results),
                               deferred=True)
        except BaseException:
            self._state = "failed"
            raise
        self._state = "sealed"

    # -- after the save ----------------------------------------------------------------------
    def wait(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Block until the generation is committed at the destination (``Client.wait``).

        Any rank may call it: its own node's daemon answers. Raises ``Timeout`` if it is not
        committed within ``timeout_s`` and ``GenerationFailed`` if it never will be.
        """
        attempt = self._attempt if self._attempt is not None else default_attempt()
        return self._client.wait(self.job, self.step, timeout_s=timeout_s, attempt=attempt)

    def abort(self, reason: str = "the checkpoint save failed") -> None:
        """Abort this rank's part if it is still open (a coordinator whose save failed)."""
        stack, self._open, self._part = self._open, None, None
        if stack is None:
            return
        if self._finalizer is not None:
            self._finalizer.detach()
        self._state = "aborted"
        _abort_part(stack, reason)

    def close(self) -> None:
        """Abort a part left open, drop a staging copy never handed off, and close the
        client if this writer made it."""
        self.abort("the DrainWriter was closed before the save finished")
        staged, self._staged = self._staged, None
        if staged is not None:
            staged.file.close()
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> DrainWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            self.abort(f"{type(exc).__name__}: {exc}")
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # A process-based async_save pickles the writer into its checkpoint process. Sockets
        # do not travel: the copy makes its own Client on the same socket path.
        if self._state != "new":
            raise RejectedInput(
                f"a DrainWriter that has begun saving ({self._state}) cannot be copied to "
                "another process; pickle it before the save"
            )
        skip = ("_client", "_finalizer", "_open", "_part", "_staged")
        state = {k: v for k, v in self.__dict__.items() if k not in skip}
        state["_socket_path"] = self._client.socket_path
        state["_client_timeouts"] = (self._client.timeout_s, self._client.connect_timeout_s)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        socket_path = state.pop("_socket_path")
        timeout_s, connect_timeout_s = state.pop("_client_timeouts")
        self.__dict__.update(state)
        self._client = Client(socket_path, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s)
        self._owns_client = True
        self._open = self._part = self._finalizer = None
        self._staged = None

    # -- internals ---------------------------------------------------------------------------
    def _keep_open(self, stack: contextlib.ExitStack, generation: Generation) -> None:
        self._open, self._part = stack, generation
        # Dropping the writer between write_data and finish (the save failed on another rank)
        # must abort the part: an open rank would hold the daemon's generation slot.
        self._finalizer = weakref.finalize(
            self, _abort_part, stack, "the DrainWriter was dropped before the save finished"
        )

    def _file_groups(self, plan: SavePlan, prefix: str) -> Iterator[tuple[str, list[WriteItem]]]:
        """The files and their items, named and grouped exactly as FileSystemWriter does."""
        if self.single_file_per_rank:
            groups = dcpfiles.split_by_size_and_type(self.thread_count, plan.items)
        else:
            groups = [[item] for item in plan.items]
        for index, items in enumerate(groups):
            yield f"{prefix}{index}{dcpfiles.DATA_SUFFIX}", items

    def _hand_off(
        self, generation: Generation, plan: SavePlan, planner: SavePlanner, prefix: str
    ) -> list[WriteResult]:
        # One connection per part: puts from several serializing threads take turns on it.
        lock = threading.Lock()
        staged, self._staged = self._staged, None
        if staged is not None:
            # async_save staged into one memfd: that is this rank's one data file, with what
            # staging did not hold (non-tensor values) appended.
            staged.file.name = f"{prefix}0{dcpfiles.DATA_SUFFIX}"
            return self._put_file(staged.file, plan.items, planner, generation, lock, staged)

        def serialize_and_put(file_name: str, items: list[WriteItem]) -> list[WriteResult]:
            file = dcpfiles.MemfdFile(file_name)
            return self._put_file(file, items, planner, generation, lock)

        groups = list(self._file_groups(plan, prefix))
        results: list[WriteResult] = []
        if self.thread_count == 1 or len(groups) <= 1:
            for file_name, items in groups:
                results.extend(serialize_and_put(file_name, items))
        else:
            with ThreadPoolExecutor(self.thread_count, thread_name_prefix="ckptdrain-dcp") as pool:
                futures = [pool.submit(serialize_and_put, name, items) for name, items in groups]
                try:
                    for future in futures:
                        results.extend(future.result())
                except BaseException:
                    for future in futures:
                        future.cancel()
                    raise
        return results

    @staticmethod
    def _put_file(
        file: dcpfiles.MemfdFile,
        items: list[WriteItem],
        planner: SavePlanner,
        generation: Generation,
        lock: threading.Lock,
        staged: dcpstaging.Staged | None = None,
    ) -> list[WriteResult]:
        """Serialize into the file's memfd and pass the memfd itself: with ack="memory" the
        daemon keeps it as it is, else it copies it to its staging disk."""
        try:
            results = dcpfiles.write_file(file, items, planner, staged)
            with lock:
                generation.put_file(file.name, file.fd)
        finally:
            file.close()
        return results

    def _metadata_bytes(self, metadata: Metadata, results: list[list[WriteResult]]) -> bytes:
        """``.metadata`` exactly as FileSystemWriter.finish writes it."""
        metadata.version = _DCP_VERSION
        storage_md = {}
        for rank_results in results:
            storage_md.update({result.index: result.storage_data for result in rank_results})
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        return pickle.dumps(metadata)
