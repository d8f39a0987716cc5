"""Prometheus metrics of one daemon: what operators watch, headed by the oldest undrained age.

Two kinds of series, in one registry:

- Counters and histograms (hand-offs, bytes drained, errors, backpressure, commits) are updated
  by the daemon as events happen, through one method per event: here.
- Gauges describing the daemon's current state are computed at scrape time from the latest
  snapshot the daemon hands over (about once a second): metricsgauges.py.

Their label sets, bounded and the contract with ``deploy/``, are metricslabels.py's.

Note for the Prometheus side: the ``job`` label collides with the target label Prometheus adds,
so with the default ``honor_labels: false`` it is stored as ``exported_job``. The alert rules and
the dashboard in ``deploy/`` query ``exported_job``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ckptdrain.daemon.metricsendpoint import MetricsEndpoint
from ckptdrain.daemon.metricsgauges import Snapshot, SnapshotCollector
from ckptdrain.daemon.metricslabels import (
    BACKPRESSURE_ACTIONS,
    BACKPRESSURE_LIMITS,
    CLIENT_ERROR_EVENTS,
    DRAIN_ERROR_KINDS,
    FAILURE_REASONS,
    HANDOFF_BUCKETS_S,
    HANDOFF_MODES,
    INTERNAL_ERROR_WHERE,
    PHASE_BUCKETS_S,
    PHASES,
    bounded,
)

# Re-exported: publisher.py, which others are editing, imports it from here.
from ckptdrain.daemon.metricslabels import FAILURE_REASONS_USER as FAILURE_REASONS_USER

__all__ = ["Metrics"]

log = logging.getLogger(__name__)

# The one process-wide switch prometheus-client offers: without it every counter and histogram
# carries a `_created` sibling series that doubles the cardinality and that nothing here uses.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]


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
        self._state = SnapshotCollector(node_id, version, clock)
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
        self._handoff_seconds.labels(bounded(mode, HANDOFF_MODES)).observe(max(0.0, seconds))
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
        self._drain_errors.labels(destination, bounded(kind, DRAIN_ERROR_KINDS)).inc()

    def backpressure(self, action: str, limit: str) -> None:
        """A hand-off met a full ``limit``; ``action``: blocked, rejected, timed_out, superseded."""
        self._backpressure.labels(
            bounded(action, BACKPRESSURE_ACTIONS), bounded(limit, BACKPRESSURE_LIMITS)
        ).inc()

    def internal_error(self, where: str) -> None:
        """An unexpected exception was caught at a failure boundary (a bug: it is logged)."""
        self._internal_errors.labels(bounded(where, INTERNAL_ERROR_WHERE)).inc()

    def client_error(self, event: str) -> None:
        """A client's own error (one of CLIENT_ERROR_EVENTS), logged or held back."""
        self._client_errors.labels(bounded(event, CLIENT_ERROR_EVENTS)).inc()

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
        self._failed.labels(job, bounded(reason, FAILURE_REASONS)).inc()

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
