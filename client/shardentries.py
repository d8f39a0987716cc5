"""The shard entries part records and manifests list (pure): one shard as committed
(:class:`ShardEntry`), and the rules a list of them follows in either record: no path twice,
none a directory of another, every rank in the world and every node one the record names.

Apart from ``manifest.py`` (the records that list them): the daemon's ledger, assembly and
restore handle entries and shard paths without a record at hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ckptdrain.client.keys import is_node_id, validate_node_id
from ckptdrain.client.names import (
    is_plain_shard_path,
    validate_rank,
    validate_shard_path,
    validate_world_size,
)
from ckptdrain.client.recordfields import (
    MAX_FIELD_INT,
    ManifestError,
    checked,
    int_field,
    is_plain_checksum,
    object_field,
    parse_checksum,
    str_field,
)

_SHARD_FIELDS = frozenset({"path", "size", "checksum", "rank", "node"})


@dataclass(frozen=True, slots=True)
class ShardEntry:
    """One shard as committed: its path in the generation, size, checksum and writer."""

    path: str
    size: int
    checksum: str
    rank: int
    node: str

    def __post_init__(self) -> None:
        # Every entry of every record read is built here (100,000 for a large manifest, at
        # each `ls`): a plain entry passes in a few C-level matches and compares; the checks
        # one by one, which name what is wrong, run only for one that is not.
        size, rank, node = self.size, self.rank, self.node
        if (type(size) is int and 0 <= size <= MAX_FIELD_INT
                and type(rank) is int and 0 <= rank <= MAX_FIELD_INT
                and is_plain_shard_path(self.path) and is_plain_checksum(self.checksum)
                and type(node) is str and is_node_id(node)):
            return
        self._check_each()

    def _check_each(self) -> None:
        """The fields checked one by one: each refusal names what is wrong."""
        checked(validate_shard_path, self.path)
        int_field(self.size, f"shard {self.path!r} size")
        parse_checksum(self.checksum)
        int_field(self.rank, f"shard {self.path!r} rank")
        validate_node_id(self.node)

    @property
    def digest(self) -> str:
        """The hex digest without the algorithm prefix."""
        return parse_checksum(self.checksum)[1]

    @property
    def algo(self) -> str:
        """The checksum's algorithm: ``crc64nvme`` (format 2), ``sha256`` (format 1)."""
        return parse_checksum(self.checksum)[0]

    def to_dict(self) -> dict[str, object]:
        return {
            "path": self.path,
            "size": self.size,
            "checksum": self.checksum,
            "rank": self.rank,
            "node": self.node,
        }

    @classmethod
    def from_dict(cls, value: object, what: str) -> ShardEntry:
        if type(value) is dict and value.keys() == _SHARD_FIELDS:
            try:
                return cls(value["path"], value["size"], value["checksum"], value["rank"],
                           value["node"])
            except ManifestError:
                pass  # named below, field by field, as ever
        obj = object_field(value, what, _SHARD_FIELDS)
        path = str_field(obj["path"], f"{what} path")
        try:
            return cls(
                path=path,
                size=int_field(obj["size"], f"{what} size"),
                checksum=str_field(obj["checksum"], f"{what} checksum"),
                rank=int_field(obj["rank"], f"{what} rank"),
                node=str_field(obj["node"], f"{what} node"),
            )
        except ManifestError as exc:
            raise ManifestError(f"{what}: {exc}") from exc


def check_shards(
    shards: Sequence[ShardEntry], world_size: int, what: str, nodes: Sequence[str]
) -> None:
    seen: set[str] = set()
    allowed_nodes = set(nodes)
    # (validate_rank checks the world size with each rank; once here, so that a plain rank
    # needs only a compare.)
    world = checked(validate_world_size, world_size) if shards else 0
    for shard in shards:
        if not isinstance(shard, ShardEntry):
            raise ManifestError(f"{what} shards must be ShardEntry, not {type(shard).__name__}")
        if shard.path in seen:
            raise ManifestError(f"{what} lists shard path {shard.path!r} twice")
        seen.add(shard.path)
        rank = shard.rank
        if not (type(rank) is int and 0 <= rank < world):
            checked(validate_rank, rank, world_size)
        if shard.node not in allowed_nodes:
            raise ManifestError(
                f"{what} shard {shard.path!r} names node {shard.node!r}, "
                f"not one of {sorted(allowed_nodes)}"
            )
    if _nests(shards, seen):
        for shard in shards:
            # What the write side refuses (a shard that is a directory of another) in a
            # manifest written by something else: listed as committed, it could never be
            # restored.
            for parent in parents(shard.path):
                if parent in seen:
                    raise ManifestError(
                        f"{what} lists shard {parent!r} and shard {shard.path!r}: one is a "
                        "directory of the other, so it cannot be restored to a filesystem"
                    )


def _nests(shards: Sequence[ShardEntry], paths: set[str]) -> bool:
    """Whether a directory of some shard's path is itself one of ``paths``. Each directory is
    looked at once, walking up from a shard's own until one already looked at (its parents
    were, too): 100,000 shards in a few hundred directories cost one set lookup each, where
    every parent of every shard (split, joined, looked up) was a quarter of an `ls`."""
    cleared: set[str] = set()
    for shard in shards:
        path = shard.path
        while (cut := path.rfind("/")) > 0:
            path = path[:cut]
            if path in cleared:
                break
            if path in paths:
                return True
            cleared.add(path)
    return False


def sorted_shards(shards: Sequence[ShardEntry]) -> tuple[ShardEntry, ...]:
    return tuple(sorted(shards, key=lambda s: (s.rank, s.path)))


def parents(path: str) -> list[str]:
    """The directories a shard path lies in: ``a/b/c`` -> ``["a", "a/b"]``."""
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]
