"""The label sets of the daemon's Prometheus series, and their histograms' buckets.

Every label has a bounded set of values except ``job`` (one per training job the node serves).
The sets below are the whole contract with ``deploy/`` (alerts and dashboard): the values are
the ones the daemon passes (the ack mode, the limit's config key, the backend's error kind, the
failure's cause), and a live-daemon test checks no series ever reads anything else. A value
outside a set is still folded into ``"other"`` rather than raised (a metric call sits on the
data path and must never fail a hand-off or a drain), and that test fails when it happens.
Apart from metrics.py (the series) and metricsgauges.py (the state gauges), which both label by
them.
"""

from __future__ import annotations

from collections.abc import Iterable

from ckptdrain.daemon.state import ShardState

# Every lifecycle state of a shard record (daemon/state.py), and hand-offs still arriving.
SHARD_STATES = ("receiving", *(state.value for state in ShardState))
TIERS = ("local", "memory")
# The ack mode of the generation (config ``ack``), not how the bytes travelled.
HANDOFF_MODES = ("local", "memory")
PHASES = ("handoff", "staged", "drained", "committed")
# Why a generation will never commit. The paging ones are the node's or the destination's
# doing (CkptdrainGenerationFailed; ``superseded``: dropped for a newer step under
# backpressure, on_full = "supersede"); the others do not page: the training job's own doing,
# ``aborted`` (a rank aborted its part: an exception in the save, a bad shard path, a rank that
# went away, an ack=memory memfd cut short after its acknowledgement) and ``replaced`` (a
# restarted job saved the step again under a new attempt), and ``overtaken`` (a newer step of
# the job committed first: the job has a newer checkpoint; it paged as "superseded", whose
# runbook said staging was full, found attacking what operators see).
FAILURE_REASONS_PAGING = ("drain", "conflict", "timeout", "interrupted", "internal",
                          "superseded")
FAILURE_REASONS_USER = ("aborted", "replaced", "overtaken")
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


def bounded(value: str, allowed: Iterable[str]) -> str:
    """``value``, or ``"other"`` when it is not one of ``allowed``."""
    return value if value in allowed else OTHER
