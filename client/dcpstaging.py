"""``async_save``'s staging copy, made of the very bytes the daemon gets.

:func:`stage` serializes each tensor of the state dict into one memfd per rank (a
:class:`~ckptdrain.client.dcpfiles.MemfdFile`, as a data file is written), and the staged
state dict handed back to DCP is made of views of those bytes (the storage record of each
archive), so the copy that makes the state safe from the training loop *is* the file the daemon
gets. The file then only needs the items staged nothing for (non-tensor values, anything a
planner resolves differently) appended by :func:`~ckptdrain.client.dcpfiles.write_file`, which
asks :meth:`Staged.find` what is there already. Imports torch, as dcp.py does.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import mmap
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ckptdrain.client.dcpfiles import (
    MemfdFile,
    minimal,
    storage_offset_in,
    whole_archive,
    with_bits_of,
)
from ckptdrain.client.errors import DrainError


@dataclasses.dataclass
class _Record:
    tensor: torch.Tensor  # the staged view
    offset: int
    length: int


class Staged:
    """One rank's staging copy: the archives in ``file``, and the views DCP plans with."""

    def __init__(self, file: MemfdFile) -> None:
        self.file = file
        self.records: dict[tuple[int, int, torch.dtype, tuple[int, ...]], _Record] = {}
        self.mapping: mmap.mmap | None = None
        self.referred = 0  # items whose staged bytes the file refers to (none written twice)

    def find(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """(offset, length) of the archive already holding ``tensor``'s staged bytes."""
        if tensor.device.type != "cpu" or tensor.numel() == 0 or whole_archive(tensor):
            return None
        record = self.records.get(_key(tensor))
        return (record.offset, record.length) if record is not None else None


def _key(tensor: torch.Tensor) -> tuple[int, int, torch.dtype, tuple[int, ...]]:
    return (tensor.data_ptr(), tensor.nbytes, tensor.dtype, tuple(tensor.stride()))


def stage(state_dict: Any, file_name: str) -> tuple[Any, Staged]:
    """Serialize every tensor of ``state_dict`` into one memfd; returns the state dict made of
    views of those bytes (DTensors keep their mesh and placements) and what it staged."""
    staged = Staged(MemfdFile(file_name))
    pending: list[tuple[torch.Tensor, int, int, int]] = []

    def archive(tensor: torch.Tensor) -> int:
        src = minimal(tensor)
        if whole_archive(src):
            # Not shared with the file: a copy, safe from the training loop, that write_data
            # serializes whole.
            pending.append((src.clone(), 0, 0, -1))
            return len(pending) - 1
        offset = staged.file.tell()
        data_at = staged.file.write_tensor(src)
        pending.append((src, offset, staged.file.tell() - offset, data_at))
        return len(pending) - 1

    # First pass: write every archive (the file's size is known only at the end).
    layout = _walk(state_dict, archive)
    size = staged.file.tell()
    if size:
        staged.mapping = mmap.mmap(staged.file.fd, size, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE)
    views: list[torch.Tensor] = []
    for src, offset, length, data_at in pending:
        views.append(_view(staged, src, offset, length, data_at))
    return _rebuild(layout, views), staged


def _view(staged: Staged, src: torch.Tensor, offset: int, length: int,
          written_at: int) -> torch.Tensor:
    if src.numel() == 0 or staged.mapping is None or written_at < 0:
        return src  # nothing to share; write_data serializes it again
    window = memoryview(staged.mapping)[offset:offset + length]
    try:
        data_at = offset + storage_offset_in(window)
    finally:
        window.release()
    if data_at != written_at:
        raise DrainError("torch.save wrote an archive this writer cannot stage in place")
    nbytes = src.untyped_storage().nbytes()
    flat = torch.frombuffer(staged.mapping, dtype=torch.uint8, count=nbytes, offset=data_at)
    view = with_bits_of(src, flat.view(src.dtype).as_strided(src.shape, src.stride(),
                                                            src.storage_offset()))
    staged.records[_key(view)] = _Record(view, offset, length)
    return view


@dataclasses.dataclass
class _Leaf:
    index: int
    like: torch.Tensor  # the original (a DTensor keeps mesh and placements for the view)


def _walk(obj: Any, archive: Callable[[torch.Tensor], int]) -> Any:
    if isinstance(obj, DTensor):
        return _Leaf(archive(obj.to_local()), obj)
    if isinstance(obj, torch.Tensor):
        return _Leaf(archive(obj), obj)
    if isinstance(obj, dict):
        return _same_mapping(obj, ((k, _walk(v, archive)) for k, v in obj.items()))
    if isinstance(obj, list):
        return [_walk(v, archive) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_walk(v, archive) for v in obj)
    # Anything else is the training loop's to change: a copy, as DCP's own stager makes.
    return copy.deepcopy(obj)


def _same_mapping(like: dict[Any, Any], items: Any) -> dict[Any, Any]:
    # An OrderedDict stays one; any other mapping type is rebuilt as a plain dict.
    return collections.OrderedDict(items) if type(like) is collections.OrderedDict else dict(items)


def _rebuild(layout: Any, views: list[torch.Tensor]) -> Any:
    if isinstance(layout, _Leaf):
        view = views[layout.index]
        like = layout.like
        if isinstance(like, DTensor):
            return DTensor.from_local(view, like.device_mesh, like.placements, run_check=False,
                                      shape=like.shape, stride=like.stride())
        return view
    if isinstance(layout, dict):
        return _same_mapping(layout, ((k, _rebuild(v, views)) for k, v in layout.items()))
    if isinstance(layout, list):
        return [_rebuild(v, views) for v in layout]
    if isinstance(layout, tuple):
        return tuple(_rebuild(v, views) for v in layout)
    return layout
