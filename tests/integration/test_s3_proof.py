"""The commit's proof of S3 shards (``stat_many``) from one listing, against a real SeaweedFS
through a recording proxy: the shards this backend created are proved by the size and ETag a
listing shows, and everything else is still asked with a HEAD. The listing may only spare
requests: each answer must be the one a HEAD gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from ckptdrain.daemon.backends import s3 as s3_module
from ckptdrain.daemon.backends.base import ObjectInfo
from ckptdrain.daemon.backends.s3 import S3Backend
from ckptdrain.daemon.backends.s3proof import LISTED_PER_HEAD, LISTING_MIN, Listed
from tests.integration.faultproxy import FaultProxy
from tests.integration.seaweedfs import SeaweedFS
from tests.integration.test_s3_backend import NODE, PREFIX, dest_config

pytestmark = [pytest.mark.s3, pytest.mark.asyncio]

GEN = "job/00000000000000000001/"


def _sent(proxy: FaultProxy) -> tuple[int, list[str]]:
    """The listings the proxy has seen since the last call, and the names HEADs asked for
    (sorted: a batch of HEADs goes out at once); then forgotten."""
    lists = sum(1 for r in proxy.requests if r.method == "GET" and "list-type=2" in r.target)
    heads = sorted(r.target.split("?")[0].rsplit("/", 1)[-1] for r in proxy.requests
                   if r.method == "HEAD")
    proxy.requests.clear()
    return lists, heads


def _names(keys: Sequence[str]) -> list[str]:
    return sorted(k.rsplit("/", 1)[-1] for k in keys)


async def _put(backend: S3Backend, staged: Any, count: int, *, seed: int,
               under: str = GEN) -> tuple[list[str], list[Any]]:
    keys = [f"{under}r{i % 3}/s{i}.bin" for i in range(count)]
    shards = [staged(1000 + 37 * i, seed=seed + i) for i in range(count)]
    for key, shard in zip(keys, shards, strict=True):
        assert await backend.put_file(key, shard.fd, shard.size) == shard.checksum
    return keys, shards


def _checksums(infos: Sequence[ObjectInfo | None]) -> list[tuple[int, str | None] | None]:
    return [None if i is None else (i.size, i.checksum) for i in infos]


@pytest.mark.parametrize("engine", ["aiobotocore", "crt"])
@pytest.mark.parametrize("workers", [0, 1])
async def test_shards_this_backend_created_are_proved_by_one_listing_not_a_head_each(
        seaweedfs: SeaweedFS, s3_bucket: str, staged: Any, proxy: FaultProxy,
        backends: Any, engine: str, workers: int) -> None:
    # The drain of 256 x 1 MiB to SeaweedFS spent about a fifth of its CPU on the commit's
    # HEAD of every shard; each PutObject had already answered the object's ETag.
    backend = S3Backend(dest_config(s3_bucket, proxy.endpoint_url, engine=engine), NODE,
                        workers=workers)
    fresh = backends(dest_config(s3_bucket, proxy.endpoint_url))
    try:
        await backend.start()
        keys, shards = await _put(backend, staged, 20, seed=100)
        asked = [*keys, GEN + "r0/missing.bin"]
        _sent(proxy)
        found = await backend.stat_many(asked)
        assert _sent(proxy) == (1, ["missing.bin"])
        assert _checksums(found) == [*((s.size, s.checksum) for s in shards), None]
        # What a HEAD of each says: a backend that created none of them asks every one.
        by_head = await fresh.stat_many(asked)
        assert _sent(proxy) == (0, _names(asked))
        assert _checksums(by_head) == _checksums(found)
        for listed, headed in zip(found[:-1], by_head[:-1], strict=True):
            assert listed is not None and headed is not None
            assert listed.modified is not None and headed.modified is not None
            assert abs(listed.modified - headed.modified) <= 1.0
    finally:
        await backend.aclose()


async def test_a_shard_replaced_or_deleted_after_it_was_created_is_asked_with_a_head(
        seaweedfs: SeaweedFS, s3_bucket: str, staged: Any, proxy: FaultProxy, backends: Any) -> None:
    # Another attempt at the step may replace an uncommitted shard (other bytes, same size)
    # or a sweep delete it: the listing shows another ETag or no key, and the HEAD decides.
    backend = backends(dest_config(s3_bucket, proxy.endpoint_url))
    keys, shards = await _put(backend, staged, 12, seed=200)
    other = staged(shards[3].size, seed=299)
    raw = seaweedfs.client()
    raw.put_object(Bucket=s3_bucket, Key=f"{PREFIX}/{keys[3]}", Body=other.data,
                   Metadata={"ckptdrain-checksum": other.checksum})
    raw.delete_object(Bucket=s3_bucket, Key=f"{PREFIX}/{keys[5]}")
    _sent(proxy)
    found = await backend.stat_many(keys)
    assert _sent(proxy) == (1, ["s3.bin", "s5.bin"])
    expected = [(s.size, s.checksum) for s in shards]
    expected[3] = (other.size, other.checksum)
    expected[5] = None
    assert _checksums(found) == expected


async def test_a_listing_whose_etags_differ_from_the_puts_costs_heads_not_a_wrong_answer(
        seaweedfs: SeaweedFS, s3_bucket: str, staged: Any, proxy: FaultProxy, backends: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A store that spells ETags one way in PutObject's answer and another in its listing.
    backend = backends(dest_config(s3_bucket, proxy.endpoint_url))
    keys, shards = await _put(backend, staged, 10, seed=300)
    listing = backend.sizes_and_etags

    async def other_spelling(prefix: str, *, limit: int) -> Any:
        found = await listing(prefix, limit=limit)
        assert found is not None
        return {k: Listed(v.size, "W/" + v.etag, v.modified) for k, v in found.items()}

    monkeypatch.setattr(backend, "sizes_and_etags", other_spelling)
    _sent(proxy)
    found = await backend.stat_many(keys)
    assert _sent(proxy) == (1, _names(keys))
    assert _checksums(found) == [(s.size, s.checksum) for s in shards]


async def test_a_listing_that_finds_far_more_objects_than_asked_is_given_up_for_heads(
        seaweedfs: SeaweedFS, s3_bucket: str, staged: Any, proxy: FaultProxy, backends: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The proof lists the directory the shards share; one holding many other objects is not
    # walked to its end.
    monkeypatch.setattr(s3_module, "LISTING_SLACK", 3)
    backend = backends(dest_config(s3_bucket, proxy.endpoint_url))
    backend.list_page_size = 4
    keys, shards = await _put(backend, staged, 8, seed=400)
    await _put(backend, staged, 8, seed=450, under=GEN + "other/")
    _sent(proxy)
    found = await backend.stat_many(keys)
    # Pages of 4 keys: given up on the third page (more than 8 + 3), before the fourth.
    assert _sent(proxy) == (3, _names(keys))
    assert _checksums(found) == [(s.size, s.checksum) for s in shards]


async def test_few_remembered_shards_are_asked_with_heads_without_a_listing(
        seaweedfs: SeaweedFS, s3_bucket: str, staged: Any, proxy: FaultProxy, backends: Any) -> None:
    backend = backends(dest_config(s3_bucket, proxy.endpoint_url))
    keys, shards = await _put(backend, staged, LISTING_MIN - 1, seed=500)
    _sent(proxy)
    found = await backend.stat_many(keys)
    assert _sent(proxy) == (0, _names(keys))
    assert _checksums(found) == [(s.size, s.checksum) for s in shards]


async def test_a_node_that_created_few_of_many_shards_asks_with_heads_without_a_listing(
        seaweedfs: SeaweedFS, s3_bucket: str, staged: Any, proxy: FaultProxy, backends: Any) -> None:
    # A multi-node commit: most shards were drained by other nodes, and listing the whole
    # generation to spare a few HEADs would cost more than it saves.
    backend = backends(dest_config(s3_bucket, proxy.endpoint_url))
    keys, shards = await _put(backend, staged, 10, seed=600)
    others = [f"{GEN}other/s{i}.bin" for i in range(10 * LISTED_PER_HEAD)]
    _sent(proxy)
    found = await backend.stat_many([*keys, *others])
    assert _sent(proxy) == (0, _names([*keys, *others]))
    assert _checksums(found) == [*((s.size, s.checksum) for s in shards),
                                 *[None] * len(others)]


async def test_prove_by_listing_off_keeps_a_head_per_shard(
        seaweedfs: SeaweedFS, s3_bucket: str, staged: Any, proxy: FaultProxy,
        backends: Any) -> None:
    # For a store whose listings may show an object after it was deleted or overwritten.
    backend = backends(dest_config(s3_bucket, proxy.endpoint_url, prove_by_listing=False))
    keys, shards = await _put(backend, staged, 20, seed=700)
    _sent(proxy)
    found = await backend.stat_many(keys)
    assert _sent(proxy) == (0, _names(keys))
    assert _checksums(found) == [(s.size, s.checksum) for s in shards]
