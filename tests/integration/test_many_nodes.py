"""Several daemons (one per node) against one destination, on file:// and on S3: the shared
tier's atomic operations are the only coordination."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

from ckptdrain.client import Client
from ckptdrain.client.manifest import Manifest
from tests.conftest import DaemonProcess


@dataclass
class Destination:
    uri: str
    env: dict[str, str]
    read: Any  # (key) -> bytes | None
    keys: Any  # (prefix) -> list[str]


@pytest.fixture(params=["file", "s3"])
def destination(request: pytest.FixtureRequest, tmp_path: Any) -> Destination:
    if request.param == "file":
        root = tmp_path / "shared-dest"

        def read(key: str) -> bytes | None:
            p = root / key
            return p.read_bytes() if p.exists() else None

        def keys(prefix: str) -> list[str]:
            base = root / prefix
            return sorted(str(p.relative_to(root)) for p in base.rglob("*") if p.is_file()) if base.exists() else []

        return Destination(f"file://{root}", {}, read, keys)
    server = request.getfixturevalue("seaweedfs")
    bucket = request.getfixturevalue("s3_bucket")
    s3 = server.client()

    def read_s3(key: str) -> bytes | None:
        try:
            return s3.get_object(Bucket=bucket, Key=f"ckpt/{key}")["Body"].read()  # type: ignore[no-any-return]
        except s3.exceptions.NoSuchKey:
            return None

    def keys_s3(prefix: str) -> list[str]:
        found = s3.list_objects_v2(Bucket=bucket, Prefix=f"ckpt/{prefix}").get("Contents", [])
        return sorted(o["Key"].removeprefix("ckpt/") for o in found)

    return Destination(f"s3://{bucket}/ckpt", {"CKPTDRAIN_DESTINATION__ENDPOINT_URL": server.endpoint_url},
                       read_s3, keys_s3)


def nodes(make_daemon: Any, dest: Destination, n: int, **env: str) -> list[DaemonProcess]:
    return [make_daemon(f"node-{i}", dest=dest.uri, **(dest.env | env)) for i in range(n)]


def save(node_of_rank: list[DaemonProcess], job: str, step: int, *, barrier: threading.Barrier | None = None,
         size: int = 256 << 10) -> None:
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            with node_of_rank[r].client(timeout_s=120).generation(job, step, rank=r, world_size=len(node_of_rank)) as g:
                g.put(f"model/rank{r}.pt", os.urandom(size))
                g.put(f"optim/rank{r}.pt", os.urandom(size // 2))
                if barrier is not None:
                    barrier.wait(60)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(node_of_rank))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors


def manifest(dest: Destination, job: str, step: int) -> Manifest | None:
    data = dest.read(f"{job}/{step:020d}/MANIFEST.json")
    return None if data is None else Manifest.from_json(data)


def test_eight_ranks_over_four_daemons_commit_one_manifest(make_daemon: Any, destination: Destination) -> None:
    daemons = nodes(make_daemon, destination, 4)
    ranks = [daemons[r // 2] for r in range(8)]
    barrier = threading.Barrier(8)  # every rank seals at the same moment: the nodes race
    save(ranks, "multi", 1, barrier=barrier)
    for d in daemons:
        d.client().wait("multi", 1, timeout_s=120)
    m = manifest(destination, "multi", 1)
    assert m is not None and m.world_size == 8
    assert sorted({s.rank for s in m.shards}) == list(range(8))
    assert {s.rank: s.node for s in m.shards} == {r: f"node-{r // 2}" for r in range(8)}
    assert len(m.shards) == 16
    assert sum(k.endswith("MANIFEST.json") for k in destination.keys("multi/")) == 1
    assert len([k for k in destination.keys(f"multi/{1:020d}/_parts/")]) == 4
    def outcomes() -> list[str]:
        return [line for d in daemons for line in d.log().splitlines() if "event=generation_committed" in line]

    deadline = time.monotonic() + 10  # the log line follows the state change clients wait on
    while len(outcomes()) < 4:
        assert time.monotonic() < deadline, outcomes()
        time.sleep(0.05)
    lines = outcomes()
    assert len(lines) == 4
    assert sum("outcome=published" in line for line in lines) == 1
    assert sum("outcome=accepted" in line for line in lines) == 3


def test_a_dead_node_blocks_the_commit_until_it_returns(make_daemon: Any, destination: Destination) -> None:
    daemons = nodes(make_daemon, destination, 3)
    ranks = [daemons[r % 3] for r in range(6)]
    save(ranks, "dead", 1)
    for d in daemons:
        d.client().wait("dead", 1, timeout_s=120)
    # Step 2: node-2 cannot drain (1 B/s), then dies with its shards acknowledged.
    slow = daemons[2]
    slow.stop()
    slow.overrides["CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S"] = "1"
    slow.start()
    save(ranks, "dead", 2)
    time.sleep(1.0)
    slow.kill()
    assert manifest(destination, "dead", 2) is None
    assert Client(daemons[0].socket_path).latest("dead") == 1
    # The node comes back without the hold: it drains, and the generation commits.
    slow.overrides.pop("CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S")
    slow.start()
    for d in daemons:
        d.client().wait("dead", 2, timeout_s=120)
    m = manifest(destination, "dead", 2)
    assert m is not None and len(m.shards) == 12
    assert daemons[0].client().latest("dead") == 2
