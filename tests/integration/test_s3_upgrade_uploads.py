"""A multipart upload an older version began, found in the journal after an upgrade."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.seaweedfs import SeaweedFS
from tests.integration.test_s3_backend import (
    PREFIX,
    RecordingUploadLog,
    dest_config,
    read_all,
    uploads,
)

MiB = 1 << 20
# Parts sent from bytes in this process (as test_s3_backend).
pytestmark = pytest.mark.filterwarnings(
    "ignore:Sending a large body directly with raw bytes:ResourceWarning")


@pytest.mark.s3
@pytest.mark.asyncio
async def test_an_older_versions_crc32_upload_with_no_part_journalled_is_begun_again(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any) -> None:
    # An older version created its uploads with ChecksumAlgorithm=CRC32; stopped for the
    # upgrade before its first part was journalled, the journal names the upload and no
    # part. Resumed, this version's CRC64NVME parts went to an upload that takes only CRC32
    # ones (AWS: "the checksum algorithm must be the same for all parts and match the
    # CreateMultipartUpload"), and its FULL_OBJECT complete to a COMPOSITE upload.
    backend = backends(dest_config(s3_bucket, seaweedfs.endpoint_url, part_size_bytes=5 * MiB,
                                   multipart_threshold_bytes=5 * MiB))
    shard = staged(11 * MiB, seed=81)
    old = seaweedfs.client().create_multipart_upload(
        Bucket=s3_bucket, Key=f"{PREFIX}/job/x", ChecksumAlgorithm="CRC32")["UploadId"]
    log = RecordingUploadLog(old, {})

    assert await backend.put_file("job/x", shard.fd, shard.size, upload_log=log) == shard.checksum
    begun = log.ops("begun")
    assert len(begun) == 1 and begun[0][1] != old
    assert await read_all(backend, "job/x") == shard.data
    assert uploads(seaweedfs, s3_bucket) == []  # the older one aborted, not left behind
