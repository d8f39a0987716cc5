"""The gauges of the daemon's current state: built from the latest :class:`Snapshot` the
daemon hands over (about once a second) each time Prometheus scrapes. The oldest undrained age
is computed from a timestamp at scrape time, so it keeps growing even if the refresh loop
stalls: a wedged daemon must not look healthy. Apart from metrics.py (the counters and
histograms, updated as events happen), which registers the collector here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ckptdrain.daemon.metricslabels import SHARD_STATES, TIERS, bounded


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


class SnapshotCollector(Collector):
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
            key = bounded(state, SHARD_STATES)
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
        key = bounded(tier, TIERS)
        by_tier[key] = by_tier.get(key, 0) + value
    for tier, value in by_tier.items():
        family.add_metric([tier], float(value))
    return family
