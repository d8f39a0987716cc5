"""Rank coverage with aborted ranks (pure): a rank a node marked aborted never covers, the
records say why, and no manifest is ever built from them."""

from __future__ import annotations

import json

import pytest

from ckptdrain.client.manifest import MAX_ABORT_REASON_CHARS, PartRecord
from ckptdrain.client.recordfields import ManifestError
from ckptdrain.client.shardentries import ShardEntry
from ckptdrain.daemon.assembly import build_manifest, describe_aborted, missing_ranks

CLOCKS = {"handoff": 1.0, "staged": 2.0, "drained": 3.0}


def part(node: str, ranks: tuple[int, ...], aborted: tuple[int, ...] = (), reason: str = "",
         world_size: int = 4) -> PartRecord:
    shards = tuple(
        ShardEntry(path=f"r{r}.pt", size=1, checksum="sha256:" + "a" * 64, rank=r, node=node)
        for r in ranks
    )
    return PartRecord("job", 7, world_size, node, ranks, shards, CLOCKS, attempt="a1",
                      aborted_ranks=aborted, abort_reason=reason)


def test_an_aborted_rank_is_missing_not_covered() -> None:
    parts = [part("n0", (0, 1)), part("n1", (2,), aborted=(3,), reason="the client aborted")]
    assert missing_ranks(parts, 4) == [3]
    assert describe_aborted(parts) == "rank 3 aborted on node 'n1': the client aborted"


def test_no_manifest_is_built_even_when_another_node_covers_the_aborted_rank() -> None:
    parts = [part("n0", (0, 1, 3)), part("n1", (2,), aborted=(3,), reason="boom")]
    assert missing_ranks(parts, 4) == []
    with pytest.raises(ManifestError, match=r"rank 3 aborted on node 'n1': boom"):
        build_manifest(parts, committed_at=4.0)


def test_aborts_of_several_nodes_are_each_named() -> None:
    parts = [part("n2", (), aborted=(1, 2, 3), reason="drain failed"),
             part("n0", (), aborted=(0,), reason="killed")]
    assert describe_aborted(parts) == (
        "rank 0 aborted on node 'n0': killed; ranks 1-3 aborted on node 'n2': drain failed"
    )
    assert missing_ranks(parts, 4) == [0, 1, 2, 3]


def test_records_without_aborts_describe_nothing() -> None:
    assert describe_aborted([part("n0", (0, 1, 2, 3))]) == ""
    assert describe_aborted([]) == ""


def test_an_aborted_record_round_trips_and_a_plain_one_is_unchanged() -> None:
    aborted = part("n1", (2,), aborted=(3,), reason="the client aborted")
    assert PartRecord.from_json(aborted.to_json()) == aborted
    plain = part("n0", (0, 1))
    # Backward compatible: a record without aborts carries no new field at all, so older
    # readers (strict about unknown fields) keep reading it.
    fields = json.loads(plain.to_json())
    assert "aborted_ranks" not in fields and "abort_reason" not in fields
    assert PartRecord.from_json(plain.to_json()).aborted_ranks == ()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ranks": (2,), "aborted": (2,), "reason": "x"}, "both drained and aborted"),
        ({"ranks": (), "aborted": (3, 3), "reason": "x"}, "aborted rank twice"),
        ({"ranks": (), "aborted": (4,), "reason": "x"}, "rank"),
        ({"ranks": (), "aborted": (3,), "reason": ""}, "go together"),
        ({"ranks": (1,), "aborted": (), "reason": "why"}, "go together"),
        ({"ranks": (), "aborted": (3,), "reason": "x" * (MAX_ABORT_REASON_CHARS + 1)}, "at most"),
    ],
)
def test_inconsistent_aborts_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        part("n1", kwargs["ranks"], aborted=kwargs["aborted"], reason=kwargs["reason"])  # type: ignore[arg-type]


def test_a_malformed_aborted_field_is_refused_on_read() -> None:
    fields = json.loads(part("n1", (2,), aborted=(3,), reason="r").to_json())
    fields["aborted_ranks"] = "3"
    with pytest.raises(ManifestError, match="aborted_ranks must be a list"):
        PartRecord.from_json(json.dumps(fields).encode())
