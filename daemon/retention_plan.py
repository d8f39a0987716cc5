"""Retention's decisions, without I/O: which generations of a job stay, which go, and in
which order their keys are deleted (the rules are in docs/layout.md, "Retention").

:mod:`ckptdrain.daemon.retention` lists the generations, reads the manifests it needs, lists
the generations it may remove, and applies what :func:`plan_retention` decides.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ckptdrain.client.keys import manifest_key, parse_generation_dir, parts_prefix
from ckptdrain.daemon.backends.base import ObjectInfo


@dataclass(frozen=True)
class GenerationKeys:
    """Everything listed under one generation directory."""

    step: int
    keys: tuple[str, ...]
    has_manifest: bool
    # Unix time of the newest object, or None when the destination did not say for some key.
    newest_write: float | None
    # Unix time the MANIFEST.json key was written (None: absent, or not reported): how old a
    # tombstone is.
    manifest_written: float | None = None


@dataclass(frozen=True)
class RetentionPlan:
    kept: list[int]
    delete_committed: list[int]
    delete_abandoned: list[int]
    skipped: list[tuple[int, str]]
    newest_committed: int | None


def group_generations(job: str, infos: Iterable[ObjectInfo]) -> dict[int, GenerationKeys]:
    """The generation directories of ``job`` in a listing of ``<job>/``, by step.

    Keys that are not under a ``<20 digits>/`` directory (``LATEST``, stray files) are
    ignored: retention removes only what the layout says is a generation.
    """
    head = f"{job}/"
    keys: dict[int, list[str]] = {}
    newest: dict[int, float | None] = {}
    manifest_written: dict[int, float | None] = {}
    manifests: dict[int, str] = {}  # a key built once per step, not once per listed key
    for info in infos:
        if not info.key.startswith(head):
            continue
        dirname, sep, rest = info.key[len(head) :].partition("/")
        if not sep or not rest:
            continue
        step = parse_generation_dir(dirname)
        if step is None:
            continue
        keys.setdefault(step, []).append(info.key)
        if step not in manifests:
            manifests[step] = manifest_key(job, step)
        if info.key == manifests[step]:
            manifest_written[step] = info.modified
        before = newest.get(step, 0.0)
        if before is None or info.modified is None:
            newest[step] = None
        else:
            newest[step] = max(before, info.modified)
    return {
        step: GenerationKeys(
            step=step,
            keys=tuple(sorted(found)),
            has_manifest=manifests[step] in found,
            newest_write=newest[step],
            manifest_written=manifest_written.get(step),
        )
        for step, found in keys.items()
    }


def plan_retention(
    generations: Mapping[int, GenerationKeys],
    valid: Sequence[int],
    unreadable: Mapping[int, str],
    *,
    keep_last: int,
    abandoned_grace_s: float,
    now: float,
    tombstoned: Collection[int] = (),
) -> RetentionPlan:
    """Decide what to keep and what to remove.

    ``valid`` are the steps whose manifests were read and are valid, newest first, and
    ``unreadable`` the steps whose manifest key was listed but did not read back as a valid
    manifest (with the reason). Manifests are validated newest first until ``keep_last``
    valid ones are found; older manifest keys need not have been read, they are removed.
    ``tombstoned`` are steps whose manifest key holds a retention tombstone: an abandoned
    removal under way, finished whatever their age (nothing can publish them any more).
    """
    check_arguments(keep_last, abandoned_grace_s)
    kept = sorted(valid, reverse=True)[:keep_last]
    newest = kept[0] if kept else None
    # Manifest-bearing generations below the oldest kept one go; with fewer than keep_last
    # valid generations there is no such boundary and none goes.
    boundary = kept[-1] if len(kept) == keep_last else None
    delete_committed: list[int] = []
    delete_abandoned: list[int] = []
    skipped: list[tuple[int, str]] = []
    for step in sorted(generations, reverse=True):
        gen = generations[step]
        if step in kept:
            continue
        if step in tombstoned:
            delete_abandoned.append(step)
            continue
        if gen.has_manifest:
            if boundary is not None and step < boundary:
                delete_committed.append(step)
            else:
                reason = unreadable.get(step, "its manifest was not read")
                skipped.append((step, f"manifest not usable ({reason}); kept for inspection"))
            continue
        if newest is None:
            skipped.append((step, "uncommitted, and the job has no committed generation yet"))
        elif step > newest:
            skipped.append((step, "uncommitted and newer than the newest committed: in flight"))
        elif gen.newest_write is None:
            skipped.append(
                (step, "uncommitted, but the destination does not report write times")
            )
        elif now - gen.newest_write < abandoned_grace_s:
            skipped.append(
                (
                    step,
                    f"uncommitted, last written {max(now - gen.newest_write, 0.0):.0f}s ago, "
                    f"within the {abandoned_grace_s:g}s grace period",
                )
            )
        else:
            delete_abandoned.append(step)
    return RetentionPlan(
        kept=kept,
        delete_committed=delete_committed,
        delete_abandoned=delete_abandoned,
        skipped=skipped,
        newest_committed=newest,
    )


def deletion_order(job: str, gen: GenerationKeys) -> tuple[list[str], list[str], list[str]]:
    """``(manifest, part records, everything else)``: the three batches. A committed
    generation loses them in this order; an abandoned one keeps its manifest key (the
    tombstone) until last."""
    manifest = manifest_key(job, gen.step)
    parts = parts_prefix(job, gen.step)
    first = [k for k in gen.keys if k == manifest]
    second = [k for k in gen.keys if k.startswith(parts)]
    rest = [k for k in gen.keys if k != manifest and not k.startswith(parts)]
    return first, second, rest


def check_arguments(keep_last: int, abandoned_grace_s: float) -> None:
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(
            f"keep_last must be an integer >= 1 (the newest committed generation is always "
            f"kept), not {keep_last!r}"
        )
    if not abandoned_grace_s >= 0:
        raise ValueError(f"abandoned_grace_s must be >= 0 seconds, not {abandoned_grace_s!r}")

