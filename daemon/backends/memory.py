"""An in-memory destination that records every call and injects faults: ``memory://name``.

Tests use it where a real destination cannot show what they need: a failure on the third
upload, a drain held mid-flight, a slow link, two nodes stopped at exact points of the commit
protocol (:meth:`MemoryBackend.hold`), or many seeded interleavings of concurrent calls
(``interleave``). Its semantics match the real backends: a key appears only complete, an
exclusive create fails on an existing key, listing is sorted.

``MemoryBackend.named(uri, node_id)`` returns backends sharing one store per URI, so two
daemons in one process (two "nodes") see the same bucket, as they would on S3 or Lustre.
"""

from __future__ import annotations

import asyncio
import builtins
import os
import random
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

from ckptdrain.client.manifest import MAX_RECORD_BYTES
from ckptdrain.daemon import checksums
from ckptdrain.daemon.backends.base import Backend, BackendError, Flow, ObjectInfo, UploadLog
from ckptdrain.daemon.backends.collision import check_replaced, settle_existing

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
        "stat",
        "list_dirs",
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
    # The checksum recorded with each object at its creation, as S3 metadata or a POSIX
    # xattr is; a test removes one to stand for an object an older version wrote.
    checksums: dict[str, str] = field(default_factory=dict)
    # Called with (key, bytes) at the instant each object is stored: a test's exact record of
    # the order of writes to one key (LATEST), which call records cannot give.
    on_write: Callable[[str, bytes], None] | None = None


class Hold:
    """Calls of one op held at their start until :meth:`release` (see MemoryBackend.hold)."""

    def __init__(self, op: str, key_contains: str, times: int) -> None:
        self.op = op
        self.key_contains = key_contains
        self.remaining = times
        # Set when the first held call arrives: the caller is now stopped at that point.
        self.reached = asyncio.Event()
        self._open = asyncio.Event()

    def release(self) -> None:
        self._open.set()

    async def wait_reached(self, timeout_s: float = DEFAULT_GATE_TIMEOUT_S) -> None:
        """Until a call is held here; a test whose call never comes fails, not hangs."""
        async with asyncio.timeout(timeout_s):
            await self.reached.wait()


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
        interleave: random.Random | None = None,
    ) -> None:
        self.uri = uri
        self.node_id = node_id
        self.store = store if store is not None else MemoryStore()
        # (op, key) of this backend's calls, in order, faults included.
        self.calls: list[tuple[str, str]] = []
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self.gate_timeout_s = gate_timeout_s
        self._faults: list[_Fault] = []
        self._holds: list[Hold] = []
        # With a seeded generator, every call yields to the event loop a random number of
        # times before and after its effect: concurrent callers interleave differently per
        # seed, as requests to a real destination would, and a failing seed replays exactly.
        self.interleave = interleave
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

    def hold(self, op: str, key_contains: str = "", times: int = 1) -> Hold:
        """Stop the next ``times`` calls of ``op`` on keys containing ``key_contains`` just
        after they are recorded and before they take effect, until ``release()``: the way to
        stop one node between two steps of a protocol while another acts."""
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; use one of {sorted(OPS)}")
        if times < 1:
            raise ValueError(f"times must be >= 1, not {times}")
        held = Hold(op, key_contains, times)
        self._holds.append(held)
        return held

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

    async def _gate(self, op: str, key: str) -> None:
        """The yield points every call passes before its effect: holds, then interleaving."""
        for held in self._holds:
            if held.op == op and held.key_contains in key and held.remaining > 0:
                held.remaining -= 1
                held.reached.set()
                try:
                    async with asyncio.timeout(self.gate_timeout_s):
                        await held._open.wait()
                except TimeoutError as exc:
                    raise BackendError(
                        f"{op} {key} was held for {self.gate_timeout_s}s; call release()",
                        transient=True,
                        kind="timeout",
                    ) from exc
                break
        await self._yield()

    async def _yield(self) -> None:
        if self.interleave is not None:
            for _ in range(self.interleave.randrange(3)):
                await asyncio.sleep(0)

    async def _throttle(self, nbytes: int) -> None:
        if self.bandwidth_bytes_per_s:
            await asyncio.sleep(nbytes / self.bandwidth_bytes_per_s)

    # --- Backend ----------------------------------------------------------------------------

    async def put_file(
        self, key: str, fd: int, size: int, *, upload_log: UploadLog | None = None,
        flow: Flow | None = None,
    ) -> str:
        del upload_log
        self._enter("put_file", key)
        await self._gate("put_file", key)
        try:
            async with asyncio.timeout(self.gate_timeout_s):
                await self._open.wait()
        except TimeoutError as exc:
            raise BackendError(
                f"put_file {key} was paused for {self.gate_timeout_s}s; call resume()",
                transient=True,
                kind="timeout",
            ) from exc
        digest = checksums.new()
        chunks: list[bytes] = []
        offset = 0
        while offset < size:
            want = min(_READ_BYTES, size - offset)
            if flow is not None:
                await flow.pace(want)
            chunk = await asyncio.to_thread(os.pread, fd, want, offset)
            if not chunk:
                raise BackendError(
                    f"source of {key} ended at byte {offset} of {size}", kind="integrity"
                )
            digest.update(chunk)
            chunks.append(chunk)
            offset += len(chunk)
            await self._throttle(len(chunk))
            if flow is not None:
                flow.moved(len(chunk))
        data = b"".join(chunks)
        checksum = digest.value()
        # Created in one step at the end: a failed or cancelled put leaves nothing. The check
        # and the store run without an await between them: an atomic create-if-absent.
        if key not in self.store.objects:
            self._store(key, data, checksum)
            await self._yield()
            return checksum
        existing = self._info(key, self.store.objects[key], with_checksum=True)
        if await settle_existing(self, key, size, checksum, existing):
            return checksum
        self._store(key, data, checksum)
        await check_replaced(self, key, size, checksum)
        return checksum

    async def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False) -> bool:
        self._enter("put_bytes", key)
        await self._gate("put_bytes", key)
        if exclusive and key in self.store.objects:
            return False
        self._store(key, bytes(data), checksums.of_bytes(data))
        await self._yield()
        return True

    async def get_bytes(self, key: str, *, max_bytes: int = MAX_RECORD_BYTES) -> bytes | None:
        self._enter("get_bytes", key)
        await self._gate("get_bytes", key)
        data = self.store.objects.get(key)
        if data is not None and len(data) > max_bytes:
            raise BackendError(
                f"{key} is {len(data)} bytes, over the {max_bytes}-byte limit", kind="integrity"
            )
        return data

    async def list(self, prefix: str) -> builtins.list[ObjectInfo]:
        self._enter("list", prefix)
        await self._gate("list", prefix)
        return [
            self._info(key, data)
            for key, data in sorted(self.store.objects.items())
            if key.startswith(prefix)
        ]

    async def stat(self, key: str, *, checksum: bool = True) -> ObjectInfo | None:
        self._enter("stat", key)
        await self._gate("stat", key)
        data = self.store.objects.get(key)
        return None if data is None else self._info(key, data, with_checksum=checksum)

    async def list_dirs(self, prefix: str) -> builtins.list[str]:
        self._enter("list_dirs", prefix)
        await self._gate("list_dirs", prefix)
        names = {
            rest.partition("/")[0]
            for key in self.store.objects
            if key.startswith(prefix) and "/" in (rest := key[len(prefix) :])
        }
        return sorted(names)

    async def read_chunks(self, key: str, *, chunk_bytes: int = 8 << 20) -> AsyncGenerator[bytes, None]:
        self._enter("read_chunks", key)
        await self._gate("read_chunks", key)
        data = self.store.objects.get(key)
        if data is None:
            raise BackendError(f"{key} does not exist", kind="integrity")
        for start in range(0, len(data), chunk_bytes):
            chunk = data[start : start + chunk_bytes]
            await self._throttle(len(chunk))
            yield chunk

    async def delete(self, key: str) -> None:
        self._enter("delete", key)
        await self._gate("delete", key)
        self.store.objects.pop(key, None)
        self.store.modified.pop(key, None)
        self.store.checksums.pop(key, None)
        await self._yield()

    async def prepare_prefix(self, prefix: str) -> None:
        self._enter("prepare_prefix", prefix)
        await self._gate("prepare_prefix", prefix)

    async def sweep_orphans(self, owned_upload_ids: set[str], grace_s: float) -> int:
        self._enter("sweep_orphans", "")
        await self._gate("sweep_orphans", "")
        return 0

    async def aclose(self) -> None:
        self.closed = True

    def _store(self, key: str, data: bytes, checksum: str) -> None:
        self.store.objects[key] = data
        self.store.modified[key] = self.store.clock()
        self.store.checksums[key] = checksum
        if self.store.on_write is not None:
            self.store.on_write(key, data)

    def _info(self, key: str, data: bytes, *, with_checksum: bool = False) -> ObjectInfo:
        return ObjectInfo(
            key=key,
            size=len(data),
            modified=self.store.modified.get(key),
            checksum=self.store.checksums.get(key) if with_checksum else None,
        )
