"""The label sets of a live daemon's /metrics are the ones deploy/ queries: a daemon driven
through every path that labels a series (hand-offs of both ack modes over the socket, an fd and
a memfd; a full limit; a commit; a rank that aborts; a step saved again by a new attempt), and
then every bounded label value on the page must be one of the daemon's declared values — never
"other", which no alert or panel line shows — and the dashboard must split each of those
metrics by that label."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client import Backpressure, DrainError
from ckptdrain.daemon import metricslabels as M
from tests.conftest import DaemonProcess, wait_for

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "ckptdrain.json"

# metric -> {bounded label: its declared values}
BOUNDED: dict[str, dict[str, tuple[str, ...]]] = {
    "ckptdrain_handoff_duration_seconds_bucket": {"mode": M.HANDOFF_MODES},
    "ckptdrain_handoff_duration_seconds_count": {"mode": M.HANDOFF_MODES},
    "ckptdrain_backpressure_events_total": {"action": M.BACKPRESSURE_ACTIONS,
                                            "limit": M.BACKPRESSURE_LIMITS},
    "ckptdrain_generations_failed_total": {"reason": M.FAILURE_REASONS},
    "ckptdrain_drain_errors_total": {"kind": M.DRAIN_ERROR_KINDS},
    "ckptdrain_generation_phase_duration_seconds_bucket": {"phase": M.PHASES},
    "ckptdrain_internal_errors_total": {"where": M.INTERNAL_ERROR_WHERE},
    "ckptdrain_client_errors_total": {"event": M.CLIENT_ERROR_EVENTS},
    "ckptdrain_queue_shards": {"state": M.SHARD_STATES},
    "ckptdrain_staged_bytes": {"tier": M.TIERS},
}
# Which dashboard query splits each family by its label (the family name, without suffix).
DASHBOARD_SPLITS = {
    "ckptdrain_handoff_duration_seconds": "mode",
    "ckptdrain_backpressure_events_total": "limit",
    "ckptdrain_generations_failed_total": "reason",
    "ckptdrain_drain_errors_total": "kind",
    "ckptdrain_client_errors_total": "event",
    "ckptdrain_generation_phase_duration_seconds": "phase",
    "ckptdrain_queue_shards": "state",
    "ckptdrain_staged_bytes": "tier",
}

_SAMPLE = re.compile(r'^(\w+)(?:\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            out.append((match[1], dict(_LABEL.findall(match[2] or "")), float(match[3])))
    return out


def scrape(d: DaemonProcess) -> str:
    with urllib.request.urlopen(d.client().status()["metrics"], timeout=10) as r:
        return str(r.read().decode())


def count(text: str, name: str, **labels: str) -> float:
    return sum(v for n, ls, v in samples(text)
               if n == name and all(ls.get(k) == want for k, want in labels.items()))


def test_every_label_value_is_one_the_dashboard_shows(make_daemon: Any, tmp_path: Path) -> None:
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__MAX_STAGED_BYTES="1MiB",
                                   CKPTDRAIN_LIMITS__ON_FULL="reject",
                                   CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="20000")
    c = d.client()
    with c.generation("labels", 1) as gen:  # ack=local: over the socket, and as an fd
        gen.put("bytes", b"x" * 1000)
        src = tmp_path / "file.bin"
        src.write_bytes(b"y" * 1000)
        gen.put_file("file", src)
    c.wait("labels", 1, timeout_s=60)
    # ack=memory (a node's default; a client may only ask for a stronger boundary): memfds
    # the daemon keeps, from bytes and from a file.
    mem: DaemonProcess = make_daemon("node-m", CKPTDRAIN_ACK="memory")
    with mem.client().generation("labels-m", 1) as gen:
        gen.put("mem", b"z" * 1000)
        gen.put_file("memfile", src)
    mem.client().wait("labels-m", 1, timeout_s=60)
    with pytest.raises(RuntimeError), c.generation("user-error", 1) as gen:
        gen.put("w", b"a")
        raise RuntimeError("a typo'd shard path in the training script")
    # A restarted job saving the same step again under a new attempt replaces the old one.
    old = c.generation("restarted", 1, rank=0, world_size=2, attempt="run-1")
    old.__enter__()
    old.put("w", b"old")
    with c.generation("restarted", 1, rank=0, world_size=1, attempt="run-2") as gen:
        gen.put("w", b"new")
    c.wait("restarted", 1, timeout_s=60)
    with contextlib.suppress(DrainError):  # the old attempt's rank learns it was replaced
        old.__exit__(None, None, None)
    # Last, as it holds the slow drain: 600 KiB still to drain, then 600 KiB more is over
    # max_staged_bytes and on_full = reject refuses it.
    with pytest.raises(Backpressure), c.generation("full", 1) as gen:
        gen.put("first", b"f" * (600 << 10))
        gen.put("second", b"f" * (600 << 10))

    text, mem_text = scrape(d), scrape(mem)
    assert count(text, "ckptdrain_handoff_duration_seconds_count", mode="local") >= 2
    assert count(mem_text, "ckptdrain_handoff_duration_seconds_count", mode="memory") == 2
    assert count(text, "ckptdrain_backpressure_events_total", action="rejected",
                 limit="max_staged_bytes") == 1
    assert count(text, "ckptdrain_generations_failed_total", job="user-error",
                 reason="aborted") == 1
    assert count(text, "ckptdrain_generations_failed_total", job="restarted",
                 reason="replaced") == 1
    # Sub-second buckets for the short clocks: a small generation's handoff clock is counted
    # well under a second, not lumped into the first 1 s bucket.
    assert count(text, "ckptdrain_generation_phase_duration_seconds_bucket", phase="handoff",
                 le="0.5") >= 1

    for name, labels, _ in samples(text) + samples(mem_text):
        for label, allowed in BOUNDED.get(name, {}).items():
            assert labels[label] in allowed, (name, labels)
            assert labels[label] != M.OTHER, (name, labels)

    queries = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"]
               for t in p.get("targets", [])]
    for family, label in DASHBOARD_SPLITS.items():
        assert any(family in q and re.search(rf"by \([^)]*\b{label}\b", q) for q in queries), \
            (family, label)


def test_a_refusal_at_the_per_uid_connection_cap_is_labelled_by_its_limit(
        make_daemon: Any) -> None:
    # Found attacking the alerts: refusals on limits.max_clients_per_uid and limits.max_jobs
    # were counted as limit="other", which no panel line or alert shows.
    assert {"max_clients_per_uid", "max_jobs"} <= set(M.BACKPRESSURE_LIMITS)
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__MAX_CLIENTS_PER_UID="2")
    url = d.client().status()["metrics"]  # scraped below without a connection of the uid's
    held = [socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)]
    try:
        for s in held:
            s.connect(str(d.socket_path))
        # The third is refused: its reply frame arrives, then the daemon closes it.
        with socket.socket(socket.AF_UNIX) as third:
            third.settimeout(10)
            third.connect(str(d.socket_path))
            assert b"max_clients_per_uid" in third.recv(65536)
    finally:
        for s in held:
            s.close()

    def page() -> str:
        with urllib.request.urlopen(url, timeout=10) as r:
            return str(r.read().decode())

    wait_for(lambda: count(page(), "ckptdrain_backpressure_events_total",
                           limit="max_clients_per_uid") == 1)
    assert count(page(), "ckptdrain_backpressure_events_total", limit="other") == 0


def test_an_outage_from_the_start_shows_at_zero_and_kept_copies_apart(
        make_daemon: Any, tmp_path: Path) -> None:
    # Found attacking the alerts: with the destination down from start-up, the drained series
    # did not exist (CkptdrainArrivalExceedsDrain compared nothing, the dashboard's drain line
    # read "No data") and the first drain error was invisible to rate(); and drained copies
    # kept for a fast restore counted as full staging, paging CkptdrainStagingNearlyFull on an
    # idle node. The series exist at 0 from the start, and kept copies are exported apart.
    root = tmp_path / "unmounted" / "ckpt"  # its parent missing: writes wait for the mount
    d: DaemonProcess = make_daemon(dest=f"file://{root}")
    text = scrape(d)
    assert "ckptdrain_drain_errors_total{" in text  # before any error, at 0
    assert count(text, "ckptdrain_drain_errors_total", destination="file", kind="io") == 0
    assert "\nckptdrain_kept_copy_bytes 0.0\n" in text
    with d.client().generation("down", 1) as gen:
        gen.put("w.bin", b"w" * 4096)

    def drained() -> list[tuple[dict[str, str], float]]:
        # (A scrape may be answered from a render up to a second old.)
        return [(ls, v) for n, ls, v in samples(scrape(d))
                if n == "ckptdrain_drained_bytes_total" and ls.get("job") == "down"]

    wait_for(drained)
    assert drained() == [({"job": "down", "destination": "file"}, 0.0)]
    wait_for(lambda: count(scrape(d), "ckptdrain_drain_errors_total", destination="file",
                           kind="io") >= 1)
    root.parent.mkdir()  # mounted
    d.client().wait("down", 1, timeout_s=60)
    kept = d.client().status()["kept_copy_bytes"]
    assert kept == 4096
    wait_for(lambda: count(scrape(d), "ckptdrain_kept_copy_bytes") == kept
             and count(scrape(d), "ckptdrain_staged_bytes", tier="local") == kept)


def test_the_last_commit_gauges_come_back_after_a_restart(make_daemon: Any) -> None:
    # Found attacking the dashboard: after every restart (an upgrade, a crash) the last-commit
    # gauges were gone until the next commit, though `status` listed the commit from the
    # journal: the dashboard's stats went blank and CkptdrainNoRecentCommit lost its memory.
    d: DaemonProcess = make_daemon()
    for step in (10, 20):
        with d.client().generation("gauges", step, rank=0, world_size=1) as gen:
            gen.put("w.bin", b"w" * 1024)
        d.client().wait("gauges", step, timeout_s=30)
    before = time.time()
    assert d.stop() == 0
    d.start()
    wait_for(lambda: count(scrape(d), "ckptdrain_last_committed_generation", job="gauges") == 20)
    at = count(scrape(d), "ckptdrain_last_commit_timestamp_seconds", job="gauges")
    assert before - 60 < at <= before  # the commit's journalled time, not the restart's
    assert count(scrape(d), "ckptdrain_generations_committed_total", job="gauges") == 0
