"""The shard entries part records and manifests list (pure): one shard as committed
(:class:`ShardEntry`), and the rules a list of them follows in either record: no path twice,
none a directory of another, every rank in the world and every node one the record names.

Apart from ``manifest.py`` (the records that list them): the daemon's ledger, assembly and
restore handle entries and shard paths without a record at hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ckptdrain.client.keys import validate_node_id
from ckptdrain.client.names import validate_rank, validate_shard_path
from ckptdrain.client.recordfields import (
    ManifestError,
    checked,
    int_field,
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
    for shard in shards:
        if not isinstance(shard, ShardEntry):
            raise ManifestError(f"{what} shards must be ShardEntry, not {type(shard).__name__}")
        if shard.path in seen:
            raise ManifestError(f"{what} lists shard path {shard.path!r} twice")
        seen.add(shard.path)
        checked(validate_rank, shard.rank, world_size)
        if shard.node not in allowed_nodes:
            raise ManifestError(
                f"{what} shard {shard.path!r} names node {shard.node!r}, "
                f"not one of {sorted(allowed_nodes)}"
            )
    for shard in shards:
        # What the write side refuses (a shard that is a directory of another) in a manifest
        # written by something else: listed as committed, it could never be restored.
        for parent in parents(shard.path):
            if parent in seen:
                raise ManifestError(
                    f"{what} lists shard {parent!r} and shard {shard.path!r}: one is a "
                    "directory of the other, so it cannot be restored to a filesystem"
                )


def sorted_shards(shards: Sequence[ShardEntry]) -> tuple[ShardEntry, ...]:
    return tuple(sorted(shards, key=lambda s: (s.rank, s.path)))


def parents(path: str) -> list[str]:
    """The directories a shard path lies in: ``a/b/c`` -> ``["a", "a/b"]``."""
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]
