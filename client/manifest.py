"""The on-storage formats: destination keys, part records and the generation manifest (pure).

Both the daemon (which writes them) and readers such as ``ckptdrain ls`` or a restart script
(which trust them) use this module, so parsing is strict: every field is typed and checked, and
anything unexpected is a :class:`ManifestError` rather than a guess. The layout these functions
name is documented for users in ``docs/layout.md``::

    <root>/<job>/<step, 20 digits>/<shard paths>
    <root>/<job>/<step, 20 digits>/_parts/<node>.json    one part record per node
    <root>/<job>/<step, 20 digits>/MANIFEST.json         the commit point, written last, once
    <root>/<job>/LATEST                                  a hint only
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ckptdrain.client.errors import RejectedInput
from ckptdrain.client.names import (
    MANIFEST_NAME,
    PARTS_DIR,
    TEMP_SUFFIX,
    validate_job,
    validate_rank,
    validate_shard_path,
    validate_step,
    validate_world_size,
)

# Format 2 (this version writes it): each checksum names its algorithm, crc64nvme for new
# shards (the value S3 validates as the object's full-object checksum). Format 1 manifests
# carry sha256 only; they are still read, verified and restored.
CHECKSUM_ALGO = "crc64nvme"
FORMAT_VERSION = 2
READABLE_VERSIONS = frozenset({1, 2})
FORMAT_1_ALGO = "sha256"
TMP_SUFFIX = TEMP_SUFFIX
LATEST_NAME = "LATEST"
STEP_DIGITS = 20

# The clocks a part record carries (unix seconds): when the first hand-off of the node's ranks
# began, when the last shard was staged, and when the last shard drained.
PART_CLOCKS = ("handoff", "staged", "drained")
# The manifest adds the moment the generation was committed.
MANIFEST_CLOCKS = (*PART_CLOCKS, "committed")

# Node ids become file names (part records, temp files): same narrow charset as job names.
MAX_NODE_BYTES = 128
_NODE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_GENERATION_RE = re.compile(r"[0-9]{20}")
_HEX_DIGITS = {"sha256": 64, "crc64nvme": 16}
_HEX_RE = re.compile(r"[0-9a-f]+")

_SHARD_FIELDS = frozenset({"path", "size", "checksum", "rank", "node"})
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


_T = TypeVar("_T")


class ManifestError(ValueError):
    """A part record or manifest is malformed or inconsistent; the message names the field."""


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


# --- keys -----------------------------------------------------------------------------------


def validate_node_id(node: object) -> str:
    """Return ``node`` if it can name a part record and a temp file, else raise ManifestError."""
    if not isinstance(node, str) or not _NODE_RE.fullmatch(node):
        raise ManifestError(
            f"node id {node!r} is not acceptable; use 1-{MAX_NODE_BYTES} letters, digits, "
            "'.', '_', '-', not starting with '.' or '-' (set node_id in the config)"
        )
    return node


def _checked(fn: Callable[..., _T], value: object, *args: object) -> _T:
    """Run a names.py validator, turning its client-facing error into a ManifestError."""
    try:
        return fn(value, *args)
    except RejectedInput as exc:
        raise ManifestError(exc.message) from exc


def generation_prefix(job: str, step: int) -> str:
    """``<job>/<step as 20 zero-padded digits>/``: zero padding makes key order step order."""
    _checked(validate_job, job)
    _checked(validate_step, step)
    return f"{job}/{step:0{STEP_DIGITS}d}/"


def shard_key(job: str, step: int, path: str) -> str:
    _checked(validate_shard_path, path)
    return generation_prefix(job, step) + path


def parts_prefix(job: str, step: int) -> str:
    return f"{generation_prefix(job, step)}{PARTS_DIR}/"


def part_key(job: str, step: int, node_id: str) -> str:
    return f"{parts_prefix(job, step)}{validate_node_id(node_id)}.json"


def manifest_key(job: str, step: int) -> str:
    return f"{generation_prefix(job, step)}{MANIFEST_NAME}"


def latest_key(job: str) -> str:
    _checked(validate_job, job)
    return f"{job}/{LATEST_NAME}"


def parse_generation_dir(name: str) -> int | None:
    """The step a generation directory name stands for, or None if it is not one."""
    if not _GENERATION_RE.fullmatch(name):
        return None
    step = int(name)
    try:
        validate_step(step)
    except RejectedInput:
        return None
    return step


def parse_manifest_key(key: str) -> tuple[str, int] | None:
    """``(job, step)`` when ``key`` is ``<job>/<20 digits>/MANIFEST.json``, else None."""
    parts = key.split("/")
    if len(parts) != 3 or parts[2] != MANIFEST_NAME:
        return None
    step = parse_generation_dir(parts[1])
    if step is None:
        return None
    try:
        validate_job(parts[0])
    except RejectedInput:
        return None
    return parts[0], step


# --- checksums ------------------------------------------------------------------------------


def format_checksum(algo: str, digest_hex: str) -> str:
    """``"<algo>:<hex>"``, the form every checksum takes on storage and on the wire."""
    return _checksum_string(algo, digest_hex, "checksum")


def parse_checksum(checksum: str) -> tuple[str, str]:
    """Split ``"crc64nvme:<16 hex>"`` (or format 1's ``"sha256:<64 hex>"``) into
    ``(algo, hex)``; anything else is a ManifestError."""
    if not isinstance(checksum, str) or ":" not in checksum:
        raise ManifestError(f"checksum {checksum!r} is not of the form '{CHECKSUM_ALGO}:<hex>'")
    algo, _, digest = checksum.partition(":")
    _checksum_string(algo, digest, "checksum")
    return algo, digest


def _checksum_string(algo: str, digest_hex: str, what: str) -> str:
    expected = _HEX_DIGITS.get(algo)
    if expected is None:
        raise ManifestError(f"{what} algorithm {algo!r} is not supported; use {CHECKSUM_ALGO!r}")
    if len(digest_hex) != expected or not _HEX_RE.fullmatch(digest_hex):
        raise ManifestError(
            f"{what} digest {digest_hex!r} is not {expected} lowercase hex digits for {algo}"
        )
    return f"{algo}:{digest_hex}"


# --- typed field readers (shared by both formats) -------------------------------------------


# No field of a record is larger (a step, a size in bytes, a uid); past it, a number a hostile
# writer planted (10**400) crashed every reader that did arithmetic with it (found attacking).
MAX_FIELD_INT = 2**63 - 1
# The last second of year 9999: later, a clock is no time a reader can show (found attacking:
# 1e20 crashed `ls`).
MAX_CLOCK = 253402300799.0


def _shown(number: int | float) -> str:
    """``number`` for a message, short whatever its size (str() of a 5,000-digit int raises)."""
    if isinstance(number, int) and abs(number) > MAX_FIELD_INT:
        return f"an integer of {number.bit_length()} bits"
    return f"{number:.6g}" if isinstance(number, float) else str(number)


def _int(value: object, what: str, *, minimum: int = 0) -> int:
    # bool is an int subclass; ``true`` in a size field is corruption, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ManifestError(f"{what} must be an integer, not {type(value).__name__}")
    if not minimum <= value <= MAX_FIELD_INT:
        raise ManifestError(f"{what} is {_shown(value)}; it must be {minimum}..{MAX_FIELD_INT}")
    return value


def _str(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise ManifestError(f"{what} must be a string, not {type(value).__name__}")
    return value


def _list(value: object, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ManifestError(f"{what} must be a list, not {type(value).__name__}")
    return value


def _object(
    value: object, what: str, fields: frozenset[str], optional: frozenset[str] = frozenset()
) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ManifestError(f"{what} must be an object, not {type(value).__name__}")
    missing = sorted(fields - value.keys())
    if missing:
        raise ManifestError(f"{what} lacks {', '.join(missing)}")
    # Strict: an unknown field means a newer or foreign writer; format_version is how the
    # format grows, so guessing past an unknown field could hide a changed meaning.
    unknown = sorted(value.keys() - fields - optional)
    if unknown:
        raise ManifestError(f"{what} has unknown field(s) {', '.join(unknown)}")
    return value


def _clocks(value: object, names: tuple[str, ...], what: str) -> dict[str, float]:
    if not isinstance(value, Mapping):
        raise ManifestError(f"{what} clocks must be an object, not {type(value).__name__}")
    if set(value.keys()) != set(names):
        raise ManifestError(
            f"{what} clocks are {sorted(value.keys())}; expected exactly {list(names)}"
        )
    clocks: dict[str, float] = {}
    for name in names:
        raw = value[name]
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise ManifestError(f"{what} clock {name!r} must be a number of unix seconds")
        if not 0 <= raw <= MAX_CLOCK:  # (compared before float(): 10**400 is no float)
            raise ManifestError(f"{what} clock {name!r} is {_shown(raw)}; it must be a unix time "
                                f"from 0 to {MAX_CLOCK:.0f}")
        number = float(raw)
        clocks[name] = number
    return clocks


def _load_json(data: bytes, what: str) -> object:
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ManifestError(f"{what} is not valid JSON: {exc}") from exc
    except RecursionError:
        # Arrays nested a few thousand deep exhaust the decoder's stack: what a hostile
        # writer at the destination leaves; every reader must skip it, not crash on it.
        raise ManifestError(f"{what} is not valid JSON: nested too deeply") from None


def _check_version(obj: dict[str, Any], kind: str, what: str) -> None:
    version = _int(obj["format_version"], f"{what} format_version", minimum=1)
    if version > FORMAT_VERSION:
        raise ManifestError(
            f"{what} has format_version {version}, newer than this ckptdrain understands "
            f"({FORMAT_VERSION}); upgrade ckptdrain to read it"
        )
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


# --- shard entries --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShardEntry:
    """One shard as committed: its path in the generation, size, checksum and writer."""

    path: str
    size: int
    checksum: str
    rank: int
    node: str

    def __post_init__(self) -> None:
        _checked(validate_shard_path, self.path)
        _int(self.size, f"shard {self.path!r} size")
        parse_checksum(self.checksum)
        _int(self.rank, f"shard {self.path!r} rank")
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
        obj = _object(value, what, _SHARD_FIELDS)
        path = _str(obj["path"], f"{what} path")
        try:
            return cls(
                path=path,
                size=_int(obj["size"], f"{what} size"),
                checksum=_str(obj["checksum"], f"{what} checksum"),
                rank=_int(obj["rank"], f"{what} rank"),
                node=_str(obj["node"], f"{what} node"),
            )
        except ManifestError as exc:
            raise ManifestError(f"{what}: {exc}") from exc


def _check_shards(
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
        _checked(validate_rank, shard.rank, world_size)
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
        _checked(validate_job, self.job)
        _checked(validate_step, self.step)
        _checked(validate_world_size, self.world_size)
        validate_node_id(self.node)
        if not isinstance(self.ranks, tuple) or not isinstance(self.shards, tuple):
            raise ManifestError(f"{what}: ranks and shards must be tuples")
        for rank in self.ranks:
            _checked(validate_rank, rank, self.world_size)
        if len(set(self.ranks)) != len(self.ranks):
            raise ManifestError(f"{what} lists a rank twice: {sorted(self.ranks)}")
        _check_shards(self.shards, self.world_size, what, (self.node,))
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
        object.__setattr__(self, "clocks", _clocks(self.clocks, PART_CLOCKS, what))

    def _check_aborted(self, what: str, ranks: set[int]) -> None:
        for rank in self.aborted_ranks:
            _checked(validate_rank, rank, self.world_size)
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
        obj = _object(_load_json(data, what), what, _PART_FIELDS, _PART_OPTIONAL_FIELDS)
        _check_version(obj, "part", what)
        node = _str(obj["node"], f"{what} node")
        what = f"part record of node {node!r}"
        shards = tuple(
            ShardEntry.from_dict(item, f"{what} shard {i}")
            for i, item in enumerate(_list(obj["shards"], f"{what} shards"))
        )
        ranks = tuple(_int(r, f"{what} rank") for r in _list(obj["ranks"], f"{what} ranks"))
        return cls(
            job=_str(obj["job"], f"{what} job"),
            step=_int(obj["step"], f"{what} step"),
            world_size=_int(obj["world_size"], f"{what} world_size", minimum=1),
            node=node,
            ranks=ranks,
            shards=shards,
            clocks=_clocks(obj["clocks"], PART_CLOCKS, what),
            attempt=_str(obj["attempt"], f"{what} attempt"),
            aborted_ranks=tuple(
                _int(r, f"{what} aborted rank")
                for r in _list(obj.get("aborted_ranks", []), f"{what} aborted_ranks")
            ),
            abort_reason=_str(obj.get("abort_reason", ""), f"{what} abort_reason"),
            owner_uid=None if obj.get("owner_uid") is None
            else _int(obj["owner_uid"], f"{what} owner_uid"),
        )


def sorted_shards(shards: Sequence[ShardEntry]) -> tuple[ShardEntry, ...]:
    return tuple(sorted(shards, key=lambda s: (s.rank, s.path)))


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
        _checked(validate_job, self.job)
        _checked(validate_step, self.generation)
        _checked(validate_world_size, self.world_size)
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
        _check_shards(self.shards, self.world_size, what, self.nodes)
        object.__setattr__(self, "clocks", _clocks(self.clocks, MANIFEST_CLOCKS, what))

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
        obj = _object(_load_json(data, what), what, _MANIFEST_FIELDS)
        _check_version(obj, "manifest", what)
        shards = tuple(
            ShardEntry.from_dict(item, f"{what} shard {i}")
            for i, item in enumerate(_list(obj["shards"], f"{what} shards"))
        )
        nodes = tuple(_str(n, f"{what} node") for n in _list(obj["nodes"], f"{what} nodes"))
        manifest = cls(
            job=_str(obj["job"], f"{what} job"),
            generation=_int(obj["generation"], f"{what} generation"),
            world_size=_int(obj["world_size"], f"{what} world_size", minimum=1),
            shards=shards,
            nodes=nodes,
            clocks=_clocks(obj["clocks"], MANIFEST_CLOCKS, what),
            format_version=_int(obj["format_version"], f"{what} format_version", minimum=1),
        )
        total = _int(obj["total_bytes"], f"{what} total_bytes")
        if total != manifest.total_bytes:
            raise ManifestError(
                f"{what} total_bytes is {total} but its shards sum to {manifest.total_bytes}"
            )
        return manifest


def parents(path: str) -> list[str]:
    """The directories a shard path lies in: ``a/b/c`` -> ``["a", "a/b"]``."""
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]
