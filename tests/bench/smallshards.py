"""Many small shards: hand-offs per second from many concurrent clients (ack=local).

Ours: 64 client threads (each its own connection and rank of one generation) hand off
10,000 shards of 64 KiB between them. Baseline: one loop creating, writing, fsyncing and
renaming the same number of files of the same bytes on the same disk. The daemon's drain is
paused, so the figure is the hand-off path alone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time

from tests.bench.processes import BenchError, cpu_seconds
from tests.bench.report import KiB, Row, Section, Target, busy, figure
from tests.bench.suite import Benchmark, Context
from tests.bench.workload import DRAIN_PAUSED, settle, write_all

JOB = "bench-small"
SHARD_BYTES = 64 * KiB


def _bare_loop(directory: os.PathLike[str], count: int, payload: bytes) -> float:
    started = time.perf_counter()
    for i in range(count):
        tmp = os.path.join(directory, f"{i}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            write_all(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, os.path.join(directory, f"{i}.bin"))
    return time.perf_counter() - started


def run_small(ctx: Context, section: Section) -> None:
    count = ctx.pick(10_000, 512)
    clients = ctx.pick(64, 8)
    runs = ctx.runs(3, quick=1)
    payload = os.urandom(SHARD_BYTES)
    shares = [count // clients + (1 if r < count % clients else 0) for r in range(clients)]
    cpu: dict[str, list[float]] = {"daemon": [], "clients": [], "bare": []}

    def ours() -> float:
        # A fresh daemon per run with its drain paused, stopped once the hand-offs are done:
        # the figure is the hand-off path alone, and no run inherits another's backlog.
        staging = ctx.fresh("small-staging")
        dest = ctx.fresh("small-dest")  # never written: the drain is paused
        daemon = ctx.daemon("small", f"file://{dest}", staging_dir=staging,
                            overrides=DRAIN_PAUSED)
        barrier = threading.Barrier(clients + 1, timeout=120)
        ends: list[float] = []
        errors: list[BaseException] = []

        def rank(r: int) -> None:
            try:
                with daemon.client(timeout_s=300) as c, \
                        c.generation(JOB, 1, rank=r, world_size=clients) as gen:
                    barrier.wait()
                    for j in range(shares[r]):
                        gen.put(f"r{r}/s{j}.bin", payload)
                    ends.append(time.perf_counter())
            except BaseException as exc:
                errors.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=rank, args=(r,), name=f"rank-{r}")
                   for r in range(clients)]
        for t in threads:
            t.start()
        settle()
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait()  # a client that failed broke it: its error is raised below
        cpu_before, own_before = cpu_seconds(daemon.pid), time.process_time()
        started = time.perf_counter()
        for t in threads:
            t.join(600)
            if t.is_alive():
                raise BenchError(f"client thread {t.name} did not finish within 600 s")
        if errors:
            raise BenchError(f"{len(errors)} client(s) failed; first: {errors[0]!r}")
        took = max(ends) - started
        cpu["daemon"].append(cpu_seconds(daemon.pid) - cpu_before)
        cpu["clients"].append(time.process_time() - own_before)
        daemon.stop()
        shutil.rmtree(staging)
        shutil.rmtree(dest)
        return took

    def baseline() -> float:
        directory = ctx.fresh("small-bare")
        settle()
        own_before = time.process_time()
        took = _bare_loop(directory, count, payload)
        cpu["bare"].append(time.process_time() - own_before)
        shutil.rmtree(directory)
        return took

    ctx.say(f"small: {runs} runs of {count} x 64 KiB from {clients} clients")
    times: dict[str, list[float]] = {"ours": [], "bare": []}
    for i in range(runs):
        for case in (["ours", "bare"] if i % 2 == 0 else ["bare", "ours"]):
            times[case].append(ours() if case == "ours" else baseline())
    section.rows.append(Row(
        case=f"{count} x 64 KiB from {clients} clients, ack=local",
        baseline_name="one create/write/fsync/rename loop",
        ours=figure([count / t for t in times["ours"]], "1/s"),
        baseline=figure([count / t for t in times["bare"]], "1/s"),
        target=Target(">=", 0.5),
        bound=(f"fsync latency of the staging disk, and CPU: daemon "
               f"{busy(cpu['daemon'], times['ours'])}, the {clients} clients together "
               f"{busy(cpu['clients'], times['ours'])}; the bare loop "
               f"{busy(cpu['bare'], times['bare'])}")))
    section.notes.append(
        "ours does per shard: two round trips (admission, then the bytes), create + write + "
        "fsync + rename of the staged file, an fsync of the staging directory and a journal "
        "commit (SQLite, fsynced). The bare loop does create + write + fsync + rename only. "
        "The daemon's drain is paused (drain.max_bandwidth_bytes_per_s = 1, a fresh daemon "
        "per run) so that only the hand-off path is measured; in service the drain shares "
        "the CPU.")


SMALL = Benchmark(
    name="small",
    title="Many small shards",
    what=("Hand-offs per second for 10,000 shards of 64 KiB from 64 concurrent clients "
          "(threads, one connection each), ack=local, against a bare loop that creates, "
          "writes, fsyncs and renames the same files on the same disk. Higher is better; "
          "ratio = ours / baseline."),
    run=run_small,
)
