"""A live daemon's /metrics, checked by the real tools: promtool on the exposition of a daemon
that has committed, blocked and failed generations; a real Prometheus server scraping it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client import DrainError, GenerationFailed
from tests.conftest import CKPTDRAIN, DaemonProcess, wait_for
from tests.integration.test_promtool import Prometheus, free_port, prometheus_process

PROMTOOL = shutil.which("promtool")


def metrics_url(d: DaemonProcess) -> str:
    url = d.client().status()["metrics"]
    assert url and url.startswith("http://127.0.0.1:")
    return str(url)


def scrape(d: DaemonProcess) -> str:
    with urllib.request.urlopen(metrics_url(d), timeout=10) as r:
        return r.read().decode()


def value(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.skipif(PROMTOOL is None, reason="promtool missing: `make system-deps` installs it")
def test_promtool_accepts_the_live_exposition(make_daemon: Any) -> None:
    # 1 byte of burst at 1 B/s: the first 1-byte generation drains, everything after waits.
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1",
                                   CKPTDRAIN_LIMITS__MAX_STAGED_BYTES="1MiB")
    c = d.client()
    with c.generation("ops", 1) as gen:
        gen.put("w", b"x")
    c.wait("ops", 1, timeout_s=30)
    with pytest.raises(RuntimeError), c.generation("ops", 2) as gen:
        gen.put("w", b"y")
        raise RuntimeError("training crashed")
    blocked_done = threading.Event()

    def blocked() -> None:
        # Ends with an error when the daemon stops under it; only the wait matters here.
        with contextlib.suppress(DrainError), c.generation("ops-blocked", 3) as gen:
            gen.put("fill", b"z" * (1 << 20))
            gen.put("more", b"z")  # waits: the staging budget is full
        blocked_done.set()

    t = threading.Thread(target=blocked, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while d.client().status()["blocked_handoffs"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    text = scrape(d)
    while not (value(text, "ckptdrain_blocked_handoffs") or 0) >= 1:  # refreshed once a second
        assert time.monotonic() < deadline
        time.sleep(0.1)
        text = scrape(d)
    out = subprocess.run([PROMTOOL, "check", "metrics"], input=text.encode(), capture_output=True)
    assert out.returncode == 0 and not out.stdout and not out.stderr, (out.stdout + out.stderr).decode()
    assert value(text, "ckptdrain_generations_committed_total", job="ops") == 1
    assert value(text, "ckptdrain_generations_failed_total", job="ops", reason="aborted") == 1
    assert (value(text, "ckptdrain_blocked_handoffs") or 0) >= 1
    assert (value(text, "ckptdrain_oldest_undrained_age_seconds", job="ops-blocked") or 0) > 0
    assert "_created" not in text
    # A SIGTERM would wait out the 10 s stop grace for the hand-off blocked on the full budget.
    d.kill()


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus missing: `make system-deps` installs it")
def test_prometheus_sees_the_oldest_undrained_age_grow_then_fall(make_daemon: Any, tmp_path: Path) -> None:
    config = tmp_path / "ckptdrain.toml"
    config.write_text("[drain]\nmax_bandwidth_bytes_per_s = 1\n")
    d: DaemonProcess = make_daemon(start=False, CKPTDRAIN_CONFIG=str(config))
    d.overrides.pop("CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S", None)
    d.start()
    target = metrics_url(d).removeprefix("http://").removesuffix("/metrics")
    prom_port = free_port()
    prom_config = tmp_path / "prometheus.yml"
    prom_config.write_text(json.dumps({
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "ckptdrain", "static_configs": [{"targets": [target]}]}],
    }))
    with prometheus_process(prom_config, tmp_path / "tsdb", prom_port, tmp_path / "prom.log"):
        prom = Prometheus(prom_port)
        with d.client().generation("held", 1) as gen:
            gen.put("w.bin", os.urandom(100_000))  # held back by the 1 B/s drain
        query = 'ckptdrain_oldest_undrained_age_seconds{exported_job="held"}'

        def sample() -> float | None:
            try:
                result = asyncio.run(prom.query(query))
            except urllib.error.URLError:
                return None  # Prometheus is still starting
            return float(result[0]["value"][1]) if result else None

        deadline = time.monotonic() + 60
        first = sample()
        while first is None:
            assert time.monotonic() < deadline, (tmp_path / "prom.log").read_text()
            time.sleep(0.3)
            first = sample()
        later = first
        while later is None or later <= first:
            assert time.monotonic() < deadline
            time.sleep(0.3)
            later = sample()
        assert later > first
        # Free the drain (SIGHUP reloads the pace), and the age falls to 0.
        config.write_text("[drain]\nmax_bandwidth_bytes_per_s = 0\n")
        os.kill(d.pid, signal.SIGHUP)
        d.client().wait("held", 1, timeout_s=60)
        while (v := sample()) is None or v != 0:
            assert time.monotonic() < deadline, v
            time.sleep(0.3)
    assert d.stop() == 0


def test_status_json_schema(daemon: DaemonProcess) -> None:
    with daemon.client().generation("schema", 1) as gen:
        gen.put("w", b"1")
    daemon.client().wait("schema", 1, timeout_s=30)
    out = subprocess.run([CKPTDRAIN, "status", "--json", "--socket", str(daemon.socket_path)],
                         env=daemon.env(), capture_output=True, text=True, check=True)
    doc = json.loads(out.stdout)
    top = {"node_id": str, "version": str, "uptime_s": float, "ack": str, "destination": str,
           "config": dict,
           "metrics": str, "staged_bytes": int, "kept_copy_bytes": int,
           "held_open_copy_bytes": int, "memory_bytes": int,
           "limits": dict, "queued_shards": int, "io_threads": dict, "generations_omitted": int,
           "staging_free_bytes": int, "staging_free_inodes": int, "drain_rate_bytes_per_s": float,
           "drain_yields": int, "blocked_handoffs": int, "oldest_undrained_age_s": dict, "blocked_by_limit": dict,
           "draining": bool, "shards_draining": list, "uploads_open": list,
           "uploads_open_count": int, "generations": list}
    assert set(doc) == set(top)
    for key, kind in top.items():
        assert isinstance(doc[key], kind), (key, doc[key])
    # max_staged_bytes_configured: only while the staging disk clamps the limit (this one's
    # default 800 GiB is clamped wherever the test's disk is smaller).
    assert set(doc["limits"]) - {"max_staged_bytes_configured"} == {
        "max_staged_bytes", "max_memory_bytes", "max_queued_shards",
        "max_generations_in_flight", "on_full"}
    [gen] = doc["generations"]
    assert set(gen) == {"job", "step", "state", "world_size", "ack", "ranks", "shards", "bytes",
                        "oldest_undrained_age_s", "error", "retrying", "uid"}
    assert gen["uid"] == os.getuid()
    assert gen["state"] == "committed" and gen["shards"] == {"drained": 1} and gen["ranks"] == {"0": "recorded"}


def test_a_large_shard_is_paced_and_reported_while_it_drains(make_daemon: Any) -> None:
    # One 40 MiB shard at 8 MiB/s: drained bytes, the shard's progress in status and the
    # drain rate move during the shard, not in one jump at its end.
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="8MiB")
    size = 40 << 20
    with d.client().generation("paced-one", 1) as gen:
        gen.put("big.bin", os.urandom(size))
    seen: dict[str, Any] = {}

    def midway() -> bool:
        status = d.client().status()
        for shard in status["shards_draining"]:
            if shard["path"] == "big.bin" and 0 < shard["drained_bytes"] < size:
                drained = value(scrape(d), "ckptdrain_drained_bytes_total", job="paced-one")
                if drained is not None and 0 < drained < size:
                    seen.update(shard=shard, drained=drained,
                                rate=status["drain_rate_bytes_per_s"])
                    return True
        return False

    wait_for(midway, timeout_s=60)
    assert seen["shard"]["size"] == size and seen["rate"] > 0
    d.client().wait("paced-one", 1, timeout_s=60)
    # A scrape may be answered from a render up to a second old (metricsendpoint.RENDER_FRESH_S).
    wait_for(lambda: value(scrape(d), "ckptdrain_drained_bytes_total", job="paced-one") == size,
             timeout_s=10)
    assert d.client().status()["shards_draining"] == []


def test_a_failed_step_a_newer_commit_replaced_stops_counting_as_undrained(
    make_daemon: Any, tmp_path: Path
) -> None:
    # Found attacking the metrics: step 1 failed while the destination was not mounted; once
    # it was, steps 2 and 3 committed, and the oldest-undrained age kept climbing from step 1
    # (CkptdrainOldestUndrainedTooOld firing on a healthy node) until it was forgotten.
    mount = tmp_path / "mnt"  # absent: writes wait, "is its filesystem mounted?"
    d: DaemonProcess = make_daemon(dest=f"file://{mount}/dest",
                                   CKPTDRAIN_DRAIN__RETRY_BUDGET_S="0.5")
    c = d.client()
    with c.generation("job", 1) as gen:
        gen.put("a", b"x" * 100)
    with pytest.raises(GenerationFailed):
        c.wait("job", 1, timeout_s=60)
    assert c.status()["oldest_undrained_age_s"]["job"] > 0  # failed, not at the destination
    mount.mkdir()
    for step in (2, 3):
        with c.generation("job", step) as gen:
            gen.put("a", b"y" * 100)
        c.wait("job", step, timeout_s=60)
    assert "job" not in c.status()["oldest_undrained_age_s"]
    wait_for(lambda: value(scrape(d), "ckptdrain_oldest_undrained_age_seconds", job="job") == 0,
             timeout_s=10)
    assert [g["state"] for g in c.status()["generations"] if g["step"] == 1] == ["failed"]

