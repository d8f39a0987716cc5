"""DCP through ckptdrain against torch's FileSystemWriter/Reader on the same disk, side by side.

Each measurement is a fresh process (``tests.bench.dcprank``): peak RSS is a process's life.
Rows: peak RSS of one rank saving 1 GiB with ``async_save``; the training-visible stall of
``async_save`` and the time to durable with 256 MiB per rank x 2 ranks; ``dcp.load`` through
DrainReader from the node's local copy against FileSystemReader of the destination.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from tests.bench.report import GiB, MiB, Row, Section, Target, figure, size_text
from tests.bench.suite import Benchmark, Context

REPO = Path(__file__).resolve().parents[2]


def _ranks(ctx: Context, args: list[str], world: int, env: dict[str, str]) -> list[dict[str, Any]]:
    init = ctx.fresh("dcp-init") / f"init-{uuid.uuid4().hex}"
    procs = []
    for rank in range(world):
        e = {k: v for k, v in os.environ.items() if not k.startswith("CKPTDRAIN_")}
        e.update(env, RANK=str(rank), WORLD_SIZE=str(world), BENCH_INIT=str(init))
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.bench.dcprank", *args],
                                      cwd=REPO, env=e, stdout=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        stdout, _ = p.communicate(timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"a DCP rank exited {p.returncode}")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results


def run_dcp(ctx: Context, section: Section) -> None:
    big = ctx.pick(1 * GiB, 128 * MiB)
    per_rank = ctx.pick(256 * MiB, 32 * MiB)
    runs = ctx.runs(3)
    rss: dict[str, list[float]] = {"drain": [], "fs": []}
    shmem: dict[str, list[float]] = {"drain": [], "fs": []}
    stall: dict[str, list[float]] = {"drain": [], "fs": []}
    durable: dict[str, list[float]] = {"drain": [], "fs": []}
    load: dict[str, list[float]] = {"drain": [], "fs": []}
    step = 0
    for i in range(runs):
        ctx.say(f"dcp: run {i + 1} of {runs}")
        dest = ctx.fresh("dcp-dest")
        # The local copy of the newest committed generation is what DrainReader reads.
        daemon = ctx.daemon("dcp", f"file://{dest}",
                            overrides={"CKPTDRAIN_RETENTION__KEEP_LOCAL_COPY": "true"})
        env = {"CKPTDRAIN_SOCKET": str(daemon.socket_path)}
        for kind in ("drain", "fs"):  # side by side, alternating
            step += 1
            out = _ranks(ctx, ["save", kind, str(big)], 1, env | {
                "BENCH_STEP": str(step), "BENCH_DIR": str(ctx.fresh(f"dcp-fs-{kind}"))})[0]
            rss[kind].append(out["vmhwm"])
            shmem[kind].append(out["shmem_peak"])
        for kind in ("drain", "fs"):
            step += 1
            fs_dir = ctx.fresh("dcp-fs2")
            outs = _ranks(ctx, ["save", kind, str(2 * per_rank)], 2, env | {
                "BENCH_STEP": str(step), "BENCH_DIR": str(fs_dir)})
            stall[kind].append(max(o["stall_s"] for o in outs))
            durable[kind].append(max(o["durable_s"] for o in outs))
        # Load what was just saved: the newest committed step has its local copy on the node.
        saved = dest / "bench-dcp" / f"{step - 1:020d}"
        for kind in ("drain", "fs"):
            outs = _ranks(ctx, ["load", kind, str(2 * per_rank), str(step - 1), "2"], 1,
                          env | {"BENCH_DIR": str(saved)})
            # one rank loads the 2-rank save (resharded 2 -> 1)
            if not outs[0]["ok"] or (kind == "drain"
                                     and set(outs[0]["sources"].values()) != {"local"}):
                raise RuntimeError(f"the {kind} load was wrong: {outs[0]}")
            load[kind].append(outs[0]["load_s"])
        daemon.stop()
    section.rows.append(Row(
        case=f"peak RSS of a rank, async_save {size_text(big)}, DrainWriter (ack=local)",
        baseline_name="+ FileSystemWriter", ours=figure(rss["drain"], "B"),
        baseline=figure(rss["fs"], "B"), target=Target("<=", 1.1),
        bound="the state plus one staged copy (DCP's DefaultStager copy for FileSystemWriter; "
              "for DrainWriter the staging memfd, mapped)"))
    section.rows.append(Row(
        case=f"training-visible stall, async_save, {size_text(per_rank)}/rank x 2 ranks, "
             "DrainWriter", baseline_name="FileSystemWriter",
        ours=figure(stall["drain"], "s"), baseline=figure(stall["fs"], "s"),
        target=Target("<=", 0.8),
        bound="one copy of the state either way: pwrite into a memfd (pages never zeroed) vs "
              "DCP's copy into fresh memory"))
    section.rows.append(Row(
        case=f"time to durable, {size_text(per_rank)}/rank x 2 ranks (DrainWriter: committed "
             "at the destination)", baseline_name="FileSystemWriter (written and fsynced)",
        ours=figure(durable["drain"], "s"), baseline=figure(durable["fs"], "s"),
        bound="reported, no target: the commit adds a drain and a manifest after the hand-off"))
    section.rows.append(Row(
        case=f"dcp.load {size_text(2 * per_rank)} via DrainReader from the local copy",
        baseline_name="FileSystemReader from the destination",
        ours=figure(load["drain"], "s"), baseline=figure(load["fs"], "s"),
        target=Target("<=", 1 / 1.5),
        bound="the same local disk, page cache warm for both: DrainReader moves each tensor's "
              "bytes into the target once, FileSystemReader into torch.load's tensor, then a "
              "copy; a remote destination adds its reads"))
    section.notes.append(
        f"{runs} run(s), medians; every figure a fresh process. Shmem growth during the 1 GiB "
        f"save (memfd pages, not in RSS unless mapped): DrainWriter "
        f"{figure(shmem['drain'], 'B').show()}, FileSystemWriter {figure(shmem['fs'], 'B').show()}.")


DCP = Benchmark(
    name="dcp",
    title="DCP: DrainWriter/DrainReader against FileSystemWriter/Reader",
    what=("A rank's peak memory saving 1 GiB with `dcp.async_save`, the training-visible stall "
          "and the time to durable with 256 MiB per rank x 2 ranks (gloo), and `dcp.load` "
          "through DrainReader from the node's local copy against FileSystemReader of the "
          "destination, all on the same disk, alternating in one run."),
    run=run_dcp,
)
