"""A well-behaved client's hand-off latency among hostile clients, against the same client alone.

One daemon with its default limits. The well-behaved client hands off one shard per
generation (``begin``, ``put(bytes)``, ``seal``) and each ``put`` is timed. Alone, and while
64 hostile clients (``tests.bench.hostileproc``, a process of their own) trickle frames a byte
at a time, hold connections open and send mutated frames: the figure is the p99 of the
``put`` latencies of each phase; phases alternate, several times.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tests.bench.processes import BenchError, cpu_seconds
from tests.bench.report import MiB, Row, Section, Target, busy, figure, size_text
from tests.bench.suite import Benchmark, Context
from tests.bench.workload import random_buffer

JOB = "bench-hostile"
HOSTILE_CLIENTS = 64
HOSTILE_UID = 65534  # nobody
REPO = Path(__file__).resolve().parents[2]


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def run_hostile(ctx: Context, section: Section) -> None:
    size = ctx.pick(1 * MiB, 256 * 1024)
    handoffs = ctx.pick(200, 20)
    runs = ctx.runs(3, quick=1)
    data = random_buffer(size)
    dest = ctx.fresh("hostile-dest", shm=True)
    # The hostile clients are another user of the node where the benchmark may switch users
    # (it runs as root): per-uid limits hold them, not the well-behaved client.
    other = ["--uid", str(HOSTILE_UID)] if os.geteuid() == 0 else []
    access = ({"CKPTDRAIN_ACCESS__SOCKET_MODE": "0666",
               "CKPTDRAIN_ACCESS__ALLOWED_UIDS": f"[{HOSTILE_UID}]"} if other else {})
    daemon = ctx.daemon("hostile", f"file://{dest}", overrides=access)
    if other:
        os.chmod(daemon.socket_path.parent, 0o755)
    client = daemon.client()
    step = 0
    p99s: dict[str, list[float]] = {"alone": [], "hostile": []}
    medians: dict[str, list[float]] = {"alone": [], "hostile": []}
    cpu: dict[str, list[float]] = {"alone": [], "hostile": []}
    walls: dict[str, list[float]] = {"alone": [], "hostile": []}
    did: list[dict[str, int]] = []

    def phase(kind: str) -> None:
        nonlocal step
        took: list[float] = []
        cpu_before, wall_before = cpu_seconds(daemon.pid), time.perf_counter()
        for _ in range(handoffs):
            step += 1
            with client.generation(JOB, step, rank=0, world_size=1) as gen:
                started = time.perf_counter()
                gen.put("shard.bin", data)
                took.append(time.perf_counter() - started)
        client.wait(JOB, step, timeout_s=300)
        cpu[kind].append(cpu_seconds(daemon.pid) - cpu_before)
        walls[kind].append(time.perf_counter() - wall_before)
        p99s[kind].append(p99(took))
        medians[kind].append(statistics.median(took))

    def among_hostile() -> None:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.bench.hostileproc", str(daemon.socket_path),
             str(HOSTILE_CLIENTS), *other], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True)
        try:
            assert proc.stdout is not None and proc.stdin is not None
            if proc.stdout.readline().strip() != "ready":
                raise BenchError("the hostile clients did not start")
            phase("hostile")
            proc.stdin.close()
            did.append(json.loads(proc.stdout.readline()))
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    ctx.say(f"hostile: {runs} runs of {handoffs} hand-offs of {size_text(size)}, alone and "
            f"among {HOSTILE_CLIENTS} hostile clients")
    for i in range(runs):
        for kind in (("alone", "hostile") if i % 2 == 0 else ("hostile", "alone")):
            if kind == "alone":
                phase("alone")
            else:
                among_hostile()
    client.close()
    if daemon.proc is not None and daemon.proc.poll() is not None:
        raise BenchError(f"the daemon exited during the hostile phase: {daemon.log_tail(2000)}")
    daemon.stop()
    section.rows.append(Row(
        case=f"p99 `put(bytes)` latency, {size_text(size)} shard, {handoffs} hand-offs",
        baseline_name="the same client alone", ours=figure(p99s["hostile"], "s"),
        baseline=figure(p99s["alone"], "s"), target=Target("<=", 1.5),
        bound=(f"median put {statistics.median(medians['hostile']) * 1e3:.1f} ms among "
               f"hostile clients, {statistics.median(medians['alone']) * 1e3:.1f} ms alone; "
               f"daemon {busy(cpu['hostile'], walls['hostile'])} (hostile), "
               f"{busy(cpu['alone'], walls['alone'])} (alone)")))
    totals = {key: sum(d.get(key, 0) for d in did) for key in ("connections", "frames", "refused")}
    section.notes.append(
        f"the hostile process made {totals['connections']} connections and sent "
        f"{totals['frames']} mutated frames over the runs ({totals['refused']} connects "
        f"refused; {'as uid ' + str(HOSTILE_UID) if other else 'as the same user'}); a third "
        "of its clients trickle a byte every 0.5 s (cut off after "
        "`client_rate_grace_s`), a third hold idle connections, a third fuzz.")


HOSTILE = Benchmark(
    name="hostile",
    title="Hand-off latency among hostile clients",
    what=("p99 seconds of a well-behaved client's `put(bytes)` while 64 hostile clients "
          "trickle frames, hold connections and send mutated frames, against the same client "
          "alone on the same daemon. Lower is better; ratio = hostile / alone."),
    run=run_hostile,
)
