"""A deferred shard (DCP's .metadata) a version writing format 1 acknowledged: its part
record promised the sha256 of its bytes, and this version drains it with CRC64NVME."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.daemon.backends.memory import MemoryBackend
from ckptdrain.daemon.ledger import GenerationRecord, Ledger, ShardRecord
from ckptdrain.daemon.staging import Staging
from ckptdrain.daemon.state import RankEvent, ShardState
from tests.conftest import DaemonProcess
from tests.functional.test_scheduler import running_scheduler


def sha(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


async def deferred_of_format_1(ledger: Ledger, staging: Staging,
                               data: bytes) -> tuple[GenerationRecord, ShardRecord]:
    gen = await ledger.open_generation("dcp", 1, 1, "local", uid=0)
    await ledger.open_rank(gen, 0)
    name = staging.new_name(0)
    staging.data_path(name).write_bytes(data)
    now = time.time()
    shard = ShardRecord(id=ledger.shard_ids(), job="dcp", step=1, rank=0, path=".metadata",
                        size=len(data), staged_name=name, state=ShardState.STAGED,
                        handed_at=now, staged_at=now, deferred=True, checksum=sha(data))
    await ledger.add_shard(gen, shard)
    await ledger.apply((gen, 0), RankEvent.SEALED)
    return gen, shard


@pytest.mark.asyncio
async def test_a_deferred_shard_promised_in_sha256_drains_keeping_its_promise(
        tmp_path: Path) -> None:
    # Found attacking upgrades: the CRC64NVME of the same bytes failed the shard as "staged
    # copy changed", and the generation with it.
    async with running_scheduler(tmp_path, MemoryBackend("n0")) as (scheduler, ledger,
                                                                    staging, _):
        gen, shard = await deferred_of_format_1(ledger, staging, b"the metadata")
        assert await scheduler._drain_deferred(gen, shard), gen.error
        assert shard.state is ShardState.DRAINED
        assert shard.checksum == sha(b"the metadata")  # what the part record says


@pytest.mark.asyncio
async def test_a_deferred_shard_promised_in_sha256_whose_copy_changed_still_fails(
        tmp_path: Path) -> None:
    async with running_scheduler(tmp_path, MemoryBackend("n0")) as (scheduler, ledger,
                                                                    staging, _):
        gen, shard = await deferred_of_format_1(ledger, staging, b"the metadata")
        staging.data_path(shard.staged_name).write_bytes(b"THE METADATA")
        assert not await scheduler._drain_deferred(gen, shard)
        assert shard.state is ShardState.FAILED
        assert "staged copy changed" in shard.error


def test_an_upgrade_with_a_format_1_deferred_shard_pending_commits(make_daemon: Any) -> None:
    a: DaemonProcess = make_daemon("node-a")
    b: DaemonProcess = make_daemon("node-b")
    root = a.dest / "dcp" / f"{4:020d}"
    data = {"__0_0.distcp": b"rank zero data" * 100, ".metadata": b"the metadata"}
    with a.client().generation("dcp", 4, rank=0, world_size=2) as gen:
        gen.put("__0_0.distcp", data["__0_0.distcp"])
        gen.put(".metadata", data[".metadata"], deferred=True)
    deadline = time.monotonic() + 30
    while not (root / "_parts" / "node-a.json").exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    a.kill()
    # As the version writing format 1 left it: sha256 in its journal, its part record and
    # its drained shard's attribute.
    db = sqlite3.connect(a.staging / "journal.sqlite3")
    for path, blob in data.items():
        db.execute("UPDATE shards SET checksum = ? WHERE path = ?", (sha(blob), path))
    db.commit()
    db.close()
    os.setxattr(root / "__0_0.distcp", "user.ckptdrain.checksum",
                sha(data["__0_0.distcp"]).encode())
    record = json.loads((root / "_parts" / "node-a.json").read_bytes())
    record["format_version"] = 1
    record.pop("owner_uid", None)
    for entry in record["shards"]:
        entry["checksum"] = sha(data[entry["path"]])
    (root / "_parts" / "node-a.json").write_text(json.dumps(record))
    a.start()  # upgraded
    with b.client().generation("dcp", 4, rank=1, world_size=2) as gen:
        gen.put("__1_0.distcp", b"rank one data" * 100)
    b.client().wait("dcp", 4, timeout_s=30)
    a.client().wait("dcp", 4, timeout_s=30)
    assert (root / ".metadata").read_bytes() == data[".metadata"]
