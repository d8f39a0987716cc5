"""A generation's manifest assembled from its nodes' part records, and why it cannot be yet.

The commit (commit.py) and the publisher (publisher.py) decide with these: which ranks no part
record covers, whether a rank aborted or two users wrote the same job, and, once every rank is
covered, the one manifest the part records make. Every refusal is a :class:`ManifestError`
whose message names the ranks, nodes or shard paths at fault, bounded however many ranks there
are.
"""

from __future__ import annotations

from collections.abc import Sequence, Set

from ckptdrain.client.manifest import Manifest, PartRecord
from ckptdrain.client.recordfields import ManifestError
from ckptdrain.client.shardentries import ShardEntry, parents, sorted_shards
from ckptdrain.daemon.tombstone import committed_by, names_step

__all__ = [
    "MISSING_RANKS_LISTED",
    "build_manifest",
    "describe_aborted",
    "describe_missing",
    "describe_ranks",
    "held_part",
    "holds_part",
    "missing_ranks",
    "not_this_nodes",
    "owners_disagree",
    "same_contents",
]


MISSING_RANKS_LISTED = 1000


def missing_ranks(parts: Sequence[PartRecord], world_size: int,
                  limit: int = MISSING_RANKS_LISTED) -> list[int]:
    """The ranks in ``0..world_size-1`` that no part record covers yet, ascending, at most
    ``limit`` of them (``[]`` exactly when every rank is covered). An aborted rank is never
    covered: only ``ranks`` count, never ``aborted_ranks``. Costs what the part records hold
    plus ``limit``, never ``world_size``: a commit poll runs this for every sealed generation."""
    covered: set[int] = set()
    for part in parts:
        covered.update(r for r in part.ranks if 0 <= r < world_size)
    if len(covered) >= world_size:
        return []
    missing: list[int] = []
    rank = 0
    while len(missing) < limit and rank < world_size:
        if rank not in covered:
            missing.append(rank)
        rank += 1
    return missing


def describe_missing(missing: Sequence[int], others: Sequence[PartRecord]) -> str:
    """Why ``missing`` (ascending, from :func:`missing_ranks`) are not covered, for the end of
    a wait: ``others``, the records of other attempts at the step, say which of those ranks a
    node did save, under another attempt's name. Found attacking: nodes whose launchers named
    the attempt differently (torchrun counts restarts per node) waited out
    drain.commit_wait_s and then asked of each other "is their node down?"."""
    elsewhere: dict[str, tuple[str, list[int]]] = {}
    wanted = set(missing)
    for part in sorted(others, key=lambda p: p.node):
        ranks = sorted(wanted.intersection(part.ranks))
        if ranks:
            elsewhere[part.node] = (part.attempt, ranks)
    lonely = sorted(wanted.difference(*(r for _, r in elsewhere.values())))
    clauses = []
    if lonely:
        clauses.append(f"rank(s) {describe_ranks(lonely)} have no part record (is their node "
                       "down?)")
    if elsewhere:
        shown = sorted(elsewhere.items())[:3]
        named = ", ".join(f"node {node!r} saved rank(s) {describe_ranks(ranks)} as attempt "
                          f"{attempt!r}" for node, (attempt, ranks) in shown)
        more = f" and {len(elsewhere) - 3} more nodes" if len(elsewhere) > 3 else ""
        clauses.append(f"{named}{more}, not as this node's attempt: every rank of a run must "
                       "save the step under one attempt name (with DCP, agreed_attempt(); "
                       "else the same $CKPTDRAIN_ATTEMPT on every node), unless that attempt "
                       "is a restart that replaced this one")
    return "; ".join(clauses)


def owners_disagree(parts: Sequence[PartRecord]) -> str:
    """Why these part records cannot be one generation's because different users wrote them
    (``""`` when every record that names an owner names the same one)."""
    owners: dict[int, str] = {}
    for part in sorted(parts, key=lambda p: p.node):
        if part.owner_uid is not None:
            owners.setdefault(part.owner_uid, part.node)
    if len(owners) < 2:
        return ""
    named = ", ".join(f"uid {uid} on node {node!r}" for uid, node in sorted(owners.items()))
    return (f"part records of this generation were written for different owners ({named}); "
            "two users saved the same job name, and no node merges them: use another job name")


def not_this_nodes(parts: Sequence[PartRecord], node: str, began: Set[int],
                   recorded: Set[int]) -> str:
    """Why the part record at ``node``'s own key is not the one ``node`` wrote, having begun
    the ranks ``began`` and recorded ``recorded`` of them there (``""`` when it is, or when
    there is none to judge).

    Only another daemon running as ``node`` rewrites that key with other ranks: each rewrites
    the other's record, no record ever covers both daemons' ranks, and every node waited out
    drain.commit_wait_s, told the ranks of the one whose record was overwritten had "no part
    record (is their node down?)", that node included (found attacking: two daemons with one
    node_id, as containers sharing their host's name have). Only a record that names a rank
    this node never began counts: an older record of its own, read stale, never does."""
    mine = next((p for p in parts if p.node == node), None)
    if mine is None:
        return ""
    lacking = sorted(recorded - set(mine.ranks))
    foreign = sorted({*mine.ranks, *mine.aborted_ranks} - began)
    if not lacking or not foreign:
        return ""
    return (f"the part record _parts/{node}.json names rank(s) {describe_ranks(foreign)}, which "
            f"this node never saved, and not rank(s) {describe_ranks(lacking)}, which it "
            f"recorded there: another daemon runs with node_id {node!r} and rewrites the "
            "record. Give every daemon sharing the destination its own node_id, restart them, "
            "and save a new step")


def describe_aborted(parts: Sequence[PartRecord]) -> str:
    """Why these part records can never commit, e.g. ``"rank 3 aborted on node 'n1': ..."``;
    ``""`` when no record says a rank aborted. One clause per node, nodes sorted."""
    clauses = []
    for part in sorted(parts, key=lambda p: p.node):
        if part.aborted_ranks:
            ranks = part.aborted_ranks
            noun = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranges(ranks)}"
            clauses.append(f"{noun} aborted on node {part.node!r}: {part.abort_reason}")
    return "; ".join(clauses)


def build_manifest(parts: Sequence[PartRecord], committed_at: float) -> Manifest:
    """Merge complete part records into the generation's manifest.

    Raises ManifestError when the parts cannot belong to one generation (they disagree on job,
    step or world size, two nodes claim a rank or a shard path, a node appears twice) or do not
    yet cover every rank.
    """
    if not parts:
        raise ManifestError("no part records to build a manifest from")
    aborted = describe_aborted(parts)
    if aborted:
        raise ManifestError(f"the generation cannot commit: {aborted}")
    mixed = owners_disagree(parts)
    if mixed:
        raise ManifestError(mixed)
    first = parts[0]
    nodes: list[str] = []
    owner_of_rank: dict[int, str] = {}
    owner_of_path: dict[str, str] = {}
    shards: list[ShardEntry] = []
    for part in parts:
        for attr in ("job", "step", "world_size"):
            if getattr(part, attr) != getattr(first, attr):
                raise ManifestError(
                    f"part records disagree on {attr}: node {first.node!r} says "
                    f"{getattr(first, attr)!r}, node {part.node!r} says {getattr(part, attr)!r}"
                )
        if part.node in nodes:
            raise ManifestError(f"node {part.node!r} has two part records")
        nodes.append(part.node)
        for rank in part.ranks:
            other = owner_of_rank.setdefault(rank, part.node)
            if other != part.node:
                raise ManifestError(
                    f"rank {rank} is claimed by nodes {other!r} and {part.node!r}; "
                    "two launches wrote the same generation"
                )
        for shard in part.shards:
            other = owner_of_path.setdefault(shard.path, part.node)
            if other != part.node:
                raise ManifestError(
                    f"shard path {shard.path!r} was written by nodes {other!r} and {part.node!r}"
                )
            shards.append(shard)
    for shard in shards:
        # Ranks on different nodes: each node refuses such a pair among its own shards only.
        # Committed, the generation could never be restored to a filesystem.
        for parent in parents(shard.path):
            if parent in owner_of_path:
                raise ManifestError(
                    f"shard {parent!r} (node {owner_of_path[parent]!r}) and shard "
                    f"{shard.path!r} (node {shard.node!r}) cannot both exist: one is a "
                    "directory of the other; rename one of them"
                )
    missing = missing_ranks(parts, first.world_size)
    if missing:
        raise ManifestError(f"ranks {_ranges(missing)} have no part record yet")
    clocks = {
        "handoff": min(p.clocks["handoff"] for p in parts),
        "staged": max(p.clocks["staged"] for p in parts),
        "drained": max(p.clocks["drained"] for p in parts),
        "committed": float(committed_at),
    }
    return Manifest(
        job=first.job,
        generation=first.step,
        world_size=first.world_size,
        shards=sorted_shards(shards),
        nodes=tuple(sorted(nodes)),
        clocks=clocks,
    )


def same_contents(a: Manifest, b: Manifest) -> bool:
    """Whether two manifests commit the same bytes, ignoring clocks: a node that lost the
    exclusive-create race accepts the winner's manifest only if this holds."""
    return (
        a.format_version == b.format_version
        and a.job == b.job
        and a.generation == b.generation
        and a.world_size == b.world_size
        and a.nodes == b.nodes
        and a.shards == b.shards
    )


def holds_part(manifest: Manifest, node: str, world_size: int,
               mine: set[tuple[str, int, str, int]]) -> bool:
    """Whether ``manifest`` commits ``node``'s part as the node recorded it: the node is one of
    its nodes, the world size is the same, and every shard the node recorded, ``mine`` as
    (path, size, checksum, rank), is in it as the node's. Another attempt's manifest of the
    step is not: a node's part of an attempt is replaced on that node by the next attempt,
    so one naming this node is this node's attempt (found attacking: a node whose recorded
    rank saved no shard took any manifest of the step for its own)."""
    if node not in manifest.nodes or manifest.world_size != world_size:
        return False
    theirs = {(e.path, e.size, e.checksum, e.rank) for e in manifest.shards if e.node == node}
    return mine <= theirs


def held_part(tombstone: bytes, job: str, step: int, node: str, world_size: int) -> bool:
    """:func:`holds_part` for a committed generation retention has removed since, from what
    its tombstone of ``job`` step ``step`` says of the manifest it replaced: the same world
    size, and this node among its nodes where it names them (it leaves them out where they
    would not fit). A tombstone that names no world size (an older version's; found attacking
    a rolling upgrade: it was taken as this node's, and a node whose attempt another one had
    replaced heard its step committed), one naming another step, or one saying either in a
    form no tombstone is written in, is not this node's: the step is reported cancelled, as
    before tombstones said more."""
    if not names_step(tombstone, job, step):
        return False
    size, nodes = committed_by(tombstone)
    return size == world_size and (nodes is None or node in nodes)


def _ranges(ranks: Sequence[int], limit: int = 8) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``, cut after ``limit`` runs: thousands of ranks must not
    make a message unreadable."""
    runs: list[str] = []
    start = prev = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if rank is not None:
            start = prev = rank
    shown = ", ".join(runs[:limit])
    return shown + (f" and {len(runs) - limit} more runs" if len(runs) > limit else "")


def describe_ranks(ranks: Sequence[int]) -> str:
    """Human-readable, bounded rendering of a rank list for error messages and the CLI."""
    return _ranges(sorted(ranks)) if ranks else "none"
