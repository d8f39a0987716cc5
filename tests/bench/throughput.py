"""Bytes over the socket into the daemon, against a bare Python sender/receiver pair.

Both use an AF_UNIX stream socket between two processes, the receiver reading with
``recv_into`` a reused 1 MiB buffer and writing each message to a new file on /dev/shm, so the
disk is not the bound (the daemon's staging directory and journal are on /dev/shm too). A
second bare receiver that drops the bytes shows the socket alone.
"""

from __future__ import annotations

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
from tests.bench.workload import commit_and_clear, random_buffer

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
    staging = ctx.fresh("socket-staging", shm=on_shm)
    dest = ctx.fresh("socket-dest", shm=on_shm)
    daemon = ctx.daemon("socket", f"file://{dest}", staging_dir=staging)
    client = daemon.client()
    receivers = {"bare": _bare_receiver(ctx, "bare", discard=False),
                 "drop": _bare_receiver(ctx, "drop", discard=True)}
    times: dict[str, list[float]] = {"ours": [], "bare": [], "drop": []}
    # CPU seconds of the receiving process (daemon or bare receiver) and of the sender (this
    # process) over each timed span.
    receiver_cpu: dict[str, list[float]] = {"ours": [], "bare": [], "drop": []}
    sender_cpu: dict[str, list[float]] = {"ours": [], "bare": [], "drop": []}
    step = 0

    def measured(case: str, pid: int, send_all: Callable[[], None]) -> float:
        cpu_before, own_before = cpu_seconds(pid), time.process_time()
        started = time.perf_counter()
        send_all()
        took = time.perf_counter() - started
        receiver_cpu[case].append(cpu_seconds(pid) - cpu_before)
        sender_cpu[case].append(time.process_time() - own_before)
        return took

    def ours() -> float:
        nonlocal step
        step += 1
        with client.generation(JOB, step) as gen:
            def send_all() -> None:
                for k in range(shards):
                    gen.put(f"shard-{k}.bin", data)
            took = measured("ours", daemon.pid, send_all)
        commit_and_clear(client, JOB, step, dest)
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
        order = ["ours", "bare", "drop"]
        order = order[i % 3:] + order[:i % 3]
        for case in order:
            times[case].append(ours() if case == "ours" else pair(case))
    client.close()
    daemon.stop()
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
    section.notes.append(
        f"the socket alone (bare pair, receiver drops the bytes): "
        f"{figure(rate['drop'], 'B/s').show()}; ours / that = "
        f"{figure(rate['ours'], 'B/s').median / figure(rate['drop'], 'B/s').median:.2f}.")
    section.notes.append(
        "ours includes per shard: admission (a round trip before the bytes), an fsync "
        "(free on tmpfs), a rename and a journal commit.")


SOCKET = Benchmark(
    name="socket",
    title="Socket throughput into the daemon",
    what=("Bytes per second handed off with `put(bytes)`, staging on /dev/shm so the disk is "
          "not the bound, against a bare Python sender/receiver pair on the same socket type "
          "(AF_UNIX stream, `recv_into` a reused 1 MiB buffer, each message written to a file "
          "on /dev/shm). Higher is better; ratio = ours / baseline."),
    run=run_socket,
)
