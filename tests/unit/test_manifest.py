"""The on-storage formats: keys, part records, manifests, checksums (pure, no event loop)."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptdrain.client import shardentries
from ckptdrain.client.keys import (
    generation_prefix,
    latest_key,
    manifest_key,
    parse_generation_dir,
    parse_manifest_key,
    part_key,
    shard_key,
    validate_node_id,
)
from ckptdrain.client.manifest import FORMAT_VERSION, TMP_SUFFIX, Manifest, PartRecord
from ckptdrain.client.recordfields import (
    MAX_FIELD_INT,
    ManifestError,
    format_checksum,
    is_plain_checksum,
    parse_checksum,
)
from ckptdrain.client.shardentries import ShardEntry
from ckptdrain.daemon.assembly import (
    MISSING_RANKS_LISTED,
    build_manifest,
    describe_ranks,
    missing_ranks,
    same_contents,
)

HEX_A = "a" * 64
HEX_B = "b" * 64


def shard(path: str, rank: int, node: str, size: int = 10, digest: str = HEX_A) -> ShardEntry:
    return ShardEntry(path=path, size=size, checksum=f"sha256:{digest}", rank=rank, node=node)


def part(
    node: str,
    ranks: tuple[int, ...],
    *,
    job: str = "llama",
    step: int = 1200,
    world_size: int = 4,
    shards: tuple[ShardEntry, ...] | None = None,
    handoff: float = 100.0,
    staged: float = 110.0,
    drained: float = 120.0,
) -> PartRecord:
    if shards is None:
        shards = tuple(shard(f"model/rank{r}.pt", r, node) for r in ranks)
    return PartRecord(
        job=job,
        step=step,
        world_size=world_size,
        node=node,
        ranks=ranks,
        shards=shards,
        clocks={"handoff": handoff, "staged": staged, "drained": drained},
    )


def two_node_manifest(committed_at: float = 130.0) -> Manifest:
    return build_manifest(
        [part("gpu2", (2, 3), handoff=90.0, drained=125.0), part("gpu1", (0, 1))], committed_at
    )


# --- keys -----------------------------------------------------------------------------------


def test_keys_follow_the_documented_layout() -> None:
    assert generation_prefix("llama", 1200) == "llama/00000000000000001200/"
    assert shard_key("llama", 1200, "model/rank3.pt") == "llama/00000000000000001200/model/rank3.pt"
    assert part_key("llama", 1200, "gpu017") == "llama/00000000000000001200/_parts/gpu017.json"
    assert manifest_key("llama", 1200) == "llama/00000000000000001200/MANIFEST.json"
    assert latest_key("llama") == "llama/LATEST"


def test_zero_padding_makes_key_order_step_order() -> None:
    steps = [5, 1200, 30, 10**18]
    keys = sorted(generation_prefix("j", s) for s in steps)
    assert keys == [generation_prefix("j", s) for s in sorted(steps)]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("00000000000000001200", 1200),
        ("00000000000000000000", 0),
        ("1200", None),
        ("0000000000000000120a", None),
        ("000000000000000001200", None),
        ("_parts", None),
        ("99999999999999999999", None),  # past MAX_STEP: not a directory we would write
    ],
)
def test_parse_generation_dir(name: str, expected: int | None) -> None:
    assert parse_generation_dir(name) == expected


def test_parse_manifest_key_accepts_only_top_level_manifests() -> None:
    assert parse_manifest_key("llama/00000000000000001200/MANIFEST.json") == ("llama", 1200)
    # A shard that happens to be called MANIFEST.json deeper down is not a commit point.
    assert parse_manifest_key("llama/00000000000000001200/x/MANIFEST.json") is None
    assert parse_manifest_key("llama/1200/MANIFEST.json") is None
    assert parse_manifest_key(".hidden/00000000000000001200/MANIFEST.json") is None
    assert parse_manifest_key("llama/LATEST") is None


@pytest.mark.parametrize("bad", ["../x", "a/b", "", ".dot", "-dash", "x" * 200, "a b"])
def test_bad_node_ids_are_refused(bad: str) -> None:
    with pytest.raises(ManifestError, match="node id"):
        validate_node_id(bad)


def test_keys_refuse_bad_names() -> None:
    with pytest.raises(ManifestError):
        shard_key("llama", 1, "../escape")
    with pytest.raises(ManifestError):
        shard_key("llama", 1, "MANIFEST.json")
    with pytest.raises(ManifestError):
        generation_prefix("a/b", 1)
    with pytest.raises(ManifestError):
        generation_prefix("llama", -1)


# --- checksums ------------------------------------------------------------------------------


def test_checksum_round_trip() -> None:
    text = format_checksum("sha256", HEX_A)
    assert text == f"sha256:{HEX_A}"
    assert parse_checksum(text) == ("sha256", HEX_A)


@pytest.mark.parametrize(
    "bad",
    ["sha256:" + "A" * 64, "sha256:" + "a" * 63, "md5:" + "a" * 32, "a" * 64, "sha256:", ""],
)
def test_bad_checksums_are_refused(bad: str) -> None:
    with pytest.raises(ManifestError, match="checksum"):
        parse_checksum(bad)


# --- part records ---------------------------------------------------------------------------


def test_part_record_round_trips() -> None:
    record = part("gpu1", (1, 0))
    assert record.ranks == (0, 1)  # normalised, so equality survives the round trip
    assert PartRecord.from_json(record.to_json()) == record


def test_part_record_json_is_one_shard_per_line() -> None:
    text = part("gpu1", (0, 1)).to_json().decode()
    shard_lines = [line for line in text.splitlines() if '"path"' in line]
    assert len(shard_lines) == 2
    assert json.loads(text)["kind"] == "part"


def test_part_record_refuses_a_shard_of_a_rank_it_does_not_serve() -> None:
    with pytest.raises(ManifestError, match="not among its ranks"):
        part("gpu1", (0,), shards=(shard("x.pt", 1, "gpu1"),))


def test_part_record_refuses_a_shard_written_by_another_node() -> None:
    with pytest.raises(ManifestError, match="names node"):
        part("gpu1", (0,), shards=(shard("x.pt", 0, "gpu2"),))


def test_part_record_refuses_missing_clocks() -> None:
    with pytest.raises(ManifestError, match="clocks"):
        PartRecord("llama", 1, 1, "n", (0,), (), {"handoff": 1.0})


def _mutated(record: PartRecord, **changes: object) -> bytes:
    obj = json.loads(record.to_json())
    obj.update(changes)
    return json.dumps(obj).encode()


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"step": "1200"}, "step must be an integer"),
        ({"step": True}, "step must be an integer"),
        ({"world_size": 0}, "world_size"),
        ({"ranks": [0, 0]}, "rank twice"),
        ({"ranks": [0, 7]}, "out of range"),
        ({"format_version": FORMAT_VERSION + 1}, "upgrade ckptdrain"),
        ({"kind": "manifest"}, "kind"),
        ({"extra": 1}, "unknown field"),
        ({"clocks": {"handoff": 1, "staged": 2, "drained": float("inf")}}, "unix time"),
        # Found attacking: numbers no float holds, or no clock shows, crashed every reader
        # (OverflowError) instead of reading as a damaged record.
        ({"clocks": {"handoff": 10**400, "staged": 2, "drained": 3}}, "1329 bits"),
        ({"clocks": {"handoff": 1, "staged": 1e20, "drained": 3}}, "unix time"),
        ({"step": 10**400}, "1329 bits"),
        ({"job": "bad/job"}, "job name"),
    ],
)
def test_part_record_from_json_is_strict(changes: dict[str, object], match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        PartRecord.from_json(_mutated(part("gpu1", (0, 1)), **changes))


@pytest.mark.parametrize(
    ("shard_changes", "match"),
    [
        ({"size": -1}, "must be 0\\.\\."),
        ({"size": 10**400}, "1329 bits"),
        ({"size": 2**63}, "64 bits"),
        ({"size": 1.5}, "size must be an integer"),
        ({"checksum": "sha256:xyz"}, "digest"),
        ({"path": "../../etc/passwd"}, "'..'"),
        ({"path": "/abs"}, "absolute"),
        ({"path": "_parts/gpu1.json"}, "reserves"),
        ({"path": "a" + TMP_SUFFIX}, "temporary"),
        ({"rank": "0"}, "rank must be an integer"),
    ],
)
def test_part_record_shards_are_validated(shard_changes: dict[str, object], match: str) -> None:
    obj = json.loads(part("gpu1", (0, 1)).to_json())
    obj["shards"][0].update(shard_changes)
    with pytest.raises(ManifestError, match=match):
        PartRecord.from_json(json.dumps(obj).encode())


def test_garbage_is_a_manifest_error() -> None:
    # Nested 100,000 deep: the decoder's RecursionError (found attacking the read side).
    for data in (b"", b"{", b"\xff\xfe", b"[]", b"null", b"[" * 100_000 + b"]" * 100_000):
        with pytest.raises(ManifestError):
            PartRecord.from_json(data)
        with pytest.raises(ManifestError):
            Manifest.from_json(data)


# --- manifests ------------------------------------------------------------------------------


def test_build_manifest_merges_parts() -> None:
    manifest = two_node_manifest()
    assert manifest.job == "llama"
    assert manifest.generation == 1200
    assert manifest.world_size == 4
    assert manifest.nodes == ("gpu1", "gpu2")
    assert [(s.rank, s.path) for s in manifest.shards] == [
        (r, f"model/rank{r}.pt") for r in range(4)
    ]
    assert [s.node for s in manifest.shards] == ["gpu1", "gpu1", "gpu2", "gpu2"]
    assert manifest.clocks == {
        "handoff": 90.0,  # earliest hand-off
        "staged": 110.0,
        "drained": 125.0,  # latest drain
        "committed": 130.0,
    }
    assert manifest.total_bytes == 40


def test_shards_sort_by_rank_then_path() -> None:
    shards = (shard("z.pt", 0, "n"), shard("a.pt", 1, "n"), shard("b.pt", 0, "n"))
    manifest = build_manifest([part("n", (0, 1), world_size=2, shards=shards)], 1.0)
    assert [s.path for s in manifest.shards] == ["b.pt", "z.pt", "a.pt"]


def test_manifest_round_trips() -> None:
    manifest = two_node_manifest()
    data = manifest.to_json()
    again = Manifest.from_json(data)
    assert again == manifest
    obj = json.loads(data)
    assert obj["total_bytes"] == 40
    assert obj["shards"][0] == {
        "path": "model/rank0.pt",
        "size": 10,
        "checksum": f"sha256:{HEX_A}",
        "rank": 0,
        "node": "gpu1",
    }


def test_manifest_total_bytes_must_match_its_shards() -> None:
    obj = json.loads(two_node_manifest().to_json())
    obj["total_bytes"] = 41
    with pytest.raises(ManifestError, match="total_bytes"):
        Manifest.from_json(json.dumps(obj).encode())


def test_manifest_shard_node_must_be_listed() -> None:
    obj = json.loads(two_node_manifest().to_json())
    obj["nodes"] = ["gpu1"]
    with pytest.raises(ManifestError, match="names node 'gpu2'"):
        Manifest.from_json(json.dumps(obj).encode())


def test_manifest_rank_must_fit_world_size() -> None:
    obj = json.loads(two_node_manifest().to_json())
    obj["world_size"] = 3
    with pytest.raises(ManifestError, match="out of range"):
        Manifest.from_json(json.dumps(obj).encode())


def test_manifest_refuses_duplicate_paths() -> None:
    obj = json.loads(two_node_manifest().to_json())
    obj["shards"][1]["path"] = obj["shards"][0]["path"]
    with pytest.raises(ManifestError, match="twice"):
        Manifest.from_json(json.dumps(obj).encode())


@pytest.mark.parametrize("under", ["x/y", "x/y/z"])
def test_manifest_refuses_a_shard_that_is_a_directory_of_another(under: str) -> None:
    # Found attacking: a manifest written behind the daemon's back listing `x` and `x/y` was
    # listed committed by `ls`, and `restore` failed on a temp file's name.
    obj = json.loads(two_node_manifest().to_json())
    obj["shards"][0]["path"] = "x"
    obj["shards"][1]["path"] = under
    with pytest.raises(ManifestError, match="directory of the other"):
        Manifest.from_json(json.dumps(obj).encode())
    obj["shards"][1]["path"] = "xy/z"  # a name that only starts the same is no directory
    assert Manifest.from_json(json.dumps(obj).encode()).shards


def test_build_manifest_refuses_disagreeing_world_size() -> None:
    with pytest.raises(ManifestError, match="world_size"):
        build_manifest([part("a", (0, 1)), part("b", (2, 3), world_size=8)], 1.0)


def test_build_manifest_refuses_different_steps() -> None:
    with pytest.raises(ManifestError, match="step"):
        build_manifest([part("a", (0, 1)), part("b", (2, 3), step=1300)], 1.0)


def test_build_manifest_refuses_a_rank_claimed_twice() -> None:
    with pytest.raises(ManifestError, match="rank 1 is claimed by nodes 'a' and 'b'"):
        build_manifest(
            [part("a", (0, 1)), part("b", (1, 2, 3), shards=(shard("other.pt", 2, "b"),))], 1.0
        )


def test_build_manifest_refuses_a_path_written_twice() -> None:
    with pytest.raises(ManifestError, match="written by nodes"):
        build_manifest(
            [
                part("a", (0, 1), shards=(shard("same.pt", 0, "a"),)),
                part("b", (2, 3), shards=(shard("same.pt", 2, "b"),)),
            ],
            1.0,
        )


def test_build_manifest_refuses_missing_ranks() -> None:
    with pytest.raises(ManifestError, match="ranks 2-3 have no part record"):
        build_manifest([part("a", (0, 1))], 1.0)
    with pytest.raises(ManifestError, match="no part records"):
        build_manifest([], 1.0)


def test_missing_ranks() -> None:
    assert missing_ranks([], 3) == [0, 1, 2]
    assert missing_ranks([part("a", (0, 3))], 4) == [1, 2]
    assert missing_ranks([part("a", (0, 1)), part("b", (2, 3))], 4) == []


def test_missing_ranks_costs_nothing_per_world_size() -> None:
    # A commit poll runs this for every sealed generation: world_size = 10^7 with one rank
    # covered once scanned ten million ranks and built a list of them on every poll.
    started = time.perf_counter()
    for _ in range(10):
        missing = missing_ranks([part("a", (0, 1))], 10**7)
    assert time.perf_counter() - started < 0.5
    assert missing[:3] == [2, 3, 4] and len(missing) == MISSING_RANKS_LISTED
    assert missing_ranks([part("a", tuple(range(5000)), world_size=5000)], 5000) == []


def test_same_contents_ignores_clocks_only() -> None:
    a = two_node_manifest(committed_at=130.0)
    b = two_node_manifest(committed_at=999.0)
    assert a != b
    assert same_contents(a, b)
    changed = build_manifest(
        [
            part("gpu1", (0, 1), shards=(shard("model/rank0.pt", 0, "gpu1", digest=HEX_B),)),
            part("gpu2", (2, 3)),
        ],
        130.0,
    )
    assert not same_contents(a, changed)


def test_describe_ranks_is_bounded() -> None:
    assert describe_ranks([3, 0, 1, 2, 7]) == "0-3, 7"
    assert describe_ranks([]) == "none"
    many = describe_ranks(list(range(0, 1000, 2)))
    assert many.endswith("and 492 more runs")


def test_part_records_of_different_owners_never_merge() -> None:
    a = dataclasses.replace(part("a", (0, 1)), owner_uid=1000)
    assert PartRecord.from_json(a.to_json()) == a
    assert PartRecord.from_json(part("a", (0, 1)).to_json()).owner_uid is None
    same = dataclasses.replace(part("b", (2, 3)), owner_uid=1000)
    assert build_manifest([a, same], 1.0).world_size == 4
    other = dataclasses.replace(part("b", (2, 3)), owner_uid=2000)
    with pytest.raises(ManifestError, match="different owners"):
        build_manifest([a, other], 1.0)
    with pytest.raises(ManifestError, match="owner_uid"):
        dataclasses.replace(part("a", (0, 1)), owner_uid=-1)


# --- shard entries read in bulk -------------------------------------------------------------


@given(st.sampled_from(["crc64nvme", "sha256", "md5", "CRC64NVME", ""])
       .flatmap(lambda algo: st.tuples(st.just(algo), st.sampled_from([":", "", "::"]),
                                       st.text("0123456789abcdefA \n", max_size=66)))
       .map("".join) | st.text(max_size=80))
def test_the_one_checksum_match_takes_exactly_what_parse_checksum_takes(checksum: str) -> None:
    try:
        parse_checksum(checksum)
        accepted = True
    except ManifestError:
        accepted = False
    assert is_plain_checksum(checksum) == accepted, checksum


class _Int(int):
    pass


_INTS = st.sampled_from([0, 1, -1, MAX_FIELD_INT, MAX_FIELD_INT + 1, True, False, 1.0, "1",
                         _Int(3), None])


@given(path=st.sampled_from(["model/a.pt", "a/../b", "_parts/x", "é", "", 7]), size=_INTS,
       checksum=st.sampled_from(["crc64nvme:" + "0" * 16, "sha256:" + HEX_A, "crc64nvme:0",
                                 "md5:00", 5]),
       rank=_INTS, node=st.sampled_from(["gpu1", "-gpu", "", "n" * 129, 3]))
def test_a_shard_entry_is_taken_or_refused_as_the_checks_one_by_one_say(
        path: object, size: object, checksum: object, rank: object, node: object) -> None:
    # The fast way a plain entry passes (one match per field) must agree with the checks one
    # by one, the message of a refusal included.
    def outcome(build: object) -> str:
        try:
            build()  # type: ignore[operator]
        except ManifestError as exc:
            return str(exc)
        return "taken"

    one_by_one = object.__new__(ShardEntry)
    for name, value in zip(("path", "size", "checksum", "rank", "node"),
                           (path, size, checksum, rank, node), strict=True):
        object.__setattr__(one_by_one, name, value)
    assert outcome(lambda: ShardEntry(path, size, checksum, rank, node)) == outcome(  # type: ignore[arg-type]
        one_by_one._check_each)


def test_a_plain_manifest_is_read_without_checking_its_shards_rule_by_rule(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # `ckptdrain ls` of a destination whose generations have 100,000 shards took about a
    # second per generation (0.8 s of CPU here), nearly all of it spent checking each
    # shard's fields one rule at a time while the manifest was parsed: plain entries now
    # pass by one match per field, and the rules run only to name what is wrong.
    shards = tuple(ShardEntry(f"model/rank{r}/part{i}.distcp", 10 + i, "crc64nvme:" + "0" * 16,
                              r, "gpu1") for r in range(4) for i in range(50))
    data = Manifest(job="llama", generation=1, world_size=4, shards=shards, nodes=("gpu1",),
                    clocks={"handoff": 1.0, "staged": 2.0, "drained": 3.0,
                            "committed": 4.0}).to_json()

    def rule_by_rule(*args: object, **kwargs: object) -> None:
        raise AssertionError("a plain shard entry was checked rule by rule")

    for name in ("validate_shard_path", "parse_checksum", "validate_node_id", "validate_rank",
                 "int_field", "str_field", "object_field"):
        monkeypatch.setattr(shardentries, name, rule_by_rule)
    assert Manifest.from_json(data).shards == shards
