"""The S3 worker pools: the daemon's ``drain.workers`` upload processes (s3worker.py) that
send shard bodies and every small request the daemon makes (s3senders.SMALL_OPERATIONS), and
``ckptdrain restore --readers``, processes of the same program that read ranges into the
restored file (:meth:`WorkerSenders.fetch`). The messages they exchange are s3messages.py; each
process, its socket and its end are s3procs.py.

A request to a worker carries a duplicate of the staged file's fd (SCM_RIGHTS), so the daemon
may close its own fd at any time; the worker closes its copy when the part is done. Each worker
is owned by the pool: started with the backend (or on first use), restarted after it dies (what
it had in flight fails as a transient error, which the drain retries and the upload journal
resumes), and stopped with the backend. A cancelled send tells the worker to cancel the part
and waits for its answer, so no part is still in flight when the caller aborts its upload.

Which worker processes run (starting one in each of the pool's slots, replacing a lost one,
stopping them all) is s3slots.py's :class:`WorkerSlots`, which :class:`WorkerSenders` builds on.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.backends.s3errors import S3Failure
from ckptdrain.daemon.backends.s3messages import (
    INLINE_MESSAGE_BYTES,
    MESSAGE_FD_MAX_BYTES,
    close_all,
    encode,
    failure_from,
    failure_of_one,
    malformed,
    memfd_of,
    read_memfd,
)
from ckptdrain.daemon.backends.s3parts import READ_DRAIN_TIMEOUT_S
from ckptdrain.daemon.backends.s3procs import (
    START_GRACE_S,
    WORKER_LOST,
    WorkerProcess,
    settled,
)
from ckptdrain.daemon.backends.s3ranges import MIN_RANGE_BYTES_PER_S, Range
from ckptdrain.daemon.backends.s3senders import (
    BATCH_AT_ONCE,
    BATCHED_OPERATIONS,
    SMALL_OPERATIONS,
    InProcessSender,
    Part,
    PartSender,
    Put,
    Sent,
    Whole,
    from_message,
)
from ckptdrain.daemon.backends.s3slots import WorkerSlots
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.threads import outlast

if TYPE_CHECKING:
    from ckptdrain.daemon.backends.s3client import S3Client
    from ckptdrain.daemon.config import DestinationConfig

log = logging.getLogger(__name__)

# How long a cancelled range waits for its reader to say it gave the range up, before the
# reader is killed (an upload worker's part waits READ_DRAIN_TIMEOUT_S: its read thread).
READER_CANCEL_TIMEOUT_S = 5.0
# How long a request waits for room in its worker's socket before the worker is taken for
# stuck; one still starting reads nothing before it has (s3procs.START_GRACE_S).
SEND_TIMEOUT_S = 10.0
# Requests that only read, sent once more when their worker is lost (writes are the drain's to
# retry: it knows whether a create-once write landed).
_RESENT_WHEN_LOST = frozenset({"head_object", "get_object", "list_objects_v2", "list_parts",
                               "list_multipart_uploads"})


class WorkerSenders(WorkerSlots, PartSender):
    """Parts sent (``role`` "upload") or ranges read (``role`` "reader") by ``count`` worker
    processes, each request to the least busy one."""

    def __init__(self, client: S3Client, config: DestinationConfig, node_id: str,
                 count: int, *, role: str = "upload") -> None:
        super().__init__(config, node_id, count, role=role)
        self._client = client
        self._ids = itertools.count(1)
        # Longest wait for one part's answer: botocore's own retries are bounded by these, so a
        # worker that answers nothing for longer is stuck and is replaced.
        self._answer_timeout_s = config.max_attempts * (
            float(config.connect_timeout_s) + float(config.read_timeout_s) + 60.0)

    async def send(self, part: Part, fd: int) -> Sent:
        reply, fds = await self._request(
            {"op": "part", "key": part.key, "full": part.full, "upload_id": part.upload_id,
             "number": part.number, "offset": part.offset, "length": part.length,
             "kept_crc": part.kept_crc, "kept_etag": part.kept_etag},
            [fd], f"part {part.number} of {part.key}")
        close_all(fds)
        with malformed(f"part {part.number} of {part.key}"):
            return Sent(str(reply["etag"]), int(reply["crc"]),
                        uploaded=bool(reply["uploaded"]))

    async def put(self, whole: Whole, fd: int) -> Put:
        reply, fds = await self._request(
            {"op": "put", "key": whole.key, "full": whole.full, "size": whole.size,
             "metadata": whole.metadata, "exclusive": whole.exclusive}, [fd], whole.key)
        close_all(fds)
        with malformed(whole.key):
            return Put(int(reply["crc"]), str(reply.get("etag") or ""))

    async def fetch(self, rng: Range, fd: int, *, on_loop: bool,
                    lane: int | None = None) -> int:
        """Have a reader read ``rng`` into the file ``fd`` at its offset (the caller keeps
        owning ``fd``): its CRC64NVME. ``on_loop``: written by the reader's loop thread
        (s3ranges.writer). ``lane``: ranges given the same lane go to the same reader."""
        request = {"op": "range", "key": rng.key, "full": rng.full, "offset": rng.offset,
                   "length": rng.length, "etag": rng.etag, "on_loop": on_loop}
        what = f"reading {rng.key} at byte {rng.offset}"
        # A range's answer comes when all of it is read: its bound grows with its length (a
        # 5 GiB part over a slow link is not a stuck worker), and is later than the range's
        # own (s3ranges.fetch_range), whose error then comes first.
        timeout_s = self._answer_timeout_s + rng.length / MIN_RANGE_BYTES_PER_S
        # A range is read again by a fresh reader when its own died: the same bytes (of the
        # same ETag) written at the same offset, once the dead one has exited, so that no
        # write of its lands after this one's. Each loss is another worker's (a lost one is
        # replaced), and readers killed together may fail it as many times.
        for attempt in itertools.count(1):
            try:
                reply, fds = await self._request(request, [fd], what, timeout_s, lane)
                break
            except S3Failure as exc:
                if exc.code != WORKER_LOST or attempt > self._count:
                    raise
                await self._reap(exc)
        close_all(fds)
        with malformed(what):
            return int(reply["crc"])

    async def call(self, what: str, operation: str, params: dict[str, Any], *,
                   body: bytes | None = None, read_max: int | None = None) -> dict[str, Any]:
        if operation not in SMALL_OPERATIONS:
            raise ValueError(f"{operation} is not one of the requests workers send")
        return await self._small({"op": "call", "what": what, "operation": operation,
                                  "params": params, "read_max": read_max,
                                  "body": body is not None}, body, read_max)

    async def call_many(self, what: str, operation: str,
                        params: list[dict[str, Any]]) -> list[dict[str, Any] | S3Failure]:
        if operation not in BATCHED_OPERATIONS:
            raise ValueError(f"{operation} is not sent in batches")
        # A batch goes in rounds of BATCH_AT_ONCE: its answer may take that many requests'
        # time (a stalled endpoint must not get a healthy worker replaced).
        rounds = max(1, -(-len(params) // BATCH_AT_ONCE))
        answer = await self._small({"op": "call", "what": what, "operation": operation,
                                    "params": params, "many": True}, None, None,
                                   timeout_s=rounds * self._answer_timeout_s)
        with malformed(what):
            results = answer["results"]
            if not isinstance(results, list) or len(results) != len(params):
                raise ValueError(f"{len(params)} requests, answers {results!r:.80}")
            return [failure_of_one(r["error"]) if "error" in r else dict(r["answer"])
                    for r in results]

    async def _small(self, request: dict[str, Any], body: bytes | None,
                     read_max: int | None, *, timeout_s: float | None = None) -> dict[str, Any]:
        """Send one small request (a call or a batch of them) to a worker: its answer."""
        what, operation = str(request["what"]), str(request["operation"])
        fds: list[int] = []
        try:
            if body is not None:
                fds.append(await memfd_of(body))
            encoded = encode(request)
            if len(encoded) > INLINE_MESSAGE_BYTES:
                if body is not None:
                    raise ValueError(f"{what}: a request with a body has parameters too long "
                                     "for one message")
                fds.append(await memfd_of(encoded))  # a Complete of thousands of parts
                request = {"op": "call", "spilled": True}
            try:
                reply, got = await self._request(request, fds, what, timeout_s)
            except S3Failure as exc:
                # A read is sent once more to a fresh worker: a client's `latest` or `wait`
                # must not fail because a worker died (the in-process client's own retries
                # covered the same moment). A write is retried by the drain that owns it.
                if exc.code != WORKER_LOST or operation not in _RESENT_WHEN_LOST:
                    raise
                reply, got = await self._request(request, fds, what, timeout_s)
        finally:
            close_all(fds)  # the worker holds its own copies (SCM_RIGHTS) once sent
        try:
            return await self._answer_of(reply, got, what, read_max)
        finally:
            close_all(got)

    @staticmethod
    async def _answer_of(reply: dict[str, Any], fds: list[int], what: str,
                         read_max: int | None) -> dict[str, Any]:
        """A call's answer, from its message and the memfds that came with it."""
        with malformed(what):
            if "answer_fd" in reply:
                message = json.loads(await read_memfd(fds[int(reply["answer_fd"])],
                                                      MESSAGE_FD_MAX_BYTES))
            else:
                message = reply["answer"]
            answer = from_message(dict(message))
            if read_max is not None:
                answer["Body"] = await read_memfd(fds[int(reply["body_fd"])], read_max)
        return answer

    async def _request(self, body: dict[str, Any], fds: list[int], what: str,
                       timeout_s: float | None = None,
                       lane: int | None = None) -> tuple[dict[str, Any], list[int]]:
        """Send one request with ``fds`` (the caller keeps owning them); its answer (within
        ``timeout_s``, one request's bound by default) and the fds that came with it, owned
        by the caller from then on."""
        answer_timeout_s = self._answer_timeout_s if timeout_s is None else timeout_s
        worker = await self._worker(lane)
        request_id = next(self._ids)
        answer: asyncio.Future[tuple[dict[str, Any], list[int]]] = (
            asyncio.get_running_loop().create_future())
        worker.pending[request_id] = answer
        request = {"id": request_id, **body}
        try:
            # A worker still starting reads no request until it has: given the start's
            # grace, as its answers are (WorkerProcess.answer). Within 10 s, the requests
            # queued past the socket's few (net.unix.max_dgram_qlen) had a worker slow to
            # start on a loaded node killed as unreachable, and its next start likewise.
            send_s = (SEND_TIMEOUT_S if worker.ready else
                      max(SEND_TIMEOUT_S, START_GRACE_S - (time.monotonic() - worker.spawned)))
            await worker.send(request, fds, timeout_s=send_s)
        except (OSError, TimeoutError) as exc:
            worker.pending.pop(request_id, None)
            settled(answer)
            worker.lost(f"a request could not be sent ({exc or f'no room in {send_s:.0f} s'})")
            raise S3Failure(f"the S3 {self._role} worker {worker.index} could not be reached "
                            f"for {what}; a new one is started for the next request",
                            transient=True, kind="io", code=WORKER_LOST) from exc
        except BaseException:
            # Cancelled while the socket was full: nothing was sent, so nothing to give up.
            worker.pending.pop(request_id, None)
            settled(answer)
            raise
        try:
            reply, got = await worker.answer(answer, answer_timeout_s, self._ids)
        except TimeoutError:
            worker.lost(f"{what} got no answer in {answer_timeout_s:g} s")
            if answer.done() and not answer.cancelled():
                answer.exception()  # retrieved: the timeout is what the caller sees
            again = ("it will be sent again" if self._role == "upload"
                     else "that worker was replaced")
            # WORKER_LOST, as every other request the worker held: a read goes to a fresh
            # worker (found attacking: a stopped reader's other ranges were read again and
            # the one that timed out failed the restore).
            raise S3Failure(f"{what} got no answer from its S3 {self._role} worker in "
                            f"{answer_timeout_s:g} s; {again}", transient=True,
                            kind="timeout", code=WORKER_LOST) from None
        except asyncio.CancelledError:
            # Given up as a task this frame owns and outlasts: a second cancel (a drain's
            # timeout, then the shutdown) must not cut the give-up short, or a late answer's
            # memfds leak and a late create's upload is left to the orphan sweep.
            giving_up = asyncio.ensure_future(self._give_up(worker, request_id, answer, body))
            await outlast(giving_up)
            if not giving_up.cancelled():
                giving_up.exception()  # retrieved: the cancellation is what the caller sees
            raise
        finally:
            # Whatever arrives for this id from now on finds nobody and closes its own fds.
            worker.pending.pop(request_id, None)
        if "error" in reply:
            close_all(got)
            with malformed(what):
                failure = failure_from(reply["error"])
            raise failure
        return reply, got

    async def _give_up(self, worker: WorkerProcess, request_id: int,
                       answer: asyncio.Future[tuple[dict[str, Any], list[int]]],
                       body: dict[str, Any]) -> None:
        """A cancelled request: stop the worker's work on it, close what its answer carried,
        and undo a create that happened anyway. Bounded by the waits inside."""
        await self._cancel(worker, request_id, answer)
        if answer.done() and not answer.cancelled() and answer.exception() is None:
            late, late_fds = answer.result()
            close_all(late_fds)
            await self._undo_late_create(body, late)

    async def _undo_late_create(self, body: dict[str, Any], reply: dict[str, Any]) -> None:
        """A create whose answer came with (or after) its caller's cancellation started an
        upload nobody will record: abort it now, within the cleanup bound, rather than leave
        it to the orphan sweep (``orphan_grace_s`` later, on this node's next start)."""
        if body.get("operation") != "create_multipart_upload" or "error" in reply:
            return
        upload_id = from_message(reply.get("answer", {})).get("UploadId")
        if not upload_id:
            return
        params = {"Bucket": body["params"]["Bucket"], "Key": body["params"]["Key"],
                  "UploadId": upload_id}
        what = f"aborting the upload of {params['Key']} begun as it was cancelled"
        try:
            async with asyncio.timeout(self._client.cleanup_timeout_s):
                _, fds = await self._request({"op": "call", "what": what,
                                              "operation": "abort_multipart_upload",
                                              "params": params}, [], what)
                close_all(fds)
        except (BackendError, OSError, TimeoutError) as exc:
            log_event(log, logging.WARNING, "s3_upload_left", key=params["Key"],
                      upload_id=upload_id, error=str(exc) or type(exc).__name__)

    async def _cancel(self, worker: WorkerProcess, request_id: int,
                      answer: asyncio.Future[tuple[dict[str, Any], list[int]]]) -> None:
        """Tell the worker to give the part up and wait until it has: the caller aborts the
        upload next, and a part landing after the abort would be left on the server."""
        if answer.done():
            return
        # A reader gives a range up at its next chunk; one that does not answer within
        # seconds is stopped or stuck, and a restore's Ctrl-C must not wait a minute for it.
        wait_s = READ_DRAIN_TIMEOUT_S if self._role == "upload" else READER_CANCEL_TIMEOUT_S
        try:
            await worker.send({"cancel": request_id}, timeout_s=5.0)
            await asyncio.wait([answer], timeout=wait_s)
        except (OSError, TimeoutError):
            pass
        if not answer.done():
            worker.lost("a cancelled request did not stop")
        if answer.done() and not answer.cancelled():
            answer.exception()  # retrieved: the cancellation is what the caller sees


def open_sender(client: S3Client, config: DestinationConfig, node_id: str,
                workers: int) -> PartSender:
    if workers == 0:
        return InProcessSender(client)
    return WorkerSenders(client, config, node_id, workers)
