"""The tombstone: what retention writes at ``MANIFEST.json`` of a generation it removes,
before it deletes anything.

The manifest key is the one key every publisher of a generation must create (exclusively),
so it is the only place where "publish" and "delete the shards" can exclude each other on a
destination without multi-key transactions. Retention takes the key with its own exclusive
create (an abandoned generation's), or replaces the manifest with one write (a committed
one's, so the key is never empty); from then on no node's publish can succeed, and retention deletes the shards knowing
no manifest can appear over them (docs/layout.md, "Retention racing a late publish").

A tombstone is not a manifest: ``Manifest.from_json`` refuses it (it lacks the manifest's
fields), so every reader, older versions included, sees a generation that is not committed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from ckptdrain.client.manifest import FORMAT_VERSION

TOMBSTONE_KIND = "abandoned"
# A tombstone is a few hundred bytes; anything much larger is a manifest (or foreign). Older
# versions read nothing larger as a tombstone (they took it for a damaged manifest, and their
# retention replaced it): a tombstone names a committed generation's nodes only while it stays
# within this (found attacking a rolling upgrade).
_MAX_TOMBSTONE_BYTES = 4096


def tombstone_json(job: str, step: int, node: str, at: float, *,
                   was_committed: bool = False,
                   committed_by: tuple[int, Sequence[str]] | None = None) -> bytes:
    """The tombstone of ``job`` step ``step``, written by retention on ``node`` at ``at``;
    ``was_committed`` for a committed generation retention removes (beyond keep_last), whose
    manifest it replaces (a late publish finding it is told so, not "abandoned").
    ``committed_by``: that manifest's world size and nodes, so that a node still waiting on
    the step can tell whether its own part was the one committed (:func:`committed_by`); the
    nodes only while the tombstone stays within _MAX_TOMBSTONE_BYTES."""
    body: dict[str, object] = {
        "abandoned_at": at,
        "format_version": FORMAT_VERSION,
        "generation": step,
        "job": job,
        "kind": TOMBSTONE_KIND,
        "node": node,
    }
    if was_committed:
        body["was_committed"] = True
        if committed_by is not None:
            body["world_size"] = committed_by[0]
            named = _encoded(body | {"nodes": sorted(committed_by[1])})
            if len(named) <= _MAX_TOMBSTONE_BYTES:
                return named
    return _encoded(body)


def _encoded(body: dict[str, object]) -> bytes:
    return (json.dumps(body, sort_keys=True) + "\n").encode()


def committed_by(data: bytes) -> tuple[int | None, frozenset[str] | None]:
    """The world size and nodes of the manifest a committed generation's tombstone replaced,
    each None where it does not say (written by an older version; the nodes, where naming
    them would make the tombstone too large for older readers). A field that is there but no
    world size (a string, a boolean) or no list of node names says none: -1 and no node."""
    obj = _fields(data)
    if obj is None:
        return -1, frozenset()
    size: int | None = None
    if "world_size" in obj:
        given = obj["world_size"]
        size = given if isinstance(given, int) and not isinstance(given, bool) else -1
    nodes: frozenset[str] | None = None
    if "nodes" in obj:
        listed = obj["nodes"]
        nodes = (frozenset(listed) if isinstance(listed, list)
                 and all(isinstance(n, str) for n in listed) else frozenset())
    return size, nodes


def names_step(data: bytes, job: str, step: int) -> bool:
    """Whether a tombstone says it is that of ``job`` step ``step``."""
    obj = _fields(data) or {}
    return (obj.get("job") == job and obj.get("generation") == step
            and not isinstance(obj.get("generation"), bool))


def placed_at(data: bytes) -> float | None:
    """When a tombstone says it was written (its writer's clock), or None where it says no
    finite time (written by hand, or damaged)."""
    at = (_fields(data) or {}).get("abandoned_at")
    try:
        when = float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else None
    except OverflowError:  # an integer too large for a float
        return None
    return when if when is not None and math.isfinite(when) else None


def was_committed(data: bytes) -> bool:
    """Whether a tombstone (:func:`is_tombstone`) stands where a committed manifest was."""
    return (_fields(data) or {}).get("was_committed") is True


def is_tombstone(data: bytes) -> bool:
    """Whether these bytes, read from a MANIFEST.json key, are a tombstone."""
    if len(data) > _MAX_TOMBSTONE_BYTES:
        return False
    return (_fields(data) or {}).get("kind") == TOMBSTONE_KIND


def _fields(data: bytes) -> dict[str, Any] | None:
    """A tombstone's fields, or None where the bytes are no JSON object (damaged, foreign):
    every reader of a tombstone parses it here."""
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None
