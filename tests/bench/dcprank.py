"""One rank of the DCP benchmarks, in a process of its own (``python -m tests.bench.dcprank``).

``save WRITER BYTES``: build a state dict of BYTES (16 float32 tensors, every page written),
``dcp.async_save`` it through WRITER (``drain``: DrainWriter to $CKPTDRAIN_SOCKET, ack=local;
``fs``: FileSystemWriter into $BENCH_DIR, fsynced), and print one JSON line: ``stall_s`` (the
time ``async_save`` blocked the caller), ``handoff_s`` (until its future completed),
``durable_s`` (until committed at the destination for drain, the future for fs: it fsyncs),
``vmhwm`` (peak RSS of the process) and ``shmem_peak`` (the most /proc/meminfo Shmem grew
during the save: memfd pages never mapped into the process are not in its RSS). With
$WORLD_SIZE > 1 the ranks form a gloo group through $BENCH_INIT, and time from one barrier.

``load READER BYTES STEP RANKS``: ``dcp.load`` the BYTES that RANKS ranks saved from ``drain``
(DrainReader, this node's local copy) or ``fs`` (FileSystemReader of $BENCH_DIR); prints
``load_s`` and where DrainReader read each file from.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import warnings
from typing import Any

JOB = "bench-dcp"


def meminfo_shmem() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


def vmhwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def make_state(per_rank: int, ranks: range, fill: bool = True) -> dict[str, Any]:
    """16 float32 tensors of each rank in ``ranks`` (its own names: nothing is deduplicated),
    every page written; ``fill=False``: a target to load into."""
    import torch

    n = 16
    return {f"rank{r}.layer{i}": torch.full((per_rank // n // 4,), float(100 * r + i) if fill
                                            else -1.0, dtype=torch.float32)
            for r in ranks for i in range(n)}


def main(argv: list[str]) -> int:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from ckptdrain.client.dcp import DrainReader, DrainWriter

    warnings.filterwarnings("ignore", message=".*single process")
    mode, kind, total = argv[0], argv[1], int(argv[2])
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    socket_path = os.environ.get("CKPTDRAIN_SOCKET", "")
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{os.environ['BENCH_INIT']}",
                                rank=rank, world_size=world)
    out: dict[str, Any] = {"rank": rank}
    if mode == "save":
        step = int(os.environ.get("BENCH_STEP", "1"))
        state = make_state(total // world, range(rank, rank + 1))
        group = dist.new_group(backend="gloo") if world > 1 else None
        base, peak = meminfo_shmem(), [0]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.01):
                peak[0] = max(peak[0], meminfo_shmem() - base)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        if world > 1:
            dist.barrier()
        writer: Any = (DrainWriter(JOB, step, socket_path=socket_path, ack="local")
                       if kind == "drain" else FileSystemWriter(os.environ["BENCH_DIR"]))
        t0 = time.monotonic()
        future = dcp.async_save(state, storage_writer=writer, process_group=group)
        t1 = time.monotonic()
        future.result()
        t2 = time.monotonic()
        if kind == "drain":
            writer.wait(900)
            writer.close()
        t3 = time.monotonic()
        stop.set()
        sampler.join()
        out.update(stall_s=t1 - t0, handoff_s=t2 - t0, durable_s=t3 - t0, vmhwm=vmhwm(),
                   shmem_peak=peak[0])
    else:
        step, saved_by = int(argv[3]), int(argv[4])
        target = make_state(total // saved_by, range(saved_by), fill=False)
        expected = make_state(total // saved_by, range(saved_by))
        t0 = time.monotonic()
        if kind == "drain":
            with DrainReader(JOB, step, socket_path=socket_path) as reader:
                dcp.load(target, storage_reader=reader)
                out["sources"] = reader.sources
        else:
            dcp.load(target, storage_reader=FileSystemReader(os.environ["BENCH_DIR"]))
        out["load_s"] = time.monotonic() - t0
        out["ok"] = all(bool((target[k] == v).all()) for k, v in expected.items())
    if world > 1:
        dist.destroy_process_group()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
