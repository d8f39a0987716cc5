"""Many small shards, from many concurrent clients (ack=local).

``small``: 64 client threads (each its own connection and rank of one generation) hand off
10,000 shards of 64 KiB between them. Baseline: one loop creating, writing, fsyncing and
renaming the same number of files of the same bytes on the same disk. The daemon's drain is
paused, so the figure is the hand-off path alone.

``smallcommit``: the same hand-offs, drained to a ``file://`` destination on the same disk and
committed (part record, MANIFEST.json, LATEST), timed from the clients' release to the commit.
Baseline: the same loop into a staging directory, then ``cp -r`` of that directory to the
destination and a ``sync -f`` of its filesystem. Beside the time, CPU milliseconds per shard:
the daemon's (every thread, /proc/<pid>/task), against the loop's and cp's and sync's together.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from tests.bench.processes import (
    THREAD_KINDS,
    BenchError,
    cpu_seconds,
    run_timed,
    thread_cpu,
    thread_delta,
)
from tests.bench.report import KiB, Row, Section, Target, busy, figure
from tests.bench.suite import Benchmark, Context
from tests.bench.workload import DRAIN_PAUSED, settle, write_all

JOB = "bench-small"
SHARD_BYTES = 64 * KiB


def _bare_loop(directory: os.PathLike[str], count: int, payload: bytes,
               names: Sequence[str] | None = None) -> float:
    """Create, write, fsync and rename ``count`` files (``names``, relative, default
    ``<i>.bin``) in ``directory``; returns the seconds it took."""
    started = time.perf_counter()
    for i in range(count):
        final = os.path.join(directory, names[i] if names is not None else f"{i}.bin")
        tmp = final + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            write_all(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final)
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
        _release(threads, barrier)
        cpu_before, own_before = cpu_seconds(daemon.pid), time.process_time()
        started = time.perf_counter()
        _join(threads, errors)
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


# -- hand-off to commit ---------------------------------------------------------------------
COMMIT_JOB = "bench-smallcommit"


def _shard_names(shares: Sequence[int]) -> list[str]:
    return [f"r{r}/s{j}.bin" for r, n in enumerate(shares) for j in range(n)]


def _handoff_and_commit(ctx: Context, code: Path | None, clients: int, shares: Sequence[int],
                        payload: bytes) -> tuple[float, float, dict[str, float], float]:
    """One fresh daemon draining to a fresh ``file://`` destination: every client hands its
    share off and seals, then the generation is waited on until committed (MANIFEST.json and
    LATEST written). Returns (seconds from the clients' release to the commit, to the last
    hand-off's seal, the daemon's CPU by kind of thread over the first span, this process's
    CPU meanwhile: the clients')."""
    staging = ctx.fresh("commit-staging")
    dest = ctx.fresh("commit-dest")
    daemon = ctx.daemon("commit", f"file://{dest}", staging_dir=staging, code=code)
    barrier = threading.Barrier(clients + 1, timeout=120)
    errors: list[BaseException] = []
    ends: list[float] = []

    def rank(r: int) -> None:
        try:
            with daemon.client(timeout_s=300) as c:
                with c.generation(COMMIT_JOB, 1, rank=r, world_size=clients) as gen:
                    barrier.wait()
                    for j in range(shares[r]):
                        gen.put(f"r{r}/s{j}.bin", payload)
                ends.append(time.perf_counter())
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank-{r}")
               for r in range(clients)]
    with daemon.client(timeout_s=600) as waiter:
        _release(threads, barrier)
        before, own_before = thread_cpu(daemon.pid), time.process_time()
        started = time.perf_counter()
        _join(threads, errors)
        waiter.wait(COMMIT_JOB, 1, timeout_s=600)
        took = time.perf_counter() - started
        delta = thread_delta(before, thread_cpu(daemon.pid))
        own = time.process_time() - own_before
    if not (dest / COMMIT_JOB / "LATEST").is_file():
        raise BenchError("the generation was reported committed but LATEST is missing")
    daemon.stop()
    shutil.rmtree(staging)
    shutil.rmtree(dest)
    return took, max(ends) - started, delta, own


def _loop_and_copy(ctx: Context, count: int, names: Sequence[str],
                   payload: bytes) -> tuple[float, float]:
    """The naive path: the loop into a staging directory, ``cp -r`` of it to the destination,
    ``sync -f`` of the destination's filesystem. Returns (seconds, CPU seconds of all three)."""
    staging = ctx.fresh("naive-staging")
    dest = ctx.fresh("naive-dest")
    for d in sorted({os.path.dirname(n) for n in names}):
        (staging / d).mkdir(parents=True, exist_ok=True)
    settle()
    own_before = time.process_time()
    started = time.perf_counter()
    _bare_loop(staging, count, payload, names)
    loop_cpu = time.process_time() - own_before
    copied = run_timed(["sh", "-c", 'cp -r -- "$0" "$1"/gen && sync -f -- "$1"',
                        str(staging), str(dest)], timeout_s=600)
    took = time.perf_counter() - started
    shutil.rmtree(staging)
    shutil.rmtree(dest)
    return took, loop_cpu + copied.cpu_s


def _threads_per_shard(deltas: Sequence[dict[str, float]], count: int) -> str:
    parts = [f"{kind} {statistics.median(d.get(kind, 0.0) for d in deltas) / count * 1e3:.2f}"
             for kind in (*THREAD_KINDS, "all")]
    return "daemon CPU ms per shard by thread: " + ", ".join(parts)


def run_commit(ctx: Context, section: Section) -> None:
    count = ctx.pick(10_000, 512)
    clients = ctx.pick(64, 8)
    runs = ctx.runs(3, quick=1)
    payload = os.urandom(SHARD_BYTES)
    shares = [count // clients + (1 if r < count % clients else 0) for r in range(clients)]
    names = _shard_names(shares)
    codes: dict[str, tuple[str, Path | None]] = {"ours": ("", None)}
    if ctx.versus is not None:
        codes["versus"] = (f" [versus {ctx.versus.name}]", ctx.versus)
    sides = [*codes, "naive"]
    times: dict[str, list[float]] = {side: [] for side in sides}
    cpu: dict[str, list[float]] = {side: [] for side in sides}
    client_cpu: dict[str, list[float]] = {side: [] for side in codes}
    threads: dict[str, list[dict[str, float]]] = {side: [] for side in codes}
    sealed: dict[str, list[float]] = {side: [] for side in codes}
    loads: list[float] = []
    ctx.say(f"smallcommit: {runs} runs of {count} x 64 KiB from {clients} clients to commit")
    for i in range(runs):
        order = sides[i % len(sides):] + sides[:i % len(sides)]
        for side in order if i % 2 == 0 else reversed(order):
            loads.append(os.getloadavg()[0])
            if side == "naive":
                took, used = _loop_and_copy(ctx, count, names, payload)
            else:
                took, handed, delta, own = _handoff_and_commit(ctx, codes[side][1], clients,
                                                               shares, payload)
                sealed[side].append(handed)
                used = delta["all"]
                threads[side].append(delta)
                client_cpu[side].append(own)
            times[side].append(took)
            cpu[side].append(used)
    load = f"load average (1 min) before each run {min(loads):.2f}-{max(loads):.2f}"
    for side, (label, _) in codes.items():
        section.rows.append(Row(
            case=f"{count} x 64 KiB hand-off to commit, file:// (same disk){label}",
            baseline_name="create/write/fsync/rename loop + cp -r + sync -f",
            ours=figure(times[side], "s"), baseline=figure(times["naive"], "s"),
            target=Target("<=", 1.2),
            bound=(f"fsyncs of the disk, and CPU: daemon {busy(cpu[side], times[side])}, the "
                   f"{clients} clients together {busy(client_cpu[side], times[side])}; naive "
                   f"{busy(cpu['naive'], times['naive'])}; the last rank sealed after "
                   f"{figure(sealed[side], 's').show()}; {load}")))
        section.rows.append(Row(
            case=f"CPU per shard, hand-off to commit{label}",
            baseline_name="loop + cp -r + sync -f",
            ours=figure([c / count for c in cpu[side]], "s"),
            baseline=figure([c / count for c in cpu["naive"]], "s"),
            target=Target("<=", 2.0),
            bound=(f"the daemon process (all threads) against the naive side's processes; "
                   f"lower is better; {_threads_per_shard(threads[side], count)}")))
    section.notes.append(
        "ours: a fresh daemon per run (drain running, retention keeps everything), the clients "
        "begin their ranks, are released together, hand off and seal; timed until `wait` "
        "reports the generation committed (MANIFEST.json, then LATEST). Per shard the daemon "
        "fsyncs the staged file and the destination file; the staging directory and the "
        "journal once per batch of concurrent acknowledgements, each destination directory "
        "and the journal once per drained batch (up to 64 shards). "
        "The naive side fsyncs each staged file only; cp -r and one sync -f of the "
        "destination filesystem make the copies durable. Times are shown as seconds: lower is "
        "better, ratio = ours / naive.")


COMMIT = Benchmark(
    name="smallcommit",
    title="Many small shards, hand-off to commit",
    what=("Seconds from release to commit for 10,000 shards of 64 KiB from 64 concurrent "
          "clients (ack=local), drained to file:// on the same disk and committed, against a "
          "create/write/fsync/rename loop into a staging directory followed by cp -r to the "
          "destination and sync -f; and CPU milliseconds per shard on each side. Lower is "
          "better; ratio = ours / baseline."),
    run=run_commit,
)


def _release(threads: list[threading.Thread], barrier: threading.Barrier) -> None:
    """Start the client threads and let them go at once, on a settled machine."""
    for t in threads:
        t.start()
    settle()
    with contextlib.suppress(threading.BrokenBarrierError):
        barrier.wait()  # a client that failed broke it: its error is raised by _join


def _join(threads: list[threading.Thread], errors: list[BaseException]) -> None:
    for t in threads:
        t.join(600)
        if t.is_alive():
            raise BenchError(f"client thread {t.name} did not finish within 600 s")
    if errors:
        raise BenchError(f"{len(errors)} client(s) failed; first: {errors[0]!r}")
