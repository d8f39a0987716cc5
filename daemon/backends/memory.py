"""An in-memory destination that records every call and injects faults: ``memory://name``.

Tests use it where a real destination cannot show what they need: a failure on the third
upload, a drain held mid-flight, a slow link. Its semantics match the real backends: a key
appears only complete, an exclusive create fails on an existing key, listing is sorted.

``MemoryBackend.named(uri, node_id)`` returns backends sharing one store per URI, so two
daemons in one process (two "nodes") see the same bucket, as they would on S3 or Lustre.
"""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ckptdrain.client.manifest import format_checksum
from ckptdrain.daemon.backends.base import Backend, BackendError, ObjectInfo, UploadLog

OPS = frozenset(
    {
        "put_file",
        "put_bytes",
        "get_bytes",
        "list",
        "read_chunks",
        "delete",
        "prepare_prefix",
        "sweep_orphans",
    }
)
# A paused put_file waits at most this long: a test that forgets resume() fails, not hangs.
DEFAULT_GATE_TIMEOUT_S = 60.0
_READ_BYTES = 1 << 20


@dataclass
class MemoryStore:
    """The shared "bucket": objects by key. One per ``memory://`` URI via ``named``."""

    objects: dict[str, bytes] = field(default_factory=dict)
    # Unix time of each object's last write, from ``clock``: tests age objects by editing it
    # or by passing a clock, as retention's grace period needs old objects.
    modified: dict[str, float] = field(default_factory=dict)
    clock: Callable[[], float] = time.time
    # Every call of every backend on this store, in order, as (node_id, op, key).
    calls: list[tuple[str, str, str]] = field(default_factory=list)


@dataclass
class _Fault:
    op: str
    exc: BaseException
    remaining: int
    key_contains: str


_named: dict[str, MemoryStore] = {}


class MemoryBackend(Backend):
    """A recording, fault-injecting fake destination."""

    def __init__(
        self,
        node_id: str = "memory",
        *,
        store: MemoryStore | None = None,
        uri: str = "memory://",
        bandwidth_bytes_per_s: float | None = None,
        gate_timeout_s: float = DEFAULT_GATE_TIMEOUT_S,
    ) -> None:
        self.uri = uri
        self.node_id = node_id
        self.store = store if store is not None else MemoryStore()
        # (op, key) of this backend's calls, in order, faults included.
        self.calls: list[tuple[str, str]] = []
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self.gate_timeout_s = gate_timeout_s
        self._faults: list[_Fault] = []
        self._open = asyncio.Event()
        self._open.set()
        self.closed = False

    @classmethod
    def named(cls, uri: str, node_id: str) -> MemoryBackend:
        """A backend on the process-wide store for ``uri`` (created on first use)."""
        store = _named.setdefault(uri, MemoryStore())
        return cls(node_id, store=store, uri=uri)

    @staticmethod
    def forget(uri: str | None = None) -> None:
        """Drop the shared store for ``uri`` (all of them when None): test isolation."""
        if uri is None:
            _named.clear()
        else:
            _named.pop(uri, None)

    @property
    def objects(self) -> dict[str, bytes]:
        return self.store.objects

    # --- test controls ----------------------------------------------------------------------

    def inject(self, op: str, exc: BaseException, times: int = 1, key_contains: str = "") -> None:
        """Make the next ``times`` calls of ``op`` (on keys containing ``key_contains``) raise
        ``exc`` before doing anything, as a failed request would."""
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; use one of {sorted(OPS)}")
        if times < 1:
            raise ValueError(f"times must be >= 1, not {times}")
        self._faults.append(_Fault(op, exc, times, key_contains))

    def pause(self) -> None:
        """Hold every put_file at its start until resume() (to keep drains in flight)."""
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    def count(self, op: str, key_contains: str = "") -> int:
        """How many calls of ``op`` this backend saw on keys containing ``key_contains``."""
        return sum(1 for o, k in self.calls if o == op and key_contains in k)

    def _enter(self, op: str, key: str) -> None:
        self.calls.append((op, key))
        self.store.calls.append((self.node_id, op, key))
        for fault in self._faults:
            if fault.op == op and fault.key_contains in key and fault.remaining > 0:
                fault.remaining -= 1
                if fault.remaining == 0:
                    self._faults.remove(fault)
                raise fault.exc

    async def _throttle(self, nbytes: int) -> None:
        if self.bandwidth_bytes_per_s:
            await asyncio.sleep(nbytes / self.bandwidth_bytes_per_s)

    # --- Backend ----------------------------------------------------------------------------

    async def put_file(
        self, key: str, fd: int, size: int, *, upload_log: UploadLog | None = None
    ) -> str:
        del upload_log
        self._enter("put_file", key)
        try:
            await asyncio.wait_for(self._open.wait(), self.gate_timeout_s)
        except TimeoutError as exc:
            raise BackendError(
                f"put_file {key} was paused for {self.gate_timeout_s}s; call resume()",
                transient=True,
                kind="timeout",
            ) from exc
        digest = hashlib.sha256()
        chunks: list[bytes] = []
        offset = 0
        while offset < size:
            chunk = await asyncio.to_thread(os.pread, fd, min(_READ_BYTES, size - offset), offset)
            if not chunk:
                raise BackendError(
                    f"source of {key} ended at byte {offset} of {size}", kind="integrity"
                )
            digest.update(chunk)
            chunks.append(chunk)
            offset += len(chunk)
            await self._throttle(len(chunk))
        # Stored in one step at the end: a failed or cancelled put leaves nothing.
        self.store.objects[key] = b"".join(chunks)
        self.store.modified[key] = self.store.clock()
        return format_checksum("sha256", digest.hexdigest())

    async def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False) -> bool:
        self._enter("put_bytes", key)
        if exclusive and key in self.store.objects:
            return False
        self.store.objects[key] = bytes(data)
        self.store.modified[key] = self.store.clock()
        return True

    async def get_bytes(self, key: str, *, max_bytes: int = 64 << 20) -> bytes | None:
        self._enter("get_bytes", key)
        data = self.store.objects.get(key)
        if data is not None and len(data) > max_bytes:
            raise BackendError(
                f"{key} is {len(data)} bytes, over the {max_bytes}-byte limit", kind="integrity"
            )
        return data

    async def list(self, prefix: str) -> builtins.list[ObjectInfo]:
        self._enter("list", prefix)
        return [
            ObjectInfo(key=key, size=len(data), modified=self.store.modified.get(key))
            for key, data in sorted(self.store.objects.items())
            if key.startswith(prefix)
        ]

    async def read_chunks(self, key: str, *, chunk_bytes: int = 8 << 20) -> AsyncIterator[bytes]:
        self._enter("read_chunks", key)
        data = self.store.objects.get(key)
        if data is None:
            raise BackendError(f"{key} does not exist", kind="integrity")
        for start in range(0, len(data), chunk_bytes):
            chunk = data[start : start + chunk_bytes]
            await self._throttle(len(chunk))
            yield chunk

    async def delete(self, key: str) -> None:
        self._enter("delete", key)
        self.store.objects.pop(key, None)
        self.store.modified.pop(key, None)

    async def prepare_prefix(self, prefix: str) -> None:
        self._enter("prepare_prefix", prefix)

    async def sweep_orphans(self, owned_upload_ids: set[str], grace_s: float) -> int:
        self._enter("sweep_orphans", "")
        return 0

    async def aclose(self) -> None:
        self.closed = True
