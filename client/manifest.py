"""The on-storage records (pure): part records and the generation manifest.

Both the daemon (which writes them) and readers such as ``ckptdrain ls`` or a restart script
(which trust them) use this module, so parsing is strict: every field is typed and checked
(``recordfields.py``), and anything unexpected is a :class:`ManifestError` rather than a guess.
Where each record lives at the destination is ``keys.py``'s (the layout, documented for users
in ``docs/layout.md``); the shard entries both list are ``shardentries.py``'s.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# The `X as X` imports re-export names that moved to keys.py, recordfields.py and
# shardentries.py: daemon modules others are editing still import them from here.
from ckptdrain.client.keys import generation_prefix as generation_prefix
from ckptdrain.client.keys import latest_key as latest_key
from ckptdrain.client.keys import part_key as part_key
from ckptdrain.client.keys import shard_key as shard_key
from ckptdrain.client.keys import validate_node_id
from ckptdrain.client.names import (
    TEMP_SUFFIX,
    validate_job,
    validate_rank,
    validate_step,
    validate_world_size,
)
from ckptdrain.client.recordfields import ManifestError as ManifestError
from ckptdrain.client.recordfields import (
    checked,
    clocks_field,
    int_field,
    list_field,
    load_json,
    object_field,
    str_field,
)
from ckptdrain.client.shardentries import ShardEntry as ShardEntry
from ckptdrain.client.shardentries import check_shards, sorted_shards

# Format 2 (this version writes it): each checksum names its algorithm, crc64nvme for new
# shards (recordfields.CHECKSUM_ALGO). Format 1 manifests carry sha256 only; they are still
# read, verified and restored.
FORMAT_VERSION = 2
READABLE_VERSIONS = frozenset({1, 2})
FORMAT_1_ALGO = "sha256"
TMP_SUFFIX = TEMP_SUFFIX

# The clocks a part record carries (unix seconds): when the first hand-off of the node's ranks
# began, when the last shard was staged, and when the last shard drained.
PART_CLOCKS = ("handoff", "staged", "drained")
# The manifest adds the moment the generation was committed.
MANIFEST_CLOCKS = (*PART_CLOCKS, "committed")

_PART_FIELDS = frozenset(
    {
        "format_version", "kind", "job", "step", "world_size", "node", "ranks", "shards",
        "clocks", "attempt",
    }
)
# Present only in the record of a node that ended the generation: a record without them is
# byte-identical to one written before they existed.
_PART_OPTIONAL_FIELDS = frozenset({"aborted_ranks", "abort_reason", "owner_uid"})
_MAX_UID = 2**32 - 2
# Why the ranks aborted, bounded: a 4 KiB part record per node stays a 4 KiB read for every
# node that polls it.
MAX_ABORT_REASON_CHARS = 1024
# What a reader takes of a manifest or part record: a larger object is refused as damaged or
# planted (it would be read whole into memory), so nothing larger is ever written.
MAX_RECORD_BYTES = 64 << 20
_MANIFEST_FIELDS = frozenset(
    {
        "format_version",
        "kind",
        "job",
        "generation",
        "world_size",
        "nodes",
        "clocks",
        "total_bytes",
        "shards",
    }
)


class NewerFormat(ManifestError):
    """A record in a format newer than this ckptdrain reads: a newer version wrote it, and
    only an upgrade reads it. Not damage: a reader that skipped it as damage answered an
    older step as the newest without saying why."""

    def __init__(self, message: str, version: int) -> None:
        super().__init__(message)
        self.version = version
        self.step: int | None = None  # the step whose record it is, where the reader knows


class RecordTooLarge(ManifestError):
    """A manifest or part record would pass :data:`MAX_RECORD_BYTES`: no reader would take it."""


def entry_bytes(path: str, size: int, rank: int, node: str) -> int:
    """The bytes one shard's line takes in a manifest or part record (a CRC64NVME checksum;
    names are ASCII that JSON writes as they are): what a generation's records will weigh,
    known before they are written."""
    return _ENTRY_FIXED_BYTES + len(path) + len(node) + len(str(size)) + len(str(rank))


# '  {"checksum": "crc64nvme:<16 hex>", "node": "", "path": "", "rank": , "size": },\n'
_ENTRY_FIXED_BYTES = 2 + len('{"checksum": "crc64nvme:0123456789abcdef", "node": "", '
                             '"path": "", "rank": , "size": }') + 2


def checked_size(body: bytes, what: str, shards: int) -> None:
    """:class:`RecordTooLarge`, saying what to do, where no reader would take ``body``."""
    if len(body) > MAX_RECORD_BYTES:
        raise RecordTooLarge(
            f"the {what} would be {len(body)} bytes for {shards} shards, over the "
            f"{MAX_RECORD_BYTES >> 20} MiB a reader takes; this generation cannot commit: "
            "save fewer, larger files (with DCP, single_file_per_rank=True)")


def _fields_of(data: bytes, what: str, fields: frozenset[str],
               optional: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The record's JSON object, its fields checked, after its format_version: a newer
    format grows by fields this version does not know, so checked first they made a newer
    version's record read as damage ("unknown field(s)") instead of :class:`NewerFormat`."""
    obj = load_json(data, what)
    if isinstance(obj, dict) and "format_version" in obj:
        version = int_field(obj["format_version"], f"{what} format_version", minimum=1)
        if version > FORMAT_VERSION:
            raise NewerFormat(
                f"{what} has format_version {version}, newer than this ckptdrain understands "
                f"({FORMAT_VERSION}); upgrade ckptdrain to read it", version
            )
    return object_field(obj, what, fields, optional)


def _check_version(obj: dict[str, Any], kind: str, what: str) -> None:
    version = int_field(obj["format_version"], f"{what} format_version", minimum=1)
    if version not in READABLE_VERSIONS:
        raise ManifestError(f"{what} has unsupported format_version {version}")
    if obj["kind"] != kind:
        raise ManifestError(f"{what} kind is {obj['kind']!r}, expected {kind!r}")


def _dumps(value: object) -> str:
    # allow_nan=False: clocks are validated finite, so this only trips on a bug.
    return json.dumps(value, sort_keys=True, separators=(", ", ": "), allow_nan=False)


def _render(header: dict[str, object], shards: Sequence[ShardEntry]) -> bytes:
    """One field per line and one shard per line: readable with ``cat`` and ``grep``, and a
    100,000-shard manifest stays near 20 MB (indented JSON would double that)."""
    lines = ["{"]
    for name in sorted(header):
        lines.append(f' "{name}": {_dumps(header[name])},')
    lines.append(' "shards": [')
    rendered = [f"  {_dumps(shard.to_dict())}" for shard in shards]
    if rendered:
        lines.append(",\n".join(rendered))
    lines.append(" ]")
    lines.append("}")
    return ("\n".join(lines) + "\n").encode("utf-8")


# --- part records ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PartRecord:
    """What one node drained for one generation: the ranks it served and their shards.

    The node rewrites it with the cumulative set as ranks finish, so the newest record of a
    node is the whole truth about that node.
    """

    job: str
    step: int
    world_size: int
    node: str
    ranks: tuple[int, ...]
    shards: tuple[ShardEntry, ...]
    clocks: dict[str, float]
    # Which attempt at the step wrote it: coverage only counts records of one attempt, so a
    # restarted job that saves the same step again never mixes with the old attempt's shards.
    attempt: str = ""
    # Ranks this node served that will never be complete in this attempt (the client aborted,
    # or a shard could not drain), and why: the other nodes end the generation at once rather
    # than wait for a manifest that cannot come. They never count as covered.
    aborted_ranks: tuple[int, ...] = ()
    abort_reason: str = ""
    # The uid that owns the job on the node that wrote it (None: a record from before owners
    # were recorded). One generation's records must all name the same owner: a node never
    # merges another user's ranks into a job.
    owner_uid: int | None = None

    def __post_init__(self) -> None:
        what = f"part record of node {self.node!r}"
        if self.owner_uid is not None and (
            isinstance(self.owner_uid, bool) or not isinstance(self.owner_uid, int)
            or not 0 <= self.owner_uid <= _MAX_UID
        ):
            raise ManifestError(f"{what}: owner_uid must be a uid (0 to {_MAX_UID})")
        if not isinstance(self.attempt, str):
            raise ManifestError(f"{what}: attempt must be a string")
        if not isinstance(self.aborted_ranks, tuple) or not isinstance(self.abort_reason, str):
            raise ManifestError(f"{what}: aborted_ranks must be a tuple, abort_reason a string")
        checked(validate_job, self.job)
        checked(validate_step, self.step)
        checked(validate_world_size, self.world_size)
        validate_node_id(self.node)
        if not isinstance(self.ranks, tuple) or not isinstance(self.shards, tuple):
            raise ManifestError(f"{what}: ranks and shards must be tuples")
        for rank in self.ranks:
            checked(validate_rank, rank, self.world_size)
        if len(set(self.ranks)) != len(self.ranks):
            raise ManifestError(f"{what} lists a rank twice: {sorted(self.ranks)}")
        check_shards(self.shards, self.world_size, what, (self.node,))
        ranks = set(self.ranks)
        self._check_aborted(what, ranks)
        for shard in self.shards:
            if shard.rank not in ranks:
                raise ManifestError(
                    f"{what} has shard {shard.path!r} of rank {shard.rank}, "
                    "which is not among its ranks"
                )
        # Normalised, so a record equals itself after a round trip through JSON.
        object.__setattr__(self, "ranks", tuple(sorted(self.ranks)))
        object.__setattr__(self, "aborted_ranks", tuple(sorted(self.aborted_ranks)))
        object.__setattr__(self, "shards", sorted_shards(self.shards))
        object.__setattr__(self, "clocks", clocks_field(self.clocks, PART_CLOCKS, what))

    def _check_aborted(self, what: str, ranks: set[int]) -> None:
        for rank in self.aborted_ranks:
            checked(validate_rank, rank, self.world_size)
        if len(set(self.aborted_ranks)) != len(self.aborted_ranks):
            raise ManifestError(f"{what} lists an aborted rank twice: {sorted(self.aborted_ranks)}")
        both = ranks.intersection(self.aborted_ranks)
        if both:
            raise ManifestError(f"{what} lists rank(s) {sorted(both)} as both drained and aborted")
        if bool(self.aborted_ranks) != bool(self.abort_reason):
            raise ManifestError(f"{what}: aborted_ranks and abort_reason go together")
        if len(self.abort_reason) > MAX_ABORT_REASON_CHARS:
            raise ManifestError(
                f"{what} abort_reason is {len(self.abort_reason)} characters; at most "
                f"{MAX_ABORT_REASON_CHARS}"
            )

    def to_json(self) -> bytes:
        header: dict[str, object] = {
            "format_version": FORMAT_VERSION,
            "kind": "part",
            "job": self.job,
            "step": self.step,
            "world_size": self.world_size,
            "node": self.node,
            "ranks": list(self.ranks),
            "clocks": self.clocks,
            "attempt": self.attempt,
        }
        if self.aborted_ranks:
            header["aborted_ranks"] = list(self.aborted_ranks)
            header["abort_reason"] = self.abort_reason
        if self.owner_uid is not None:
            header["owner_uid"] = self.owner_uid
        return _render(header, self.shards)

    @classmethod
    def from_json(cls, data: bytes) -> PartRecord:
        what = "part record"
        obj = _fields_of(data, what, _PART_FIELDS, _PART_OPTIONAL_FIELDS)
        _check_version(obj, "part", what)
        node = str_field(obj["node"], f"{what} node")
        what = f"part record of node {node!r}"
        shards = tuple(
            ShardEntry.from_dict(item, f"{what} shard {i}")
            for i, item in enumerate(list_field(obj["shards"], f"{what} shards"))
        )
        ranks = tuple(int_field(r, f"{what} rank") for r in list_field(obj["ranks"], f"{what} ranks"))
        return cls(
            job=str_field(obj["job"], f"{what} job"),
            step=int_field(obj["step"], f"{what} step"),
            world_size=int_field(obj["world_size"], f"{what} world_size", minimum=1),
            node=node,
            ranks=ranks,
            shards=shards,
            clocks=clocks_field(obj["clocks"], PART_CLOCKS, what),
            attempt=str_field(obj["attempt"], f"{what} attempt"),
            aborted_ranks=tuple(
                int_field(r, f"{what} aborted rank")
                for r in list_field(obj.get("aborted_ranks", []), f"{what} aborted_ranks")
            ),
            abort_reason=str_field(obj.get("abort_reason", ""), f"{what} abort_reason"),
            owner_uid=None if obj.get("owner_uid") is None
            else int_field(obj["owner_uid"], f"{what} owner_uid"),
        )



# --- manifests ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """A committed generation: every shard of every rank, who wrote it, and the four clocks."""

    job: str
    generation: int
    world_size: int
    shards: tuple[ShardEntry, ...]
    nodes: tuple[str, ...]
    clocks: dict[str, float]
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        what = f"manifest of {self.job!r} generation {self.generation!r}"
        checked(validate_job, self.job)
        checked(validate_step, self.generation)
        checked(validate_world_size, self.world_size)
        if self.format_version not in READABLE_VERSIONS:
            raise ManifestError(f"{what}: unsupported format_version {self.format_version}")
        if self.format_version == 1 and any(
            shard.checksum.partition(":")[0] != FORMAT_1_ALGO for shard in self.shards
        ):
            raise ManifestError(f"{what}: format_version 1 records {FORMAT_1_ALGO} checksums only")
        if not isinstance(self.shards, tuple) or not isinstance(self.nodes, tuple):
            raise ManifestError(f"{what}: shards and nodes must be tuples")
        for node in self.nodes:
            validate_node_id(node)
        if len(set(self.nodes)) != len(self.nodes):
            raise ManifestError(f"{what} lists a node twice: {list(self.nodes)}")
        check_shards(self.shards, self.world_size, what, self.nodes)
        object.__setattr__(self, "clocks", clocks_field(self.clocks, MANIFEST_CLOCKS, what))

    @property
    def total_bytes(self) -> int:
        return sum(shard.size for shard in self.shards)

    def to_json(self) -> bytes:
        header: dict[str, object] = {
            "format_version": self.format_version,
            "kind": "manifest",
            "job": self.job,
            "generation": self.generation,
            "world_size": self.world_size,
            "nodes": list(self.nodes),
            "clocks": self.clocks,
            # Derived, but written so `jq .total_bytes` answers without summing; checked on read.
            "total_bytes": self.total_bytes,
        }
        return _render(header, self.shards)

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        what = "manifest"
        obj = _fields_of(data, what, _MANIFEST_FIELDS)
        _check_version(obj, "manifest", what)
        shards = tuple(
            ShardEntry.from_dict(item, f"{what} shard {i}")
            for i, item in enumerate(list_field(obj["shards"], f"{what} shards"))
        )
        nodes = tuple(str_field(n, f"{what} node") for n in list_field(obj["nodes"], f"{what} nodes"))
        manifest = cls(
            job=str_field(obj["job"], f"{what} job"),
            generation=int_field(obj["generation"], f"{what} generation"),
            world_size=int_field(obj["world_size"], f"{what} world_size", minimum=1),
            shards=shards,
            nodes=nodes,
            clocks=clocks_field(obj["clocks"], MANIFEST_CLOCKS, what),
            format_version=int_field(obj["format_version"], f"{what} format_version", minimum=1),
        )
        total = int_field(obj["total_bytes"], f"{what} total_bytes")
        if total != manifest.total_bytes:
            raise ManifestError(
                f"{what} total_bytes is {total} but its shards sum to {manifest.total_bytes}"
            )
        return manifest
