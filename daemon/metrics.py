"""Prometheus metrics of one daemon: what operators watch, headed by the oldest undrained age.

Two kinds of series live here:

- Counters and histograms (hand-offs, bytes drained, errors, backpressure, commits) are updated
  by the daemon as events happen, through one method per event.
- Gauges describing the daemon's current state are computed at scrape time from the latest
  :class:`Snapshot` the daemon hands over (about once a second). The oldest undrained age is
  computed from a timestamp at scrape time, so it keeps growing even if the refresh loop stalls:
  a wedged daemon must not look healthy.

Every label has a bounded set of values except ``job`` (one per training job the node serves).
The sets below are the whole contract with ``deploy/`` (alerts and dashboard): the values are
the ones the daemon passes (the ack mode, the limit's config key, the backend's error kind, the
failure's cause), and a live-daemon test checks no series ever reads anything else. A value
outside a set is still folded into ``"other"`` rather than raised (a metric call sits on the
data path and must never fail a hand-off or a drain), and that test fails when it happens.

Note for the Prometheus side: the ``job`` label collides with the target label Prometheus adds,
so with the default ``honor_labels: false`` it is stored as ``exported_job``. The alert rules and
the dashboard in ``deploy/`` query ``exported_job``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ckptdrain.daemon.metricsendpoint import MetricsEndpoint
from ckptdrain.daemon.state import ShardState

__all__ = [
    "BACKPRESSURE_ACTIONS",
    "BACKPRESSURE_LIMITS",
    "DRAIN_ERROR_KINDS",
    "FAILURE_REASONS",
    "HANDOFF_MODES",
    "PHASES",
    "SHARD_STATES",
    "TIERS",
    "Metrics",
    "Snapshot",
]

log = logging.getLogger(__name__)

# The one process-wide switch prometheus-client offers: without it every counter and histogram
# carries a `_created` sibling series that doubles the cardinality and that nothing here uses.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

# Every lifecycle state of a shard record (daemon/state.py), and hand-offs still arriving.
SHARD_STATES = ("receiving", *(state.value for state in ShardState))
TIERS = ("local", "memory")
# The ack mode of the generation (config ``ack``), not how the bytes travelled.
HANDOFF_MODES = ("local", "memory")
PHASES = ("handoff", "staged", "drained", "committed")
# Why a generation will never commit. The first five are the node's or the destination's
# doing and page (CkptdrainGenerationFailed); the training job's own doing does not:
# ``aborted`` (a rank aborted its part: an exception in the save, a bad shard path, a rank that
# went away, an ack=memory memfd cut short after its acknowledgement) and ``replaced`` (a
# restarted job saved the step again under a new attempt).
FAILURE_REASONS_PAGING = ("drain", "conflict", "timeout", "interrupted", "internal",
                          "superseded")
FAILURE_REASONS_USER = ("aborted", "replaced")
FAILURE_REASONS = FAILURE_REASONS_PAGING + FAILURE_REASONS_USER
BACKPRESSURE_ACTIONS = ("blocked", "rejected", "timed_out", "superseded")
# The limit that was full, named by its config key (``staging_filesystem``: the disk itself).
BACKPRESSURE_LIMITS = (
    "max_staged_bytes",
    "max_memory_bytes",
    "max_queued_shards",
    "max_generations_in_flight",
    "max_clients",
    "staging_filesystem",
    # A uid's share (limits.*_per_uid): one user over it, not the node full.
    "max_reserved_bytes_per_uid",
    "max_queued_shards_per_uid",
    "max_generations_per_uid",
    "max_clients_per_uid",
    # A uid whose clients' errors held its connections back too long (allowance.py).
    "client_errors_per_s",
    # The jobs a node tracks at once, every one with a generation in flight.
    "max_jobs",
    # The daemon's own file descriptors (RLIMIT_NOFILE) or the node's, run short.
    "file_descriptors",
)
# The kinds a backend reports (daemon/backends/base.py BackendError.kind), and ``staging``: a
# staged copy that could not be read back to drain it.
DRAIN_ERROR_KINDS = ("io", "timeout", "throttled", "auth", "integrity", "conflict", "full",
                     "not_found", "unsafe", "staging")
INTERNAL_ERROR_WHERE = ("connection", "drain", "commit", "background")
# What a client got wrong (its own doing, not the daemon's): the log events of the same name.
CLIENT_ERROR_EVENTS = ("client_dropped", "client_protocol_error", "request_refused")
OTHER = "other"

# Hand-off stalls are what training sees: from a memfd hand-off (about a millisecond) to a
# multi-GiB fsync on a busy NVMe, up to the block timeout (300 s by default) under backpressure.
HANDOFF_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
# Generation clocks run from milliseconds (the handoff and staged clocks of a small shard on
# NVMe) to hours (a 1 TB checkpoint behind a slow shared tier); the objective operators care
# about is usually 5-15 minutes.
PHASE_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0,
    1800.0, 3600.0, 7200.0, 14400.0, 43200.0,
)  # fmt: skip

@dataclass
class Snapshot:
    """The daemon's current state as the gauges show it; refreshed about once a second."""

    # job -> when its oldest undrained shard was staged, on the monotonic clock (None: none)
    oldest_undrained_since: dict[str, float | None] = field(default_factory=dict)
    # state -> shards; states: receiving, staged, draining, drained, failed
    shards_by_state: dict[str, int] = field(default_factory=dict)
    staged_bytes: dict[str, int] = field(default_factory=dict)  # tier -> bytes
    # Of the local tier's bytes, drained copies kept for a fast restore: evicted as soon as a
    # hand-off needs their room, so they are no sign of a full node.
    kept_copy_bytes: int = 0
    limit_bytes: dict[str, int] = field(default_factory=dict)  # tier -> configured limit
    queued_shards: int = 0
    max_queued_shards: int = 0
    staging_free_bytes: int = 0
    staging_free_inodes: int = 0
    generations_in_flight: dict[str, int] = field(default_factory=dict)  # job -> count
    blocked_handoffs: int = 0
    drain_rate_bytes_per_s: float = 0.0
    config_reload_failed: bool = False  # the last SIGHUP's config did not load
    config_needs_restart: int = 0  # changed keys only a restart applies


def _bounded(value: str, allowed: Iterable[str]) -> str:
    return value if value in allowed else OTHER


class _SnapshotCollector(Collector):
    """Builds the state gauges from the latest snapshot each time Prometheus scrapes."""

    def __init__(self, node_id: str, version: str, clock: Callable[[], float]) -> None:
        self._node_id = node_id
        self._version = version
        self._clock = clock
        # Replaced whole, never mutated: a scrape reads one consistent snapshot.
        self.snapshot: Snapshot | None = None

    def describe(self) -> Iterable[GaugeMetricFamily]:
        # Registering calls describe(); returning nothing keeps it from calling collect()
        # before the daemon has handed over a snapshot.
        return []

    def collect(self) -> Iterable[GaugeMetricFamily]:
        build = GaugeMetricFamily(
            "ckptdrain_build_info",
            "Always 1; the daemon's version and node id as labels.",
            labels=["version", "node"],
        )
        build.add_metric([self._version, self._node_id], 1.0)
        yield build

        snap = self.snapshot
        if snap is None:
            return
        now = self._clock()

        age = GaugeMetricFamily(
            "ckptdrain_oldest_undrained_age_seconds",
            "Seconds since the oldest shard of the job not yet drained was handed off; 0 when "
            "everything handed off has drained.",
            labels=["job"],
        )
        for job, since in sorted(snap.oldest_undrained_since.items()):
            age.add_metric([job], 0.0 if since is None else max(0.0, now - since))
        yield age

        queue = GaugeMetricFamily(
            "ckptdrain_queue_shards",
            "Shards the daemon holds, by lifecycle state.",
            labels=["state"],
        )
        by_state = dict.fromkeys(SHARD_STATES, 0)
        for state, count in snap.shards_by_state.items():
            key = _bounded(state, SHARD_STATES)
            by_state[key] = by_state.get(key, 0) + count
        for state, count in by_state.items():
            queue.add_metric([state], float(count))
        yield queue

        yield _by_tier(
            "ckptdrain_staged_bytes",
            "Bytes of shards held by the daemon, by tier (local NVMe or memory).",
            snap.staged_bytes,
        )
        yield GaugeMetricFamily(
            "ckptdrain_kept_copy_bytes",
            "Of ckptdrain_staged_bytes{tier=\"local\"}, drained copies kept for a fast restore "
            "(retention.keep_local_copy): evicted as soon as a hand-off needs the room.",
            value=float(snap.kept_copy_bytes),
        )
        yield _by_tier(
            "ckptdrain_staged_limit_bytes",
            "Configured limit of staged bytes, by tier; 0 means the tier is disabled.",
            snap.limit_bytes,
        )
        for name, text, value in (
            ("ckptdrain_queued_shards", "Shards queued in the daemon (every state but drained).",
             snap.queued_shards),
            ("ckptdrain_queued_shards_limit",
             "Configured limit of queued shards (limits.max_queued_shards).",
             snap.max_queued_shards),
            ("ckptdrain_staging_free_bytes",
             "Free bytes of the filesystem holding the staging directory.",
             snap.staging_free_bytes),
            ("ckptdrain_staging_free_inodes",
             "Free inodes of the filesystem holding the staging directory.",
             snap.staging_free_inodes),
            ("ckptdrain_config_reload_failed",
             "1 when the last reload (SIGHUP) failed and the daemon runs on its old config.",
             snap.config_reload_failed),
            ("ckptdrain_config_needs_restart_keys",
             "Config keys changed since the start that only a restart applies.",
             snap.config_needs_restart),
        ):
            yield GaugeMetricFamily(name, text, value=float(value))
        in_flight = GaugeMetricFamily(
            "ckptdrain_generations_in_flight",
            "Generations begun on this node and not yet committed or failed, by job.",
            labels=["job"],
        )
        for job, count in sorted(snap.generations_in_flight.items()):
            in_flight.add_metric([job], float(count))
        yield in_flight
        yield GaugeMetricFamily(
            "ckptdrain_blocked_handoffs",
            "Hand-offs waiting now for space (backpressure with on_full = block).",
            value=float(snap.blocked_handoffs),
        )
        yield GaugeMetricFamily(
            "ckptdrain_drain_rate_bytes_per_second",
            "Recent drain throughput to the destination as the daemon measures it.",
            value=float(snap.drain_rate_bytes_per_s),
        )


def _by_tier(name: str, documentation: str, values: Mapping[str, int]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=["tier"])
    by_tier = dict.fromkeys(TIERS, 0)
    for tier, value in values.items():
        key = _bounded(tier, TIERS)
        by_tier[key] = by_tier.get(key, 0) + value
    for tier, value in by_tier.items():
        family.add_metric([tier], float(value))
    return family


class Metrics:
    """All of one daemon's metrics in a dedicated registry, served by a small HTTP endpoint
    (metricsendpoint.py)."""

    def __init__(
        self, node_id: str, version: str, *, clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """``clock`` reads ages (the snapshot's moments are on it: records.monotonic_of);
        ``wall_clock`` stamps the times exported as unix times."""
        self.node_id = node_id
        self.version = version
        self._clock_wall = wall_clock
        # A dedicated registry: nothing from the process-wide default (python_gc_*, process_*)
        # and no clash when tests build several daemons in one process.
        self.registry = CollectorRegistry(auto_describe=True)
        self._state = _SnapshotCollector(node_id, version, clock)
        self.registry.register(self._state)
        reg = self.registry

        self._handoff_seconds = Histogram(
            "ckptdrain_handoff_duration_seconds",
            "Hand-off duration as the training process sees it (the stall), by ack mode.",
            ["mode"],
            buckets=HANDOFF_BUCKETS_S,
            registry=reg,
        )
        self._handoff_bytes = Counter(
            "ckptdrain_handoff_bytes_total",
            "Bytes handed off by training processes, by job (the arrival rate).",
            ["job"],
            registry=reg,
        )
        self._drained_bytes = Counter(
            "ckptdrain_drained_bytes_total",
            "Bytes written to the destination by drains, by job and destination, counted as they "
            "move (a 10 GB shard moves it all along); an attempt that fails and is retried "
            "counts its bytes again, so this is traffic, not what has landed.",
            ["job", "destination"],
            registry=reg,
        )
        self._drain_errors = Counter(
            "ckptdrain_drain_errors_total",
            "Failed destination operations (retried or not), by destination and kind.",
            ["destination", "kind"],
            registry=reg,
        )
        self._backpressure = Counter(
            "ckptdrain_backpressure_events_total",
            "Hand-offs that met a full limit, by what happened and which limit.",
            ["action", "limit"],
            registry=reg,
        )
        self._internal_errors = Counter(
            "ckptdrain_internal_errors_total",
            "Unexpected errors caught at a failure boundary (the daemon carried on), by where: "
            "connection, drain, commit, background.",
            ["where"],
            registry=reg,
        )
        for where in INTERNAL_ERROR_WHERE:
            self._internal_errors.labels(where)  # 0 until it happens, so rate() sees it start
        self._client_errors = Counter(
            "ckptdrain_client_errors_total",
            "Clients' own errors, by event: client_dropped (hung up mid-request or timed "
            "out), client_protocol_error (a malformed frame: connection closed), "
            "request_refused (a frame with a bad field). Counted even when their log lines "
            "are held back.",
            ["event"],
            registry=reg,
        )
        for event in CLIENT_ERROR_EVENTS:
            self._client_errors.labels(event)
        self._client_held_back = Counter(
            "ckptdrain_client_held_back_total",
            "Frames of a client whose uid was over limits.client_errors_per_s that waited "
            "before the daemon read them (a new connection's first, or the next after a "
            "refused one).",
            registry=reg,
        )
        self._aborted_uploads = Counter(
            "ckptdrain_multipart_uploads_aborted_total",
            "S3 multipart uploads aborted (interrupted, failed, or orphaned at start-up).",
            registry=reg,
        )
        self._committed = Counter(
            "ckptdrain_generations_committed_total",
            "Generations committed at the destination (manifest present), by job.",
            ["job"],
            registry=reg,
        )
        self._failed = Counter(
            "ckptdrain_generations_failed_total",
            "Generations that will never commit, by job and reason.",
            ["job", "reason"],
            registry=reg,
        )
        self._last_generation = Gauge(
            "ckptdrain_last_committed_generation",
            "Step of the newest generation committed, by job.",
            ["job"],
            registry=reg,
        )
        self._last_commit_time = Gauge(
            "ckptdrain_last_commit_timestamp_seconds",
            "Unix time (this node's clock) at which it saw the job's newest commit, by job.",
            ["job"],
            registry=reg,
        )
        self._phase_seconds = Histogram(
            "ckptdrain_generation_phase_duration_seconds",
            "Seconds from a generation's first hand-off to each of its four clocks "
            "(handoff: last hand-off returned; staged; drained; committed).",
            ["phase"],
            buckets=PHASE_BUCKETS_S,
            registry=reg,
        )

        # Bounded children exist from the start at 0, so rate() and increase() see the first
        # event instead of a series that is born at 1.
        for mode in HANDOFF_MODES:
            self._handoff_seconds.labels(mode)
        for action in BACKPRESSURE_ACTIONS:
            for limit in BACKPRESSURE_LIMITS:
                self._backpressure.labels(action, limit)
        for phase in PHASES:
            self._phase_seconds.labels(phase)
        self._known_jobs: set[str] = set()
        self._known_destinations: set[str] = set()
        self._last_step: dict[str, int] = {}
        self.endpoint = MetricsEndpoint(self.exposition)

    # -- state -------------------------------------------------------------------------------

    def set_snapshot(self, snap: Snapshot) -> None:
        """Publish the daemon's current state; the gauges read it at the next scrape."""
        for job in (*snap.oldest_undrained_since, *snap.generations_in_flight):
            self._see_job(job)
        self._state.snapshot = snap

    # -- events ------------------------------------------------------------------------------

    def handoff(self, job: str, seconds: float, nbytes: int, mode: str) -> None:
        """One shard handed off: ``seconds`` of stall seen by training, ``mode`` the ack mode."""
        self._see_job(job)
        self._handoff_seconds.labels(_bounded(mode, HANDOFF_MODES)).observe(max(0.0, seconds))
        self._handoff_bytes.labels(job).inc(max(0, nbytes))

    def drained(self, job: str, nbytes: int, destination: str) -> None:
        """``nbytes`` of ``job`` written to ``destination`` (``file`` or ``s3``) as they move;
        a retried attempt counts its bytes again (found attacking: the help text said
        "verified", and an outage's retries looked like a healthy drain)."""
        self._see_job(job)
        self._see_destination(destination)
        self._drained_bytes.labels(job, destination).inc(max(0, nbytes))

    def drain_error(self, destination: str, kind: str) -> None:
        """A destination operation failed; ``kind`` is ``BackendError.kind``."""
        self._see_destination(destination)
        self._drain_errors.labels(destination, _bounded(kind, DRAIN_ERROR_KINDS)).inc()

    def backpressure(self, action: str, limit: str) -> None:
        """A hand-off met a full ``limit``; ``action``: blocked, rejected, timed_out, superseded."""
        self._backpressure.labels(
            _bounded(action, BACKPRESSURE_ACTIONS), _bounded(limit, BACKPRESSURE_LIMITS)
        ).inc()

    def internal_error(self, where: str) -> None:
        """An unexpected exception was caught at a failure boundary (a bug: it is logged)."""
        self._internal_errors.labels(_bounded(where, INTERNAL_ERROR_WHERE)).inc()

    def client_error(self, event: str) -> None:
        """A client's own error (one of CLIENT_ERROR_EVENTS), logged or held back."""
        self._client_errors.labels(_bounded(event, CLIENT_ERROR_EVENTS)).inc()

    def client_held_back(self) -> None:
        """A client's next frame waits: its uid is over its error allowance."""
        self._client_held_back.inc()

    def upload_aborted(self, n: int = 1) -> None:
        """``n`` multipart uploads aborted."""
        self._aborted_uploads.inc(max(0, n))

    def generation_committed(
        self, job: str, step: int, clocks: Mapping[str, float], committed_at: float
    ) -> None:
        """Generation ``step`` of ``job`` committed at unix time ``committed_at``.

        ``clocks`` maps each phase (handoff, staged, drained, committed) to the unix time it was
        reached; an optional ``"started"`` entry is the first hand-off (else the earliest clock
        is taken as the start). ``"committed"`` defaults to ``committed_at``.
        """
        self._see_job(job)
        self._committed.labels(job).inc()
        # When this node saw it, on its own clock: the manifest's clock is the publishing
        # node's, and one two hours behind paged "no recent commit" on every other node while
        # commits went through; a gauge that only rose stayed in the future after a clock
        # stepped back, and could not page for as long (found attacking).
        self._last_commit(job, step, self._clock_wall())

        reached = {p: clocks[p] for p in PHASES if p in clocks}
        reached.setdefault("committed", committed_at)
        start = clocks.get("started", min(reached.values()))
        for phase, at in reached.items():
            self._phase_seconds.labels(phase).observe(max(0.0, at - start))

    def recovered_commit(self, job: str, step: int, committed_at: float) -> None:
        """At start-up, the newest commit the journal holds for ``job``, at its journalled
        time: counted before, not again, but the last-commit gauges are back (they were gone
        after every restart until the next commit, blanking the dashboard's stats and the
        no-recent-commit alert's memory: found attacking)."""
        self._see_job(job)
        self._last_commit(job, step, committed_at)

    def _last_commit(self, job: str, step: int, at: float) -> None:
        # Commits are reported by the node that published and by those that accepted an
        # existing manifest; an older generation reported late must not move the gauges back.
        if step >= self._last_step.get(job, step):
            self._last_step[job] = step
            self._last_generation.labels(job).set(step)
            self._last_commit_time.labels(job).set(at)

    def generation_failed(self, job: str, reason: str) -> None:
        """A generation of ``job`` will never commit; ``reason`` one of FAILURE_REASONS."""
        self._see_job(job)
        self._failed.labels(job, _bounded(reason, FAILURE_REASONS)).inc()

    def _see_job(self, job: str) -> None:
        # The first time a job appears, create its counters at 0 so that the first commit or
        # failure of the job shows up in increase() (an alert would otherwise miss it).
        if job in self._known_jobs:
            return
        self._known_jobs.add(job)
        self._handoff_bytes.labels(job)
        self._committed.labels(job)
        for reason in FAILURE_REASONS:
            self._failed.labels(job, reason)
        for destination in self._known_destinations:
            # At 0 before the first drained byte: with the destination down from the start,
            # a drain rate that never existed left CkptdrainArrivalExceedsDrain nothing to
            # compare and the dashboard's drain line empty (found attacking the alerts).
            self._drained_bytes.labels(job, destination)

    def set_destination(self, destination: str) -> None:
        """The daemon's destination (its scheme): its error and drained series exist at 0
        from the start, so an outage's first error shows in rate() and increase()."""
        self._see_destination(destination)

    def forget_job(self, job: str) -> None:
        """Drop every series of ``job``: the node forgot it, and /metrics must not grow with
        every job it ever served."""
        if job not in self._known_jobs:
            return
        self._known_jobs.discard(job)
        self._last_step.pop(job, None)
        series: list[tuple[Any, tuple[str, ...]]] = [
            (self._handoff_bytes, (job,)), (self._committed, (job,)),
            (self._last_generation, (job,)), (self._last_commit_time, (job,)),
            *((self._failed, (job, reason)) for reason in FAILURE_REASONS),
            *((self._drained_bytes, (job, dest))
              for dest in {"file", "s3", "memory", *self._known_destinations}),
        ]
        for metric, labels in series:
            with contextlib.suppress(KeyError):
                metric.remove(*labels)

    def _see_destination(self, destination: str) -> None:
        if destination in self._known_destinations:
            return
        self._known_destinations.add(destination)
        for kind in DRAIN_ERROR_KINDS:
            self._drain_errors.labels(destination, kind)

    # -- exposition --------------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The Prometheus text format (0.0.4) of every metric."""
        return prometheus_client.generate_latest(self.registry)

    async def serve(self, host: str, port: int) -> tuple[str, int]:
        """Serve ``GET /metrics`` and ``GET /healthz`` on ``host:port`` (0: any free port);
        returns the bound address. Stop it with :meth:`aclose`."""
        return await self.endpoint.serve(host, port)

    async def aclose(self) -> None:
        """Stop the endpoint and end open connections; safe to call more than once."""
        await self.endpoint.aclose()
