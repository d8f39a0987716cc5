"""Many small shards: hand-offs per second from many concurrent clients (ack=local).

Ours: 64 client threads (each its own connection and rank of one generation) hand off
10,000 shards of 64 KiB between them. Baseline: one loop creating, writing, fsyncing and
renaming the same number of files of the same bytes on the same disk. The drain goes to
/dev/shm so its own fsyncs do not share the staging disk; its CPU still shares the machine.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

from tests.bench.processes import BenchError
from tests.bench.report import KiB, Row, Section, Target, figure
from tests.bench.suite import Benchmark, Context
from tests.bench.workload import commit_and_clear, settle, write_all

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
    staging = ctx.fresh("small-staging")
    dest = ctx.fresh("small-dest", shm=True)
    daemon = ctx.daemon("small", f"file://{dest}", staging_dir=staging)
    control = daemon.client()
    shares = [count // clients + (1 if r < count % clients else 0) for r in range(clients)]
    step = 0

    def ours() -> float:
        nonlocal step
        step += 1
        this_step = step
        barrier = threading.Barrier(clients + 1, timeout=120)
        ends: list[float] = []
        errors: list[BaseException] = []

        def rank(r: int) -> None:
            try:
                with daemon.client(timeout_s=300) as c, \
                        c.generation(JOB, this_step, rank=r, world_size=clients) as gen:
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
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            pass
        started = time.perf_counter()
        for t in threads:
            t.join(600)
            if t.is_alive():
                raise BenchError(f"client thread {t.name} did not finish within 600 s")
        if errors:
            raise BenchError(f"{len(errors)} client(s) failed; first: {errors[0]!r}")
        took = max(ends) - started
        commit_and_clear(control, JOB, this_step, dest)
        return took

    def baseline() -> float:
        directory = ctx.fresh("small-bare")
        settle()
        took = _bare_loop(directory, count, payload)
        shutil.rmtree(directory)
        return took

    ctx.say(f"small: {runs} runs of {count} x 64 KiB from {clients} clients")
    times: dict[str, list[float]] = {"ours": [], "bare": []}
    for i in range(runs):
        for case in (["ours", "bare"] if i % 2 == 0 else ["bare", "ours"]):
            times[case].append(ours() if case == "ours" else baseline())
    control.close()
    daemon.stop()
    section.rows.append(Row(
        case=f"{count} x 64 KiB from {clients} clients, ack=local",
        baseline_name="one create/write/fsync/rename loop",
        ours=figure([count / t for t in times["ours"]], "1/s"),
        baseline=figure([count / t for t in times["bare"]], "1/s"),
        target=Target(">=", 0.5),
        bound="fsync latency of the staging disk; ours adds a directory fsync and a journal "
              "commit per shard, and two round trips"))


SMALL = Benchmark(
    name="small",
    title="Many small shards",
    what=("Hand-offs per second for 10,000 shards of 64 KiB from 64 concurrent clients "
          "(threads, one connection each), ack=local, against a bare loop that creates, "
          "writes, fsyncs and renames the same files on the same disk. Higher is better; "
          "ratio = ours / baseline."),
    run=run_small,
)
