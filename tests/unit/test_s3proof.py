"""The memory of created objects and the directory the commit's proof lists (s3proof.py)."""

from __future__ import annotations

from ckptdrain.daemon.backends.s3proof import (
    LISTED_PER_HEAD,
    LISTING_MIN,
    CreatedObjects,
    Listed,
    listing_prefix,
    worth_listing,
)


def test_a_created_object_is_proved_only_by_its_own_size_and_etag() -> None:
    made = CreatedObjects()
    made.remember("j/1/a", 10, "crc64nvme:00000000000000aa", '"e1"')
    proved = made.proved("j/1/a", Listed(10, "e1", 5.0))  # listings may drop the quotes
    assert proved is not None
    assert (proved.size, proved.checksum, proved.modified) == (10, "crc64nvme:00000000000000aa", 5.0)
    assert made.proved("j/1/a", Listed(11, '"e1"', 5.0)) is None  # another size
    assert made.proved("j/1/a", Listed(10, '"e2"', 5.0)) is None  # another object
    assert made.proved("j/1/a", Listed(10, 'W/"e1"', 5.0)) is None  # a weak ETag: not ours
    assert made.proved("j/1/a", None) is None  # not listed
    assert made.proved("j/1/b", Listed(10, '"e1"', 5.0)) is None  # not created here


def test_a_create_answered_without_an_etag_forgets_what_was_there_before() -> None:
    made = CreatedObjects()
    made.remember("k", 1, "crc64nvme:0000000000000001", '"old"')
    made.remember("k", 1, "crc64nvme:0000000000000002", "")
    assert made.proved("k", Listed(1, '"old"', None)) is None
    assert made.known(["k"]) == []


def test_the_memory_is_bounded_oldest_first() -> None:
    made = CreatedObjects(limit=3)
    for i in range(5):
        made.remember(f"k{i}", i, f"crc64nvme:{i:016x}", f'"e{i}"')
    assert len(made) == 3
    assert made.known([f"k{i}" for i in range(5)]) == [2, 3, 4]
    made.remember("k2", 2, "crc64nvme:0000000000000002", '"e2"')  # again: now the newest
    made.remember("k5", 5, "crc64nvme:0000000000000005", '"e5"')
    assert made.known(["k2", "k3", "k4", "k5"]) == [0, 2, 3]


def test_the_proof_lists_the_directory_the_keys_share_never_the_whole_destination() -> None:
    assert listing_prefix(["job/0001/r0/a.bin", "job/0001/r1/b.bin"]) == "job/0001/"
    assert listing_prefix(["job/0001/rank/a", "job/0001/rank/b"]) == "job/0001/rank/"
    assert listing_prefix(["job/0001/a"]) == "job/0001/"
    assert listing_prefix(["a.bin", "b.bin"]) is None
    assert listing_prefix(["job/a", "other/b"]) is None
    assert listing_prefix([]) is None


def test_a_listing_is_worth_it_only_for_enough_keys_and_a_large_enough_share_of_them() -> None:
    assert not worth_listing(LISTING_MIN - 1, LISTING_MIN - 1)
    assert worth_listing(LISTING_MIN, LISTING_MIN)
    # A node that drained 8 of 100,000 shards: 8 HEADs, not 100 pages of listing.
    assert not worth_listing(8, 100_000)
    assert worth_listing(100_000 // LISTED_PER_HEAD, 100_000)
    assert not worth_listing(100_000 // LISTED_PER_HEAD - 1, 100_000)
