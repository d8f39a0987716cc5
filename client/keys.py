"""Where each object of a generation lives at the destination (pure): its keys, and the node
ids that name part records. The layout, documented for users in ``docs/layout.md``::

    <root>/<job>/<step, 20 digits>/<shard paths>
    <root>/<job>/<step, 20 digits>/_parts/<node>.json    one part record per node
    <root>/<job>/<step, 20 digits>/MANIFEST.json         the commit point, written last, once
    <root>/<job>/LATEST                                  a hint only

Apart from ``manifest.py`` (what those objects hold): listing, retention and restore name and
parse keys without reading a record.
"""

from __future__ import annotations

import re

from ckptdrain.client.errors import RejectedInput
from ckptdrain.client.names import (
    MANIFEST_NAME,
    PARTS_DIR,
    validate_job,
    validate_shard_path,
    validate_step,
)
from ckptdrain.client.recordfields import ManifestError, checked

LATEST_NAME = "LATEST"
STEP_DIGITS = 20

# Node ids become file names (part records, temp files): same narrow charset as job names.
MAX_NODE_BYTES = 128
_NODE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_GENERATION_RE = re.compile(r"[0-9]{20}")


def is_node_id(node: str) -> bool:
    """Whether validate_node_id takes the string ``node``."""
    return _NODE_RE.fullmatch(node) is not None


def validate_node_id(node: object) -> str:
    """Return ``node`` if it can name a part record and a temp file, else raise ManifestError."""
    if not isinstance(node, str) or not _NODE_RE.fullmatch(node):
        raise ManifestError(
            f"node id {node!r} is not acceptable; use 1-{MAX_NODE_BYTES} letters, digits, "
            "'.', '_', '-', not starting with '.' or '-' (set node_id in the config)"
        )
    return node


def generation_prefix(job: str, step: int) -> str:
    """``<job>/<step as 20 zero-padded digits>/``: zero padding makes key order step order."""
    checked(validate_job, job)
    checked(validate_step, step)
    return f"{job}/{step:0{STEP_DIGITS}d}/"


def shard_key(job: str, step: int, path: str) -> str:
    checked(validate_shard_path, path)
    return generation_prefix(job, step) + path


def parts_prefix(job: str, step: int) -> str:
    return f"{generation_prefix(job, step)}{PARTS_DIR}/"


def part_key(job: str, step: int, node_id: str) -> str:
    return f"{parts_prefix(job, step)}{validate_node_id(node_id)}.json"


def manifest_key(job: str, step: int) -> str:
    return f"{generation_prefix(job, step)}{MANIFEST_NAME}"


def latest_key(job: str) -> str:
    checked(validate_job, job)
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
