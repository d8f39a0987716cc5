"""Whether the part record at a node's own key is another daemon's of the same node_id."""

from __future__ import annotations

import pytest

from ckptdrain.client.manifest import PartRecord
from ckptdrain.client.shardentries import ShardEntry
from ckptdrain.daemon.assembly import not_this_nodes

CLOCKS = {"handoff": 1.0, "staged": 2.0, "drained": 3.0}


def record(ranks: tuple[int, ...], aborted: tuple[int, ...] = (), node: str = "node-a") -> PartRecord:
    shards = tuple(ShardEntry(path=f"r{r}.bin", size=1, checksum="crc64nvme:" + "0" * 16, rank=r,
                              node=node) for r in ranks)
    return PartRecord(job="j", step=1, world_size=4, node=node, ranks=ranks, shards=shards,
                      clocks=CLOCKS, aborted_ranks=aborted, abort_reason="x" if aborted else "")


@pytest.mark.parametrize(
    ("there", "twin"),
    [
        (record((0, 1)), False),  # this node's own record
        (record((0,)), False),  # its older record, read stale: nothing foreign in it
        (record(()), False),  # nothing there to judge by
        (record((2,)), True),  # the twin's record over this one
        (record((), aborted=(2,)), True),  # the twin's failure record
        (record((2,), node="node-b"), False),  # another node's: not this key
    ],
    ids=["own", "own-stale", "empty", "twin", "twin-failed", "other-node"],
)
def test_only_a_record_naming_ranks_this_node_never_began_is_a_twins(there: PartRecord,
                                                                        twin: bool) -> None:
    why = not_this_nodes([there], "node-a", began={0, 1}, recorded={0, 1})
    assert bool(why) is twin
    if twin:
        assert "another daemon runs with node_id 'node-a'" in why and "rank(s) 2" in why
