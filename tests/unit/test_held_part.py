"""Whether retention's tombstone of a committed step says this node's part was committed."""

from __future__ import annotations

import json

import pytest

from ckptdrain.daemon.assembly import held_part
from ckptdrain.daemon.tombstone import tombstone_json

JOB, STEP = "j", 1


def hand_written(**fields: object) -> bytes:
    body = {"abandoned_at": 1.0, "format_version": 1, "generation": STEP, "job": JOB,
            "kind": "abandoned", "node": "gc", "was_committed": True} | fields
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("tombstone", "held"),
    [
        (tombstone_json(JOB, STEP, "gc", 1.0, was_committed=True,
                        committed_by=(2, ("node-a", "node-b"))), True),
        (tombstone_json(JOB, STEP, "gc", 1.0, was_committed=True,
                        committed_by=(1, ("node-b",))), False),
        (tombstone_json(JOB, STEP, "gc", 1.0, was_committed=True,
                        committed_by=(3, ("node-a", "node-b"))), False),
        # An older version's, which names neither: not taken as this node's (found attacking
        # a rolling upgrade: another attempt's commit was reported as this node's).
        (tombstone_json(JOB, STEP, "gc", 1.0, was_committed=True), False),
        # Nodes too many to fit the 4096 bytes older readers take are left out; the world
        # size still says.
        (tombstone_json(JOB, STEP, "gc", 1.0, was_committed=True,
                        committed_by=(2, tuple(f"node-{i:0100d}" for i in range(40)))), True),
        # Found attacking: fields there but in no form a tombstone is written in were taken
        # as "not said" (committed), and another step's tombstone counted too.
        (hand_written(world_size="2", nodes=["node-a"]), False),
        (hand_written(world_size=True, nodes=["node-a"]), False),
        (hand_written(world_size=2, nodes="node-a"), False),
        (hand_written(world_size=2, nodes=[1, 2]), False),
        (hand_written(world_size=2, nodes=["node-a"], generation=7), False),
        (hand_written(world_size=2, nodes=["node-a"], job="other"), False),
        (b"[]", False),
    ],
)
def test_a_tombstone_holds_this_nodes_part_only_where_it_says_so(tombstone: bytes,
                                                                  held: bool) -> None:
    assert held_part(tombstone, JOB, STEP, "node-a", 2) is held


def test_a_tombstone_stays_within_what_older_versions_read() -> None:
    # Found attacking a rolling upgrade: a tombstone over 4096 bytes (40 nodes with long
    # names) was a damaged manifest to older versions, whose retention then replaced it.
    many = tuple(f"node-{i:0100d}" for i in range(40))
    big = tombstone_json(JOB, STEP, "gc", 1.0, was_committed=True, committed_by=(40, many))
    assert len(big) <= 4096 and b'"nodes"' not in big and b'"world_size": 40' in big
    few = tombstone_json(JOB, STEP, "gc", 1.0, was_committed=True,
                         committed_by=(2, ("node-a", "node-b")))
    assert json.loads(few)["nodes"] == ["node-a", "node-b"]
