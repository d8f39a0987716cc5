"""Bytes over the socket into the daemon, against a bare Python sender/receiver pair.

Both use an AF_UNIX stream socket between two processes, the receiver reading with
``recv_into`` a reused 1 MiB buffer and writing each message to a new file on /dev/shm, so the
disk is not the bound (the daemon's staging directory and journal are on /dev/shm too). A
second bare receiver that drops the bytes shows the socket alone.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.bench.bare import end_run, send
from tests.bench.processes import BenchError, cpu_seconds
from tests.bench.report import MiB, Row, Section, Target, busy, figure, size_text
from tests.bench.suite import FREE_MARGIN_BYTES, Benchmark, Context, free_bytes
from tests.bench.workload import DRAIN_PAUSED, random_buffer

JOB = "bench-socket"
REPO = Path(__file__).resolve().parents[2]


def _bare_receiver(ctx: Context, name: str, discard: bool) -> tuple[socket.socket, int]:
    """Start a bare receiver process (killed by PID when the benchmark ends) and connect."""
    path = ctx.socket_path(name)
    outdir = ctx.fresh(f"{name}-files", shm=True)
    argv = [sys.executable, "-m", "tests.bench.bare", "receive", str(path), str(outdir)]
    proc = subprocess.Popen(argv + (["--discard"] if discard else []), stdin=subprocess.DEVNULL,
                            cwd=REPO)

    def stop() -> None:
        proc.kill()
        proc.wait(30)

    ctx.stack.callback(stop)
    deadline = time.monotonic() + 30
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ctx.stack.callback(sock.close)
    while True:
        try:
            sock.connect(str(path))
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError("the bare receiver did not start") from None
            time.sleep(0.02)
    sock.settimeout(300)
    return sock, proc.pid


def run_socket(ctx: Context, section: Section) -> None:
    size = ctx.pick(256 * MiB, 32 * MiB)
    shards = ctx.pick(4, 2)
    runs = ctx.runs(5, quick=1)
    total = size * shards
    on_shm = ctx.shm is not None and free_bytes(ctx.shm) > 3 * total + FREE_MARGIN_BYTES
    if not on_shm:
        section.notes.append("/dev/shm is missing or too small: staging and the bare receiver "
                             "wrote to the work disk instead, which may bound both sides.")
    data = random_buffer(size)
    receivers = {"bare": _bare_receiver(ctx, "bare", discard=False),
                 "drop": _bare_receiver(ctx, "drop", discard=True)}
    cases = ["ours", "bare", "drop", "draining"]
    times: dict[str, list[float]] = {c: [] for c in cases}
    # CPU seconds of the receiving process (daemon or bare receiver) and of the sender (this
    # process) over each timed span.
    receiver_cpu: dict[str, list[float]] = {c: [] for c in cases}
    sender_cpu: dict[str, list[float]] = {c: [] for c in cases}

    def measured(case: str, pid: int, send_all: Callable[[], None]) -> float:
        cpu_before, own_before = cpu_seconds(pid), time.process_time()
        started = time.perf_counter()
        send_all()
        took = time.perf_counter() - started
        receiver_cpu[case].append(cpu_seconds(pid) - cpu_before)
        sender_cpu[case].append(time.process_time() - own_before)
        return took

    def ours(case: str) -> float:
        # A fresh daemon per run. "ours": drain paused, the figure is the hand-off path alone;
        # "draining": the drain to /dev/shm runs beside the hand-offs, as in service.
        staging = ctx.fresh("socket-staging", shm=on_shm)
        dest = ctx.fresh("socket-dest", shm=on_shm)
        daemon = ctx.daemon("socket", f"file://{dest}", staging_dir=staging,
                            overrides=DRAIN_PAUSED if case == "ours" else {})
        with daemon.client() as client, client.generation(JOB, 1, rank=0, world_size=1) as gen:
            def send_all() -> None:
                for k in range(shards):
                    gen.put(f"shard-{k}.bin", data)
            took = measured(case, daemon.pid, send_all)
        daemon.stop()
        shutil.rmtree(staging)
        shutil.rmtree(dest)
        return took

    def pair(case: str) -> float:
        sock, pid = receivers[case]

        def send_all() -> None:
            for _ in range(shards):
                send(sock, data)
        took = measured(case, pid, send_all)
        end_run(sock)
        return took

    ctx.say(f"socket: {runs} runs of {shards} x {size_text(size)}")
    for i in range(runs):
        for case in cases[i % len(cases):] + cases[:i % len(cases)]:
            times[case].append(pair(case) if case in receivers else ours(case))
    rate = {k: [total / t for t in v] for k, v in times.items()}
    where = "/dev/shm" if on_shm else "the work disk"
    section.rows.append(Row(
        case=f"`put(bytes)`, {shards} x {size_text(size)}, staging on {where}",
        baseline_name="bare pair writing files", ours=figure(rate["ours"], "B/s"),
        baseline=figure(rate["bare"], "B/s"), target=Target(">=", 0.7),
        bound=(f"CPU: daemon {busy(receiver_cpu['ours'], times['ours'])}, client "
               f"{busy(sender_cpu['ours'], times['ours'])}; bare receiver "
               f"{busy(receiver_cpu['bare'], times['bare'])}, sender "
               f"{busy(sender_cpu['bare'], times['bare'])} (copies through the socket and into "
               "tmpfs pages)")))
    section.rows.append(Row(
        case=f"same, with the drain to {where} running", baseline_name="bare pair writing files",
        ours=figure(rate["draining"], "B/s"), baseline=figure(rate["bare"], "B/s"),
        bound=(f"CPU: daemon {busy(receiver_cpu['draining'], times['draining'])} (hand-off and "
               f"drain share the 2 cores), client {busy(sender_cpu['draining'], times['draining'])}")))
    section.notes.append(
        f"the socket alone (bare pair, receiver drops the bytes): "
        f"{figure(rate['drop'], 'B/s').show()}; ours / that = "
        f"{figure(rate['ours'], 'B/s').median / figure(rate['drop'], 'B/s').median:.2f}.")
    section.notes.append(
        "ours includes per shard: admission (a round trip before the bytes), an fsync "
        "(free on tmpfs), a rename and a journal commit. The daemon's drain is paused "
        "(drain.max_bandwidth_bytes_per_s = 1, a fresh daemon per run) in the first row, so "
        "that only the hand-off path is measured; the second row lets it drain meanwhile, as "
        "in service (no target: informational).")


SOCKET = Benchmark(
    name="socket",
    title="Socket throughput into the daemon",
    what=("Bytes per second handed off with `put(bytes)`, staging on /dev/shm so the disk is "
          "not the bound, against a bare Python sender/receiver pair on the same socket type "
          "(AF_UNIX stream, `recv_into` a reused 1 MiB buffer, each message written to a file "
          "on /dev/shm). Higher is better; ratio = ours / baseline."),
    run=run_socket,
)
