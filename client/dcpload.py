"""Tensors read out of DCP data files straight into the tensors a load fills.

torch's ``FileSystemReader`` has ``torch.load`` allocate a tensor for each archive, read the
file into it, then copies that into the tensor being loaded: two copies, and fresh memory to
fault in. Here each archive's small records are parsed (``torch.load`` onto the ``meta``
device: shape, dtype and strides, no data), and the bytes the load needs go from the file into
the target once: with ``preadv`` straight into it when both sides are one contiguous run of the
same dtype on the CPU, else with one ``copy_`` from a private mapping of the file.
"""

from __future__ import annotations

import mmap
import os
from types import TracebackType
from typing import IO, cast

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from ckptdrain.client import dcpfiles
from ckptdrain.client.errors import DrainError

# One preadv at most this big (a bounded partial read to resume from).
_READ_BYTES = 64 << 20


class FileView:
    """One data file open for a load; owns ``fd`` (closed on exit, with its mapping)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.size = os.fstat(fd).st_size
        self._mapping: mmap.mmap | None = None

    def __enter__(self) -> FileView:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            mapping.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @property
    def mapping(self) -> mmap.mmap:
        # Private and writable (never written): torch.frombuffer wants a writable buffer,
        # and the file stays read-only.
        if self._mapping is None:
            self._mapping = mmap.mmap(self.fd, self.size, mmap.MAP_PRIVATE,
                                      mmap.PROT_READ | mmap.PROT_WRITE)
        return self._mapping

    def window(self, offset: int, length: int) -> memoryview:
        self._check(offset, length)
        return memoryview(self.mapping)[offset:offset + length]

    def read(self, offset: int, length: int) -> bytes:
        self._check(offset, length)
        return bytes(self.mapping[offset:offset + length])

    def read_into(self, buffer: memoryview, offset: int) -> None:
        self._check(offset, len(buffer))
        done = 0
        while done < len(buffer):
            n = os.preadv(self.fd, [buffer[done:done + _READ_BYTES]], offset + done)
            if n == 0:
                raise DrainError(f"a DCP data file ended at {offset + done} bytes, inside an item")
            done += n

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise DrainError(f"a DCP item ({length} bytes at {offset}) lies outside its "
                             f"{self.size} byte data file: the checkpoint is damaged")


def _narrow(tensor: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    """The part of a saved chunk a read item asks for (as FileSystemReader narrows it)."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if length < tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


def read_tensor(view: FileView, offset: int, length: int, req: ReadItem,
                planner: LoadPlanner) -> None:
    """Load one tensor item, the torch.save archive at ``offset``, into its target."""
    target = planner.resolve_tensor(req).detach()
    if dcpfiles.whole_archive(target):
        # A quantized tensor cannot be loaded onto the meta device (found attacking): loaded
        # whole and copied, as FileSystemReader does.
        whole = _loaded(view, offset, length, "cpu")
        _commit(planner, req, target, _narrow(whole, req.storage_offsets, req.lengths))
        return
    archive = view.window(offset, length)
    try:
        data_at = offset + dcpfiles.storage_offset_in(archive)
    finally:
        archive.release()
    saved = _loaded(view, offset, length, "meta")
    storage_bytes = saved.untyped_storage().nbytes()
    if data_at + storage_bytes > offset + length:
        raise DrainError("a DCP tensor item's bytes run past its archive: the checkpoint is "
                         "damaged")
    part = _narrow(saved, req.storage_offsets, req.lengths)
    _check_size(req, target, part)
    # A conjugate or negative view's bytes are not its values, the saved tensor's or the
    # target's (loading a plain tensor into `z.conj()` wrote its bytes unconjugated: found
    # attacking): copy_ below reads and writes through the bits.
    if (target.device.type == "cpu" and target.dtype == saved.dtype and target.is_contiguous()
            and part.is_contiguous() and target.numel() > 0
            and not (saved.is_conj() or saved.is_neg() or target.is_conj() or target.is_neg())):
        view.read_into(dcpfiles.tensor_bytes(target),
                       data_at + int(part.storage_offset()) * saved.element_size())
    elif target.numel() > 0:
        flat = torch.frombuffer(view.mapping, dtype=torch.uint8, count=storage_bytes,
                                offset=data_at)
        target.copy_(dcpfiles.with_bits_of(saved, flat.view(saved.dtype).as_strided(
            part.size(), part.stride(), part.storage_offset())))
    planner.commit_tensor(req, target)


def _loaded(view: FileView, offset: int, length: int, device: str) -> torch.Tensor:
    """The tensor the archive at ``offset`` holds, loaded onto ``device``."""
    archive = view.window(offset, length)
    try:
        saved = torch.load(cast(IO[bytes], dcpfiles.Window(archive)), map_location=device,
                           weights_only=True)
    finally:
        archive.release()
    if not isinstance(saved, torch.Tensor):
        raise DrainError(f"a DCP tensor item holds a {type(saved).__name__}: the checkpoint "
                         "is damaged")
    return saved


def _check_size(req: ReadItem, target: torch.Tensor, part: torch.Tensor) -> None:
    if target.size() != part.size():
        raise DrainError(f"read item {req.storage_index} is {tuple(part.size())} in the "
                         f"checkpoint but {tuple(target.size())} in the state dict")


def _commit(planner: LoadPlanner, req: ReadItem, target: torch.Tensor,
            part: torch.Tensor) -> None:
    _check_size(req, target, part)
    target.copy_(part)
    planner.commit_tensor(req, target)
