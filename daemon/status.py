"""What ``ckptdrain status`` and the metrics snapshot show: built from memory only.

The staging filesystem's free space is sampled by the refresh loop in the data plane (statvfs
can block on a sick disk), so answering ``status`` never touches the disk.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ckptdrain.daemon import __version__
from ckptdrain.daemon.metricsgauges import Snapshot
from ckptdrain.daemon.state import UNDRAINED_SHARD, GenerationState, ShardState

if TYPE_CHECKING:
    from ckptdrain.daemon.access import Peer
    from ckptdrain.daemon.records import GenerationRecord
    from ckptdrain.daemon.server import Daemon


# The reply is one wire frame (64 KiB of header at most), whatever the node holds:
# generations in flight are listed first, then the newest ended ones, for as long as they fit
# this many bytes of JSON (at most MAX_STATUS_GENERATIONS of them); the rest are counted.
MAX_STATUS_GENERATIONS = 100
GENERATIONS_BYTES = 40 * 1024
MAX_STATUS_JOBS = 100  # jobs with an oldest-undrained age shown
# Shards being copied to the destination, with their progress, listed up to this many.
MAX_STATUS_DRAINING = 32


def shards_draining(gens: list[Any]) -> list[dict[str, Any]]:
    """The shards of ``gens`` being drained now and how far each is (bytes at the destination
    of its size, and ``idle_s``: seconds since its copy last moved bytes, or began), the
    longest-waiting first: "stuck or slow?" answered per shard. A hung destination shows
    here long before a request to it times out (read_timeout_s)."""
    found = [(g, s) for g in gens for s in g.open_shards.values()
             if s.state is ShardState.DRAINING]
    found.sort(key=lambda gs: gs[1].staged_at)
    now = time.monotonic()
    return [{"job": g.job, "step": g.step, "path": s.path, "size": s.size,
             "drained_bytes": s.moved_bytes,
             "idle_s": round(max(0.0, now - s.progress_mono), 1) if s.progress_mono else 0.0}
            for g, s in found[:MAX_STATUS_DRAINING]]



def metrics_url(address: tuple[str, int] | None) -> str | None:
    """The endpoint's URL, an IPv6 host in brackets: with ``metrics.listen = "[::1]:9464"``
    status said ``http://::1:9464/metrics``, which no HTTP client opens (found as a new
    operator); the ready log line said ``["::1",9464]``."""
    if not address:
        return None
    host, port = address[0], address[1]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def status(d: Daemon, *, job: str | None = None, peer: Peer | None = None) -> dict[str, Any]:
    """The node's status. ``job`` keeps one job's generations; a ``peer`` that is not an
    operator sees only the jobs it owns (the node-wide numbers are shown to all)."""
    owners = d.ledger.jobs
    # Asked once, not per generation: a node's ledger holds thousands of them, and hostile
    # clients may ask for status many times a second.
    sees_all = peer is None or peer.operator
    gens = [g for g in d.ledger.generations.values()
            if (job is None or g.job == job)
            and (sees_all or (peer is not None and peer.may_see(owners.get(g.job))))]
    # Left out first: ended generations that hold nothing, oldest first. A failed one whose
    # copies are kept for `retry` is shown ahead of them (found attacking: after 100 newer
    # commits, the only failure on the node, its copies on this node alone, was hidden).
    by_recency = sorted(gens, key=lambda g: (
        0 if not g.terminal else 1 if g.by_state[ShardState.FAILED] else 2, -g.created_mono))
    shown = [{**g.summary(), "uid": owners.get(g.job)}
             for g in by_recency[:MAX_STATUS_GENERATIONS]]
    # Encoded once as a list: one summary at a time (a json.dumps call each) was half of what
    # a status cost with a ledger of 300 generations. Only a list over its room is measured
    # item by item, to cut it.
    shown_bytes = _size(shown)
    if shown_bytes > GENERATIONS_BYTES:
        room = GENERATIONS_BYTES
        for i, summary in enumerate(shown):
            room -= _size(summary) + 2
            if room < 0:
                del shown[i:]
                break
        shown_bytes = _size(shown)
    shown.sort(key=lambda s: (s["job"], s["step"]))
    now = time.monotonic()  # the moments are monotonic (records.monotonic_of)
    oldest = {job: round(now - since, 3)
              for job, since in oldest_undrained(gens).items() if since is not None}
    if len(oldest) > MAX_STATUS_JOBS:
        oldest = dict(sorted(oldest.items(), key=lambda kv: -kv[1])[:MAX_STATUS_JOBS])
    free_bytes, free_inodes = d.staging_free
    a = d.admission
    return _fit({
        "node_id": d.node_id,
        "version": __version__,
        "uptime_s": round(now - d.started_mono, 3),
        "ack": d.config.ack,
        "destination": d.config.destination.uri,
        # The last SIGHUP: why it failed (the old config runs on), and the keys changed since
        # the start that only a restart applies.
        "config": {"reload_failed": d.reloads.failed,
                   "needs_restart": d.reloads.needs_restart},
        "metrics": metrics_url(d.metrics_address),
        # Every byte on staging counted against max_staged_bytes; of those, kept_copy_bytes
        # are drained copies kept for a fast restore, evicted when a hand-off needs the room.
        "staged_bytes": a.staged.used,
        "kept_copy_bytes": d.copies.kept_bytes,
        # Dropped copies a reader still holds open (lent by `open`): on the disk until closed.
        "held_open_copy_bytes": d.copies.pinned_bytes,
        "memory_bytes": a.memory.used,
        "limits": {
            "max_staged_bytes": a.staged.limit,
            # The configured limit, present only when the staging filesystem clamped it.
            **({"max_staged_bytes_configured": d.staged_limit_clamped_from}
               if d.staged_limit_clamped_from is not None else {}),
            "max_memory_bytes": a.memory.limit,
            "max_queued_shards": a.shards.limit,
            "max_generations_in_flight": d.config.limits.max_generations_in_flight,
            "on_full": d.config.limits.on_full,
        },
        "queued_shards": a.shards.used,
        "staging_free_bytes": free_bytes,
        "staging_free_inodes": free_inodes,
        "drain_rate_bytes_per_s": round(d.scheduler.drain_rate_bytes_per_s(), 1),
        # Drain ranges and parts that waited for hand-offs in flight (drain.yield_to_handoffs_s).
        "drain_yields": d.scheduler.yielding.yielded,
        "blocked_handoffs": a.waiting,
        "oldest_undrained_age_s": oldest,
        # What blocked hand-offs wait for: hand-offs waiting per limit.
        "blocked_by_limit": {
            name: waiting for name, waiting in (
                ("max_staged_bytes", a.staged.waiting),
                ("max_memory_bytes", a.memory.waiting),
                ("max_queued_shards", a.shards.waiting),
                ("max_generations_in_flight", a.slots_waiting),
                *a.share_waiting.items(),
            ) if waiting
        },
        # The data plane: threads moving bytes now, and calls that outlived io_timeout_s.
        "io_threads": {"size": d.dataplane.threads, "busy": d.dataplane.busy,
                       "stuck": d.dataplane.stuck},
        "draining": d.draining,
        "shards_draining": shards_draining(gens),
        "generations": shown,
        "generations_omitted": len(gens) - len(shown),
        **_uploads(d, gens),
    }, {"generations": shown_bytes})


# The whole reply, as JSON: under the 64 KiB of one frame, with room for the envelope.
REPLY_BYTES = 60 * 1024


def _size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False).encode())


_LISTS = ("uploads_open", "shards_draining", "generations")


def _fit(reply: dict[str, Any], measured: dict[str, int]) -> dict[str, Any]:
    """Cut the reply's lists from their ends (open uploads, then shards draining, then
    generations) until the whole of it fits one frame: however long the job names and shard
    paths, `status` answers. ``measured``: the JSON size of lists already encoded, by key
    (the rest of the reply is encoded here, each list on its own, not the whole again)."""
    over = (_size({k: [] if k in _LISTS else v for k, v in reply.items()})
            + sum(measured[k] if k in measured else _size(reply[k]) for k in _LISTS)
            - REPLY_BYTES)
    for key in _LISTS:
        items = reply[key]
        while over > 0 and items:
            over -= _size(items.pop()) + 2
            if key == "generations":
                reply["generations_omitted"] += 1
    return reply


MAX_STATUS_UPLOADS = 50


def _uploads(d: Daemon, gens: list[Any]) -> dict[str, Any]:
    """S3 multipart uploads this node has begun and not completed or aborted, oldest first
    (what an operator looks for when a drain seems stuck): up to MAX_STATUS_UPLOADS. Each open
    upload's shard is found by its id (O(open uploads)); the ids no shard held names any more
    (forgotten generations') are dropped."""
    open_ids = d.journal.open_uploads
    shown = {id(g) for g in gens}
    found: list[dict[str, Any]] = []
    stale = []
    now = time.monotonic()
    for sid, (upload_id, since) in open_ids.items():
        held = d.ledger.shard_index.get(sid)
        if held is None:
            stale.append(sid)
            continue
        g, s = held
        if id(g) in shown:
            found.append({"job": g.job, "step": g.step, "path": s.path, "size": s.size,
                          "state": str(s.state), "upload_id": upload_id,
                          "age_s": round(now - since, 3)})
    for sid in stale:
        del open_ids[sid]
    found.sort(key=lambda u: -u["age_s"])
    return {"uploads_open": found[:MAX_STATUS_UPLOADS], "uploads_open_count": len(found)}


def oldest_undrained(gens: Iterable[GenerationRecord]) -> dict[str, float | None]:
    """Job -> when its oldest shard not yet at the destination was staged (None: none).

    A failed generation older than a step its job has committed since is left out: no retry
    can make it the newest, and counting it kept CkptdrainOldestUndrainedTooOld firing on a
    node that drained fine, until the generation was forgotten up to a day later (found
    attacking the metrics). ``status`` still lists it, and its own age, as failed."""
    gens = list(gens)
    newest: dict[str, int] = {}
    for g in gens:
        if g.state is GenerationState.COMMITTED and g.step > newest.get(g.job, -1):
            newest[g.job] = g.step
    oldest: dict[str, float | None] = {}
    for g in gens:
        oldest.setdefault(g.job, None)
        if g.state is GenerationState.FAILED and g.step < newest.get(g.job, -1):
            continue
        since = g.oldest_undrained_since()
        if since is not None:
            current = oldest[g.job]
            oldest[g.job] = since if current is None else min(current, since)
    return oldest


_KEPT_FOR_RETRY = frozenset({ShardState.HELD, ShardState.STAGED, ShardState.DRAINING})


def refresh_snapshot(d: Daemon) -> None:
    shards_by_state: dict[str, int] = {}
    oldest = oldest_undrained(d.ledger.generations.values())
    in_flight: dict[str, int] = {}
    for g in d.ledger.generations.values():
        if not g.terminal:
            in_flight[g.job] = in_flight.get(g.job, 0) + 1
        failed = g.state is GenerationState.FAILED
        given_up = g.never_drains
        for st, n in g.by_state.items():
            if n:
                # A failed generation's copies are failed, whatever state their drain reached:
                # kept for `retry`, they read "staged", which the runbook takes for a stuck
                # scheduler (found attacking). Those of one given up for good are discarded.
                if given_up and st in UNDRAINED_SHARD:
                    st = ShardState.DISCARDED
                elif failed and st in _KEPT_FOR_RETRY:
                    st = ShardState.FAILED
                shards_by_state[st] = shards_by_state.get(st, 0) + n
        if g.receiving:
            shards_by_state["receiving"] = shards_by_state.get("receiving", 0) + len(g.receiving)
    free_bytes, free_inodes = d.staging_free
    a = d.admission
    d.metrics.set_snapshot(Snapshot(
        oldest_undrained_since=oldest,
        shards_by_state=shards_by_state,
        config_reload_failed=d.reloads.failed is not None,
        config_needs_restart=len(d.reloads.needs_restart),
        staged_bytes={"local": a.staged.used, "memory": a.memory.used},
        kept_copy_bytes=d.copies.kept_bytes,
        limit_bytes={"local": a.staged.limit, "memory": d.config.limits.max_memory_bytes},
        queued_shards=a.shards.used,
        max_queued_shards=a.shards.limit,
        staging_free_bytes=free_bytes,
        staging_free_inodes=free_inodes,
        generations_in_flight=in_flight,
        blocked_handoffs=a.waiting,
        drain_rate_bytes_per_s=d.scheduler.drain_rate_bytes_per_s(),
    ))


def status_line(d: Daemon) -> str:
    return (f"{d.admission.shards.used} shards / {d.admission.staged.used} bytes staged, "
            f"{sum(not g.terminal for g in d.ledger.generations.values())} generations in flight")
