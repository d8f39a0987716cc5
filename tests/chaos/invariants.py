"""What must hold after every chaos trial, checked from outside the daemon.

The destination is read independently of the daemon's backends (plain files, or botocore
straight to the S3 server, never through the fault proxy), by the layout in docs/layout.md:
``<job>/<step:020d>/<shard>``, ``.../_parts/``, ``.../MANIFEST.json`` and ``<job>/LATEST``.

- every shard acknowledged (``ack=local``) in a generation whose every rank's seal was
  acknowledged is committed byte-equal (the workload decides when a typed failure is allowed);
- every MANIFEST.json parses, and its shards are present with their size and checksum
  (re-hashed here); a generation that must never commit has no manifest;
- no file under a shard's final name holds anything but the bytes its client sent (no torn file);
- LATEST only ever rises over the run and names a committed generation;
- no multipart upload is left on the S3 server after restart and orphan sweep;
- staging stays within ``max_staged_bytes`` plus one in-flight shard (local copies kept after
  draining count against the limit like any staged shard);
- the daemon's RSS and open fd count stay bounded.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ckptdrain.client.manifest import Manifest
from tests.chaos.workload import Expect, Plan, Record

MANIFEST = "MANIFEST.json"
TMP_SUFFIX = ".ckptdrain-tmp"


def gen_prefix(job: str, step: int) -> str:
    return f"{job}/{step:020d}/"


def checksum_matches(checksum: str, data: bytes) -> bool:
    algo, _, digest = checksum.partition(":")
    if algo == "sha256":
        return hashlib.sha256(data).hexdigest() == digest
    if algo == "crc64nvme":
        from awscrt import checksums  # the daemon's dependency once it writes this algorithm

        return f"{checksums.crc64nvme(data):016x}" == digest
    raise AssertionError(f"checksum algorithm {algo!r} is unknown to the chaos checker")


# --- destinations, read from outside ---------------------------------------------------------


class Destination(Protocol):
    def keys(self, prefix: str) -> dict[str, int]: ...  # key -> size, temp files included
    def read(self, key: str) -> bytes | None: ...
    def uploads(self) -> list[str]: ...  # incomplete multipart uploads, as "key (id)"


@dataclass
class PosixDestination:
    root: Path

    def keys(self, prefix: str) -> dict[str, int]:
        base = self.root / prefix
        found: dict[str, int] = {}
        if not base.is_dir():
            return found
        for dirpath, _, files in os.walk(base):
            for name in files:
                full = Path(dirpath) / name
                with contextlib.suppress(FileNotFoundError):
                    found[str(full.relative_to(self.root))] = full.stat().st_size
        return found

    def read(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            return None

    def uploads(self) -> list[str]:
        return []


@dataclass
class S3Destination:
    client: Any  # a botocore S3 client talking to the server itself
    bucket: str
    prefix: str

    def keys(self, prefix: str) -> dict[str, int]:
        found: dict[str, int] = {}
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=f"{self.prefix}/{prefix}")
        for page in pages:
            for obj in page.get("Contents", []):
                found[obj["Key"][len(self.prefix) + 1:]] = obj["Size"]
        return found

    def read(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")["Body"].read()  # type: ignore[no-any-return]
        except self.client.exceptions.NoSuchKey:
            return None

    def uploads(self) -> list[str]:
        got = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=f"{self.prefix}/")
        return [f"{u['Key']} ({u['UploadId']})" for u in got.get("Uploads", [])]


# --- the checks ------------------------------------------------------------------------------


def read_latest(dest: Destination, job: str) -> int | None:
    data = dest.read(f"{job}/LATEST")
    if data is None:
        return None
    text = data.strip()
    return int(text) if text.isdigit() else -1  # -1: garbage, never a valid hint


def committed_steps(dest: Destination, job: str) -> dict[int, Manifest | str]:
    """Each step with a MANIFEST.json: its parsed manifest, or why it does not parse."""
    found: dict[int, Manifest | str] = {}
    for key in dest.keys(f"{job}/"):
        parts = key.split("/")
        if len(parts) == 3 and parts[2] == MANIFEST and parts[1].isdigit():
            raw = dest.read(key)
            if raw is None:
                continue  # removed since the listing (retention)
            try:
                found[int(parts[1])] = Manifest.from_json(raw)
            except ValueError as exc:
                found[int(parts[1])] = f"{key} does not parse: {exc}"
    return found


def check_destination(dest: Destination, plan: Plan, record: Record | None, *, settled: bool,
                      failed_ok: frozenset[int] = frozenset()) -> list[str]:
    """Manifests, shards, torn files; with ``settled`` (after recovery), commitments too.
    ``failed_ok``: steps the daemon reported failed with a typed error where the contract
    allows it (an injected destination fault)."""
    bad: list[str] = []
    manifests = committed_steps(dest, plan.job)
    for step, m in sorted(manifests.items()):
        if isinstance(m, str):
            bad.append(m)
            continue
        for s in m.shards:
            data = dest.read(gen_prefix(plan.job, step) + s.path)
            if data is None:
                bad.append(f"step {step}: manifest lists {s.path} but it is missing")
            elif len(data) != s.size:
                bad.append(f"step {step}: {s.path} is {len(data)} bytes, manifest says {s.size}")
            elif not checksum_matches(s.checksum, data):
                bad.append(f"step {step}: {s.path} does not match its manifest checksum")
    for g in plan.generations:
        prefix = gen_prefix(plan.job, g.step)
        for key in dest.keys(prefix):
            rel = key[len(prefix):]
            if rel == MANIFEST or rel.startswith("_parts/") or rel.endswith(TMP_SUFFIX):
                continue
            shard = plan.shard(g.step, rel)
            data = dest.read(key)
            if shard is None:
                bad.append(f"step {g.step}: {rel} was never handed off but is at the destination")
            elif data is not None and hashlib.sha256(data).hexdigest() != shard.sha256:
                bad.append(f"step {g.step}: {rel} under its final name is not the bytes sent "
                           f"({len(data)} of {shard.size} bytes)")
    if record is None or not settled:
        return bad
    for step, rec in sorted(record.gens.items()):
        m = manifests.get(step)
        expect = rec.expect
        if expect is Expect.NEVER and m is not None:
            bad.append(f"step {step} committed although a rank never sealed")
        if expect is Expect.MUST_COMMIT and not isinstance(m, Manifest):
            if step not in failed_ok:
                bad.append(f"step {step}: every rank sealed but no manifest was committed")
            continue
        if isinstance(m, Manifest):
            listed = {s.path: s for s in m.shards}
            for path in sorted(rec.acked):
                shard = plan.shard(step, path)
                assert shard is not None
                entry = listed.get(path)
                if entry is None:
                    bad.append(f"step {step}: acknowledged {path} is missing from the manifest")
                elif entry.size != shard.size:
                    bad.append(f"step {step}: {path} committed with {entry.size} bytes, sent {shard.size}")
            expected = {s.path for r in rec.plan.ranks for s in r.shards}
            extra = set(listed) - expected
            if extra:
                bad.append(f"step {step}: manifest lists shards never handed off: {sorted(extra)}")
            if m.world_size != rec.plan.world_size:
                bad.append(f"step {step}: manifest world_size {m.world_size} != {rec.plan.world_size}")
    return bad


def check_latest(dest: Destination, job: str, history: list[int]) -> list[str]:
    bad: list[str] = []
    for before, after in itertools.pairwise(history):
        if after < before:
            bad.append(f"LATEST of {job} was lowered from {before} to {after} "
                       f"(seen in order: {history})")
            break
    now = read_latest(dest, job)
    if now == -1:
        bad.append(f"LATEST of {job} holds garbage")
    elif now is not None and dest.read(gen_prefix(job, now) + MANIFEST) is None:
        bad.append(f"LATEST of {job} names step {now}, which has no manifest")
    return bad


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or the deadline passes; returns whether it held."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)


def check_uploads(dest: Destination, timeout_s: float = 10.0) -> list[str]:
    """No incomplete multipart upload under the trial's prefix (the daemon may still be
    aborting the last ones: poll with a deadline)."""
    if wait_until(lambda: not dest.uploads(), timeout_s, 0.2):
        return []
    return [f"multipart uploads left after restart and orphan sweep: {dest.uploads()}"]


# --- process bounds, sampled during the whole trial ------------------------------------------


def proc_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def dir_bytes(path: Path) -> int:
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(path):
            with contextlib.suppress(FileNotFoundError):
                total += entry.stat(follow_symlinks=False).st_size
    return total


@dataclass
class Observer:
    """A thread that samples LATEST, staging bytes, RSS and fds while the trial runs."""

    dest: Destination
    job: str
    staging_shards: Path
    pid: Callable[[], int | None]
    interval_s: float = 0.01
    latest: list[int] = field(default_factory=list)
    max_staged: int = 0
    max_rss: int = 0
    max_fds: int = 0
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Observer:
        self._thread = threading.Thread(target=self._run, name="observer", daemon=True)
        self._thread.start()
        return self

    def sample(self) -> None:
        try:
            value = read_latest(self.dest, self.job)
        except Exception as exc:  # the S3 server is not what is under test here
            self.errors.append(f"reading LATEST: {exc}")
            value = None
        if value is not None and (not self.latest or self.latest[-1] != value):
            self.latest.append(value)
        self.max_staged = max(self.max_staged, dir_bytes(self.staging_shards))
        pid = self.pid()
        if pid is not None:
            with contextlib.suppress(OSError):  # between a kill and the restart
                self.max_rss = max(self.max_rss, proc_rss_bytes(pid))
                self.max_fds = max(self.max_fds, proc_fds(pid))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.sample()


def check_bounds(obs: Observer, *, max_staged_bytes: int, slack_bytes: int, rss_limit: int,
                 fd_limit: int) -> list[str]:
    bad = []
    if obs.max_staged > max_staged_bytes + slack_bytes:
        bad.append(f"staging held {obs.max_staged} bytes, over max_staged_bytes "
                   f"{max_staged_bytes} + {slack_bytes} slack")
    if obs.max_rss > rss_limit:
        bad.append(f"daemon RSS reached {obs.max_rss >> 20} MiB (limit {rss_limit >> 20} MiB)")
    if obs.max_fds > fd_limit:
        bad.append(f"daemon held {obs.max_fds} fds (limit {fd_limit})")
    return bad


def render(title: str, violations: list[str], details: dict[str, str]) -> str:
    """A failure report: what broke, then everything needed to reproduce and debug it."""
    body = "\n".join(f"  - {v}" for v in violations)
    extra = "\n".join(f"{k}:\n{v}" for k, v in details.items() if v)
    return f"{title}\n{body}\n{extra}"


def as_json(obj: object) -> str:
    return json.dumps(obj, indent=1, default=str)
