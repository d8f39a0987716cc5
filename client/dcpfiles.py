"""DCP data files serialized straight into memfds, and the archives within them.

A data file is what torch's ``FileSystemWriter`` writes: for each write item of the file, the
``BYTE_IO`` items first, then the tensors, each a ``torch.save`` archive one after the other,
so torch's stock ``FileSystemReader`` loads it. Here the file is a memfd the daemon takes
over: it is written as it is serialized, never held as a whole in a Python buffer, and each
tensor's bytes are copied once, from the tensor into the memfd (:class:`MemfdFile`).

``async_save``'s staging copy (dcpstaging.py) lands in such a file too, its tensors' bytes
written first; :func:`write_file` then appends only the items staged nothing for. Where an
archive's storage bytes start in the file, and how stored bytes are read back as the tensor
read them, is here: the staging copy and the loader (dcpload.py) both ask.

Public torch APIs only, but for ``_StorageInfo``: the per-item record FileSystemReader reads
back from ``.metadata``, which must be torch's own class for the stock reader to unpickle.
Its fields are checked against the ones this module was tested with (torch 2.13), and so is
the archive layout ``torch.serialization.skip_data`` leaves (one gap, the storage's size).
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import os
import struct
import zipfile
from typing import IO, TYPE_CHECKING, Any, cast

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ckptdrain.client import memfd
from ckptdrain.client.errors import DrainError

if TYPE_CHECKING:
    from ckptdrain.client.dcpstaging import Staged

# The file whose presence makes a DCP directory loadable; DrainWriter sends it last.
METADATA_NAME = ".metadata"

DATA_SUFFIX = ".distcp"  # FileSystemWriter's data file suffix
# One pwrite at most this big: a signal or a full disk leaves a bounded partial write.
_PWRITE_BYTES = 64 << 20
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length
_STORAGE_INFO_FIELDS = ("relative_path", "offset", "length", "transform_descriptors")


def storage_info(relative_path: str, offset: int, length: int) -> Any:
    """torch's per-item storage record (what FileSystemReader reads back from .metadata)."""
    from torch.distributed.checkpoint import filesystem

    cls = getattr(filesystem, "_StorageInfo", None)
    fields = tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else ()
    if cls is None or fields != _STORAGE_INFO_FIELDS:
        raise DrainError(
            f"torch {torch.__version__} changed DCP's storage record (filesystem._StorageInfo: "
            f"{fields or 'missing'}); this ckptdrain writes {_STORAGE_INFO_FIELDS}: use the "
            "pinned torch or upgrade ckptdrain"
        )
    return cls(relative_path=relative_path, offset=offset, length=length)


def split_by_size_and_type(bins: int, items: list[WriteItem]) -> list[list[WriteItem]]:
    """FileSystemWriter's grouping of one rank's items into ``bins`` files (same files)."""
    if bins == 1:
        return [items]
    byte_items = [wi for wi in items if wi.type == WriteItemType.BYTE_IO]
    tensor_items = sorted((wi for wi in items if wi.type != WriteItemType.BYTE_IO),
                          key=_item_size, reverse=True)
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    for i, wi in enumerate(byte_items):
        buckets[i % bins].append(wi)
    for wi in tensor_items:
        smallest = min(range(bins), key=sizes.__getitem__)
        buckets[smallest].append(wi)
        sizes[smallest] += _item_size(wi)
    return buckets


def _item_size(item: WriteItem) -> int:
    assert item.tensor_data is not None
    numel = 1
    for s in item.tensor_data.size:
        numel *= s
    return numel * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()


class _Sink(io.RawIOBase):
    """A memfd written at a position of its own, with ``pwrite``: what torch.save writes
    under ``skip_data`` lands in place, and the seek over each storage's bytes is recorded as
    a hole for :meth:`MemfdFile.write_tensor` to fill."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd, self.pos = fd, 0
        self.holes: list[tuple[int, int]] = []

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        new = pos if whence == io.SEEK_SET else self.pos + pos if whence == io.SEEK_CUR else -1
        if new < self.pos:
            # torch.save only ever skips forward over a storage's bytes.
            raise DrainError("torch.save moved backwards in a DCP data file; use the pinned torch")
        if new > self.pos:
            self.holes.append((self.pos, new - self.pos))
        self.pos = new
        return new

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        pwrite_all(self.fd, view, self.pos)
        self.pos += n
        return n


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + _PWRITE_BYTES], offset + done)


def storage_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor's whole storage, without a copy (read while ``tensor``
    lives)."""
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(storage.data_ptr())).cast("B")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor's elements, writable, without a copy."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise DrainError("only a contiguous CPU tensor's bytes can be read into directly")
    if tensor.nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")


class MemfdFile:
    """One data file in a memfd of its own; :meth:`append` serializes into it.

    A tensor's archive is torch.save's, written under ``torch.serialization.skip_data`` (the
    archive's records in place, its storage's bytes skipped), and the storage's bytes then
    written into the gap with ``pwrite`` straight from the tensor: one copy, no Python-level
    buffering, and no CRC-32 over the data (the storage record's CRC field is 0, as torch writes
    every record's with ``torch.serialization.set_crc32_options(False)``; torch.load does not
    check it, and the daemon checksums every file it receives with CRC64NVME).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        # Out of fds, a typed error inside DCP's CheckpointException, not a bare OSError.
        self.fd = memfd.create(f"ckptdrain-dcp-{name}", f"cannot save {name!r}",
                               "to serialize it into")
        self.stream = _Sink(self.fd)

    def tell(self) -> int:
        return self.stream.tell()

    def append(self, item: WriteItem, data: torch.Tensor | io.BytesIO) -> WriteResult:
        """Write one item as FileSystemWriter does (bytes as they are, a tensor torch.saved)."""
        offset = self.stream.tell()
        if isinstance(data, io.BytesIO):
            self.stream.write(data.getbuffer())
        else:
            self.write_tensor(minimal(data))
        return self.result(item, offset, self.stream.tell() - offset)

    def write_tensor(self, tensor: torch.Tensor) -> int:
        """torch.save ``tensor`` (a CPU tensor whose storage is its own bytes) here; returns
        where its storage's bytes start (-1 for a :func:`whole_archive` tensor)."""
        self.stream.holes.clear()
        if whole_archive(tensor):
            torch.save(tensor, cast(IO[bytes], self.stream))
            return -1
        with torch.serialization.skip_data():
            torch.save(tensor, cast(IO[bytes], self.stream))
        holes, self.stream.holes = self.stream.holes, []
        data = storage_view(tensor)
        if len(data) == 0 and not holes:
            return self.stream.tell()
        if len(holes) != 1 or holes[0][1] != len(data):
            raise DrainError(
                f"torch {torch.__version__} wrote an archive this writer cannot fill in place "
                f"(gaps {holes} for a {len(data)} byte storage); use the pinned torch"
            )
        pwrite_all(self.fd, data, holes[0][0])
        return holes[0][0]

    def result(self, item: WriteItem, offset: int, length: int) -> WriteResult:
        return WriteResult(index=item.index, size_in_bytes=length,
                           storage_data=storage_info(self.name, offset, length))

    def flush(self) -> None:
        """Nothing buffered: every write is a ``pwrite`` into the memfd."""

    def close(self) -> None:
        """Drop this process's fd (the daemon keeps its own, and views keep their mapping)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def whole_archive(tensor: torch.Tensor) -> bool:
    """A tensor ``skip_data`` cannot serialize (a quantized one: "Cannot serialize qtensor
    under skip_data", found attacking), nor a view of stored bytes stand for (a sparse one):
    torch.save writes its archive whole, data included, as FileSystemWriter does."""
    return bool(tensor.is_quantized) or tensor.layout is not torch.strided


def minimal(tensor: torch.Tensor) -> torch.Tensor:
    """What FileSystemWriter serializes: a CPU tensor whose storage is only its own bytes."""
    tensor = tensor.detach().cpu()
    if not whole_archive(tensor) and tensor.untyped_storage().size() != tensor.nbytes:
        tensor = tensor.clone()
    return tensor


def write_file(file: MemfdFile, items: list[WriteItem], planner: SavePlanner,
               staged: Staged | None = None) -> list[WriteResult]:
    """Serialize ``items`` into ``file`` in FileSystemWriter's order; what ``staged`` already
    holds in this file is referred to, not written again."""
    results = []
    byte_items = [wi for wi in items if wi.type == WriteItemType.BYTE_IO]
    tensor_items = [wi for wi in items if wi.type != WriteItemType.BYTE_IO]
    for item in byte_items:
        data = planner.resolve_data(item)
        assert isinstance(data, io.BytesIO)
        results.append(file.append(item, data))
    for item in tensor_items:
        tensor = planner.resolve_data(item)
        assert isinstance(tensor, torch.Tensor)
        where = staged.find(tensor) if staged is not None else None
        if where is not None and staged is not None:
            staged.referred += 1
        results.append(file.result(item, *where) if where is not None
                       else file.append(item, tensor))
    file.flush()
    return results


# -- the archives within a file (read by the staging copy and by the loader) -------------
class Window(io.RawIOBase):
    """A read-only file over part of a buffer (zipfile reads an archive's directory)."""

    def __init__(self, view: memoryview) -> None:
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = (0, self._pos, len(self._view))[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        chunk = self._view[self._pos:self._pos + len(buffer)]
        n = len(chunk)
        memoryview(buffer).cast("B")[:n] = chunk
        self._pos += n
        return n


def storage_offset_in(archive: memoryview) -> int:
    """Where the one storage record's bytes start within a torch.save archive."""
    with zipfile.ZipFile(Window(archive)) as zf:
        infos = [i for i in zf.infolist() if i.filename.endswith("/data/0")]
        if len(infos) != 1 or infos[0].compress_type != zipfile.ZIP_STORED:
            raise DrainError("torch.save wrote an archive this writer cannot stage in place")
        info = infos[0]
    sig, name_len, extra_len = _LOCAL_HEADER.unpack_from(archive, info.header_offset)
    if sig != b"PK\x03\x04":
        raise DrainError("torch.save wrote an archive this writer cannot stage in place")
    return int(info.header_offset + _LOCAL_HEADER.size + name_len + extra_len)



def with_bits_of(like: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """``raw`` (a view of stored bytes) read as ``like`` reads its own: a conjugate or a
    negative view (``w.conj()``, ``w.mH``, ``w.conj().imag``) stores its base's bytes and a
    bit saying how to read them, and bytes read back without the bit are other values (found
    attacking: the adjoint of a weight loaded as the weight, silently)."""
    if like.is_conj():
        raw = raw.conj()
    if like.is_neg():
        raw = torch._neg_view(raw)
    return raw
