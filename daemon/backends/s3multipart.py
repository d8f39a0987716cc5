"""The multipart half of the S3 destination: sending an object as parts, resuming an
interrupted upload from its journal, completing it (create-once with ``If-None-Match: *``),
and aborting uploads that can no longer complete, including those a dead process left.

A multipart upload is resumable through the :class:`UploadLog` journal, and it is aborted where
it is created when it can no longer complete: on a permanent failure, on cancellation (but for
the daemon's own stop, which leaves a journalled upload to the next start), or on any failure
when there is no journal to resume it from. The abort waits for in-flight parts
first and then checks that nothing is left, because a part that lands after an abort keeps its
bytes (and its bill).

:class:`MultipartUploads` is a base of :class:`~ckptdrain.daemon.backends.s3.S3Backend`, on
the client plumbing of :class:`~ckptdrain.daemon.backends.s3client.S3Client`.
"""

from __future__ import annotations

import asyncio
import builtins
import datetime as dt
import logging
from typing import Any

from ckptdrain.daemon import checksums
from ckptdrain.daemon.backends.base import BackendError, Flow, UploadLog
from ckptdrain.daemon.backends.s3client import S3Client
from ckptdrain.daemon.backends.s3errors import S3Failure, first_cause
from ckptdrain.daemon.backends.s3parts import (
    ABORT_ROUNDS,
    MAX_PARTS,
    UploadInfo,
    crc64_header,
    multipart_etag,
    part_checksum,
    part_crc,
    part_plan,
    same_etag,
)
from ckptdrain.daemon.backends.s3senders import Part
from ckptdrain.daemon.logs import log_event

log = logging.getLogger(__name__)

# What becomes of an upload whose abort could not be confirmed: one the daemon's journal holds
# is tried again (the daemon owes its abort); any other is the orphan sweep's, after its grace.
JOURNALLED = "journalled: tried again once the destination answers"
UNJOURNALLED = "left to the orphan sweep and the lifecycle rule"


class MultipartUploads(S3Client):
    """Multipart uploads, resumption, aborts and the orphan sweep (a base of S3Backend)."""

    stopping: bool  # Backend.stopping, of the S3Backend this is a base of

    async def _upload(
        self, key: str, full: str, fd: int, size: int, upload_log: UploadLog | None,
        metadata: dict[str, str], *, exclusive: bool, flow: Flow | None = None,
    ) -> tuple[str, bool]:
        """Send ``size`` bytes of ``fd`` to ``full`` as a multipart upload: (the CRC64NVME
        checksum of the bytes, created). With ``exclusive`` the Complete carries ``If-None-Match: *``; created
        is False when another object took the key meanwhile: this upload is then aborted and
        nothing was written. ``metadata`` applies to a new upload (a resumed one keeps its own).
        """
        part_size, count = part_plan(size, self._part_size)
        upload_id, kept = await self._resume(key, full, upload_log, part_size, size)
        new = upload_id is None
        if upload_id is None:
            created = await self._small(
                f"starting the upload of {key}", "create_multipart_upload",
                Bucket=self.bucket, Key=full, ChecksumAlgorithm="CRC64NVME",
                ChecksumType="FULL_OBJECT", Metadata=metadata,
            )
            upload_id = str(created["UploadId"])
        # Cleanup is registered here, where the upload exists.
        self._live_uploads.add(upload_id)
        done = False
        resumable = False
        try:
            if new and upload_log is not None:
                await upload_log.begun(upload_id)
            parts, checksum = await self._send_parts(
                key, full, fd, size, part_size, count, upload_id, kept, upload_log, flow
            )
            completed = await self._complete(key, full, upload_id, parts, checksum,
                                             exclusive=exclusive)
            if not completed:
                await self._abort(key, full, upload_id)
            done = True
            if upload_log is not None:
                await upload_log.finished()
        except BackendError as exc:
            # With a journal, a transient failure leaves the upload for the next attempt to
            # resume (ListParts); without one nothing could, so it is aborted like the rest.
            resumable = exc.transient and upload_log is not None
            raise
        except asyncio.CancelledError:
            # Cancelled by the daemon stopping, not by an abort: the journalled upload is the
            # next start's to resume (a graceful restart had aborted it, and every part was
            # sent again; a kill -9 kept it).
            resumable = self.stopping and upload_log is not None
            raise
        finally:
            self._live_uploads.discard(upload_id)
            if not done and not resumable:
                await self._abort(key, full, upload_id)
        return checksum, completed

    async def _resume(
        self, key: str, full: str, upload_log: UploadLog | None, part_size: int, size: int
    ) -> tuple[str | None, dict[int, tuple[str, str]]]:
        """The journalled upload id and the parts that need not be sent again, or (None, {})
        when there is nothing to resume."""
        if upload_log is None:
            return None, {}
        upload_id, journal = await upload_log.load()
        if upload_id is None:
            return None, {}
        on_server = await self._list_parts(key, full, upload_id)
        if on_server is None:
            log_event(log, logging.INFO, "s3_upload_gone", key=key, upload_id=upload_id)
            return None, {}
        if not journal or any(part_crc(checksum) is None for _, checksum in journal.values()):
            # Begun by an older version with another part checksum (CRC32): that upload cannot
            # take CRC64NVME parts, so it is given up and a new one begun. So is one with no
            # part journalled, whose checksum nothing here tells: an older version's, stopped
            # for the upgrade before its first part, failed every CRC64NVME part sent to it
            # ("InvalidRequest", found attacking upgrades), and nothing of it would be kept.
            await self._abort(key, full, upload_id)
            return None, {}
        kept: dict[int, tuple[str, str]] = {}
        for number, (etag, checksum) in journal.items():
            expected = min(part_size, size - (number - 1) * part_size)
            found = on_server.get(number)
            if found is not None and same_etag(found[0], etag) and found[1] == expected:
                kept[number] = (etag, checksum)
        log_event(log, logging.INFO, "s3_upload_resumed", key=key, upload_id=upload_id,
                  parts_kept=len(kept))
        return upload_id, kept

    async def _send_parts(
        self, key: str, full: str, fd: int, size: int, part_size: int, count: int,
        upload_id: str, kept: dict[int, tuple[str, str]], upload_log: UploadLog | None,
        flow: Flow | None,
    ) -> tuple[list[tuple[int, str, int]], str]:
        """Send every part not ``kept`` (unchanged on the server), ``max_concurrency`` at a
        time, through the part sender (this loop, or worker processes); returns
        [(number, etag, crc64nvme)] in order and the object's CRC64NVME, combined from its
        parts'. Bytes are paced and counted per part (``flow``)."""
        results: dict[int, tuple[str, int]] = {}
        # Two bounds: ``window`` keeps this shard's tasks few (it is this call's own, so a slot
        # a cancelled task never gave back goes with it); ``self.bodies`` bounds the bodies in
        # flight across all shards, and is only ever held inside ``async with`` in the task
        # that sends, so no way out of this call can keep one.
        window = asyncio.Semaphore(self._concurrency)

        async def send(part: Part) -> None:
            try:
                async with self.bodies:
                    if flow is not None and part.kept_crc is None:
                        await flow.pace(part.length)
                    sent = await self.parts.send(part, fd)
            except S3Failure as exc:
                if exc.code != "NoSuchUpload":
                    raise
                # Removed at the destination while its parts were sent: the staged copy is
                # intact, so the next attempt (within drain.retry_budget_s) finds it gone
                # (ListParts) and begins a new upload. As a permanent not_found it failed the
                # generation for good.
                raise self._vanished(key, "while it was sent") from exc
            finally:
                window.release()
            results[part.number] = (sent.etag, sent.crc)
            if sent.uploaded and upload_log is not None:
                await upload_log.part_done(part.number, sent.etag, part_checksum(sent.crc))
            if flow is not None:
                flow.moved(part.length)

        try:
            async with asyncio.TaskGroup() as tg:
                for number in range(1, count + 1):
                    offset = (number - 1) * part_size
                    length = min(part_size, size - offset)
                    old = kept.get(number)
                    part = Part(key=key, full=full, upload_id=upload_id, number=number,
                                offset=offset, length=length,
                                kept_crc=part_crc(old[1]) if old is not None else None,
                                kept_etag=old[0] if old is not None else "")
                    await window.acquire()
                    tg.create_task(send(part), name=f"s3-part-{number}")
        except BaseExceptionGroup as group:
            raise first_cause(group) from None
        lengths = [min(part_size, size - (n - 1) * part_size) for n in range(1, count + 1)]
        checksum = checksums.combine(
            [(results[n][1], lengths[n - 1]) for n in range(1, count + 1)])
        return [(n, *results[n]) for n in range(1, count + 1)], checksum

    async def _complete(
        self, key: str, full: str, upload_id: str, parts: list[tuple[int, str, int]],
        checksum: str, *, exclusive: bool,
    ) -> bool:
        """Complete the upload; False when ``exclusive`` and another object holds the key."""
        listing = [
            {"PartNumber": n, "ETag": etag, "ChecksumCRC64NVME": crc64_header(crc)}
            for n, etag, crc in parts
        ]
        expected = multipart_etag([etag for _, etag, _ in parts])
        # The whole object's CRC64NVME, which the server checks against the parts it holds
        # and stores as the object's full-object checksum (what HeadObject answers).
        params: dict[str, Any] = {"Bucket": self.bucket, "Key": full, "UploadId": upload_id,
                                  "MultipartUpload": {"Parts": listing},
                                  "ChecksumCRC64NVME": checksums.s3_header(checksum),
                                  "ChecksumType": "FULL_OBJECT"}
        if exclusive:
            params["IfNoneMatch"] = "*"
        try:
            # botocore turns an error inside a 200 answer to Complete into a retried 500.
            await self._small(f"completing the upload of {key}", "complete_multipart_upload",
                             **params)
            return True
        except S3Failure as exc:
            if exc.code == "InvalidPart":
                # An ETag the server answered for a part is not the part's: a corrupted
                # answer, or a gateway rewriting ETags. Not another writer (the conflict it
                # was classed as failed the generation for good, found attacking): the next
                # attempt resumes the upload, and ListParts shows which parts to send again.
                raise S3Failure(
                    f"completing the upload of {key} at {self.uri}: the server did not take "
                    "a part's ETag as the one it answered for that part (a corrupted answer, "
                    "or a proxy or gateway rewriting ETags); the part is sent again while "
                    "drain.retry_budget_s lasts. If this repeats, check what stands between "
                    "this node and the endpoint",
                    transient=True, kind="io", code=exc.code, status=exc.status) from exc
            taken = exc.code == "PreconditionFailed" or exc.status == 412
            if exc.code != "NoSuchUpload" and not taken:
                raise
            # A retried Complete whose first try succeeded finds the upload gone, or (on some
            # stores) the key taken: the object is ours if its ETag is the one these parts make.
            head = await self._head(key, full) or {}
            if same_etag(str(head.get("ETag", "")), expected):
                if taken and await self._list_parts(key, full, upload_id) is not None:
                    # These very bytes are there, but an identical upload's, not ours (ours
                    # would be gone): this one, left open by the refused Complete, must go.
                    await self._abort(key, full, upload_id)
                return True
            if taken:
                return False
            raise self._vanished(key, "before it completed") from exc

    def _vanished(self, key: str, when: str) -> S3Failure:
        """The transient failure of an upload that was removed at the destination ``when``:
        the next attempt begins a new one and sends every part again (a shard whose upload
        is removed every time fails once drain.retry_budget_s is spent, with this)."""
        return S3Failure(
            f"the multipart upload of {key} at {self.uri} was removed at the destination "
            f"{when} (another node's orphan sweep, a lifecycle rule that aborts incomplete "
            "uploads, or an operator's abort?); a new upload is begun, every part sent "
            "again, while drain.retry_budget_s lasts. If this repeats, raise "
            "destination.orphan_grace_s on every node sharing the bucket, and the lifecycle "
            "rule's DaysAfterInitiation, above the longest upload",
            transient=True, kind="not_found", code="NoSuchUpload")

    async def abort_upload(self, key: str, upload_log: UploadLog) -> bool:
        upload_id, _ = await upload_log.load()
        if upload_id is None:
            return True
        # The journal keeps the upload's row until its abort is confirmed: the daemon owes
        # the abort and tries it again (owedaborts.py).
        if await self._abort(key, self._key(key), upload_id, then=JOURNALLED):
            await upload_log.finished()
            return True
        return False

    async def _abort(self, key: str, full: str, upload_id: str, *,
                     then: str = UNJOURNALLED) -> bool:
        """Abort and confirm nothing is left; False (and a log line saying ``then``) when that
        could not be done."""
        aborted = False
        try:
            async with asyncio.timeout(self.cleanup_timeout_s):
                for _ in range(ABORT_ROUNDS):
                    try:
                        await self._small(f"aborting the upload of {key}",
                                         "abort_multipart_upload", Bucket=self.bucket,
                                         Key=full, UploadId=upload_id)
                        aborted = True
                    except S3Failure as exc:
                        if exc.code != "NoSuchUpload":
                            raise
                    # A part in flight during the abort can land after it and bring the
                    # upload back on some stores: look, and abort again if so.
                    if await self._list_parts(key, full, upload_id) is None and not any(
                        u.upload_id == upload_id for u in await self._list_uploads(full)
                    ):
                        if aborted:
                            self.aborted_uploads += 1
                        log_event(log, logging.INFO, "s3_upload_aborted", key=key,
                                  upload_id=upload_id)
                        return True
        except (BackendError, TimeoutError) as exc:
            log_event(log, logging.WARNING, "s3_abort_failed", key=key, upload_id=upload_id,
                      error=str(exc) or "timed out", action=then)
            if aborted:
                self.aborted_uploads += 1
            return False
        log_event(log, logging.WARNING, "s3_abort_unconfirmed", key=key, upload_id=upload_id,
                  action=then)
        if aborted:
            self.aborted_uploads += 1
        return False

    async def _list_parts(
        self, key: str, full: str, upload_id: str
    ) -> dict[int, tuple[str, int]] | None:
        """number -> (etag, size) of the parts on the server; None when the upload is gone."""
        found: dict[int, tuple[str, int]] = {}
        marker = 0
        for _ in range(MAX_PARTS):
            params: dict[str, Any] = {"Bucket": self.bucket, "Key": full, "UploadId": upload_id,
                                      "MaxParts": self.list_page_size}
            if marker:
                params["PartNumberMarker"] = marker
            try:
                page = await self._small(f"listing the parts of {key}", "list_parts", **params)
            except S3Failure as exc:
                if exc.code == "NoSuchUpload":
                    return None
                raise
            for part in page.get("Parts", []):
                found[int(part["PartNumber"])] = (str(part["ETag"]), int(part["Size"]))
            following = int(page.get("NextPartNumberMarker") or 0)
            if not page.get("IsTruncated") or following <= marker:
                break
            marker = following
        return found

    async def _list_uploads(self, prefix: str) -> builtins.list[UploadInfo]:
        """Every incomplete upload whose key starts with ``prefix`` (a full key prefix)."""
        found: dict[str, UploadInfo] = {}
        key_marker: str | None = None
        id_marker: str | None = None
        while True:
            params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix,
                                      "MaxUploads": self.list_page_size}
            if key_marker:
                params["KeyMarker"] = key_marker
            if id_marker:
                params["UploadIdMarker"] = id_marker
            page = await self._small("listing multipart uploads", "list_multipart_uploads",
                                     **params)
            for upload in page.get("Uploads", []):
                info = UploadInfo(str(upload["Key"]), str(upload["UploadId"]),
                                  upload.get("Initiated"))
                found[info.upload_id] = info
            if not page.get("IsTruncated"):
                break
            # AWS returns both markers; SeaweedFS pages by upload id alone (no NextKeyMarker).
            next_key = page.get("NextKeyMarker") or None
            next_id = page.get("NextUploadIdMarker") or None
            if (next_key, next_id) == (key_marker, id_marker) or not (next_key or next_id):
                raise S3Failure(
                    f"listing multipart uploads at {self.uri} did not advance past "
                    f"{key_marker!r}/{id_marker!r}; the server's paging is broken",
                    transient=True, kind="io",
                )
            key_marker, id_marker = next_key, next_id
        return list(found.values())

    async def sweep_orphans(self, owned_upload_ids: set[str], grace_s: float) -> int:
        """Abort uploads under the root that are neither owned (journalled) nor open in this
        process and were initiated more than ``grace_s`` ago."""
        prefix = f"{self.root}/" if self.root else ""
        now = dt.datetime.now(dt.UTC)
        aborted = 0
        for upload in await self._list_uploads(prefix):
            if upload.upload_id in owned_upload_ids or upload.upload_id in self._live_uploads:
                continue
            if grace_s > 0:
                if upload.initiated is None:
                    continue
                initiated = upload.initiated
                if initiated.tzinfo is None:
                    initiated = initiated.replace(tzinfo=dt.UTC)
                if (now - initiated).total_seconds() <= grace_s:
                    continue
            try:
                await self._small(f"aborting orphaned upload of {upload.key}",
                                  "abort_multipart_upload", Bucket=self.bucket, Key=upload.key,
                                  UploadId=upload.upload_id)
            except S3Failure as exc:
                if exc.code != "NoSuchUpload":
                    raise
                continue
            aborted += 1
            self.aborted_uploads += 1
            log_event(log, logging.INFO, "s3_orphan_aborted", key=upload.key,
                      upload_id=upload.upload_id, initiated=str(upload.initiated))
        return aborted
