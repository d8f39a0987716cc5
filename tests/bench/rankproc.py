"""One rank of a many-process benchmark, in a process of its own (``python -m tests.bench.rankproc``).

``daemon SOCKET JOB STEP RANK WORLD``: hand off ``--shards`` shards of ``--size`` bytes with
``Generation.put(bytes)`` (ack=local) to the daemon; ``files DIR RANK``: the baseline, create,
write, fsync and close the same shards as files in DIR. Protocol on stdin/stdout, so that
every rank starts together and only the byte moves are timed: the process makes its buffer
(and begins its generation), prints ``ready``, waits for a line on stdin, moves the bytes,
prints one JSON line ``{"start", "end", "cpu"}`` (``time.monotonic()`` stamps, comparable across
processes; its own CPU seconds meanwhile), then seals its rank (not timed) and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tests.bench.workload import durable_write, random_buffer


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.bench.rankproc")
    p.add_argument("--shards", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    sub = p.add_subparsers(dest="mode", required=True)
    d = sub.add_parser("daemon")
    d.add_argument("socket")
    d.add_argument("job")
    d.add_argument("step", type=int)
    d.add_argument("rank", type=int)
    d.add_argument("world", type=int)
    f = sub.add_parser("files")
    f.add_argument("dir", type=Path)
    f.add_argument("rank", type=int)
    ns = p.parse_args(argv)
    data = random_buffer(ns.size)

    def report(start: float, cpu: float) -> None:
        end = time.monotonic()
        print(json.dumps({"start": start, "end": end, "cpu": time.process_time() - cpu}),
              flush=True)

    if ns.mode == "files":
        print("ready", flush=True)
        sys.stdin.readline()
        start, cpu = time.monotonic(), time.process_time()
        for k in range(ns.shards):
            durable_write(ns.dir / f"rank{ns.rank}-{k}.bin", data)
        report(start, cpu)
        return 0

    from ckptdrain.client import Client

    with Client(ns.socket, timeout_s=900) as client, \
            client.generation(ns.job, ns.step, rank=ns.rank, world_size=ns.world) as gen:
        print("ready", flush=True)
        sys.stdin.readline()
        start, cpu = time.monotonic(), time.process_time()
        for k in range(ns.shards):
            gen.put(f"rank{ns.rank}/shard-{k}.bin", data)
        report(start, cpu)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
