"""The restart drill, in the project: a 2-rank DCP job (FSDP2, AdamW, CPU gloo) is killed in
the middle of a save, restarted from the newest committed step, saves that same step again
(a new attempt, its two ranks beginning at once on one daemon), and the re-save commits and
resumes bitwise. A wait of the restarted run, started before the re-save's first begin, waits
for it instead of answering the killed attempt's failure."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import set_state_dict

from ckptdrain.client import Client
from ckptdrain.client.dcp import DrainReader, DrainWriter
from tests.conftest import DaemonProcess
from tests.integration.test_dcp import build, full_tensors, init_group, same_bits, state

pytestmark = pytest.mark.torch

JOB = "drill"
WORLD = 2
EVERY = 5
TIMEOUT_S = 120.0


class DyingWriter(DrainWriter):
    """The coordinator is killed after every rank handed off its data and rank 1 sealed:
    the attempt is left with one sealed rank and one aborted (the shape that used to wedge)."""

    def finish(self, metadata: Any, results: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, rank: int, first: int,
          last: int) -> None:
    for step in range(first, last):  # seeded by the step: a resumed run sees the same data
        gen = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        optim.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optim.step()


def resume(model: torch.nn.Module, optim: torch.optim.Optimizer, rank: int,
           socket_path: str) -> tuple[int, dict[str, str]]:
    newest = [Client(socket_path).latest(JOB) if rank == 0 else None]
    dist.broadcast_object_list(newest, src=0)
    target = state(model, optim, rank, step=-1)
    with DrainReader(JOB, newest[0], socket_path=socket_path) as reader:
        dcp.load(target, storage_reader=reader)
        sources = reader.sources
    set_state_dict(model, optim, model_state_dict=target["model"],
                   optim_state_dict=target["optim"])
    return int(target["progress"]["step"]), sources


def job(rank: int, world: int, init_file: str, socket_path: str, work: str, run: int) -> None:
    os.environ["CKPTDRAIN_ATTEMPT"] = f"run-{run}"  # what torchrun's restart count gives
    init_group(rank, world, init_file)
    out: dict[str, Any] = {"rank": rank}
    try:
        model, optim = build(world, seed=0)
        ckpt_group = dist.new_group(backend="gloo")
        if run == 1:
            train(model, optim, rank, 0, EVERY)
            with DrainWriter(JOB, EVERY, socket_path=socket_path) as writer:
                dcp.save(state(model, optim, rank, EVERY), storage_writer=writer)
                writer.wait(60)
            train(model, optim, rank, EVERY, 2 * EVERY)
            # Killed during this save (rank 0 in finish; rank 1 then, by the harness).
            dcp.save(state(model, optim, rank, 2 * EVERY), process_group=ckpt_group,
                     storage_writer=DyingWriter(JOB, 2 * EVERY, socket_path=socket_path))
            raise AssertionError("the save was meant to be killed")
        start, out["sources"] = resume(model, optim, rank, socket_path)
        out["resumed_from"] = start
        if run == 2:
            answer: dict[str, Any] = {}
            waiter = None
            if rank == 0:  # asked before the re-save's first begin
                def wait() -> None:
                    try:
                        answer.update(Client(socket_path).wait(JOB, 2 * EVERY, 60))
                    except BaseException as exc:
                        answer["error"] = f"{type(exc).__name__}: {exc}"
                waiter = threading.Thread(target=wait)
                waiter.start()
                time.sleep(0.3)  # let the wait reach the daemon first (ordering, not a check)
            dist.barrier()
            train(model, optim, rank, start, 2 * EVERY)
            with DrainWriter(JOB, 2 * EVERY, socket_path=socket_path) as writer:
                future = dcp.async_save(state(model, optim, rank, 2 * EVERY),
                                        storage_writer=writer, process_group=ckpt_group)
                future.result(timeout=60)
                out["commit"] = writer.wait(60)["committed"]
            if waiter is not None:
                waiter.join(60)
                out["early_wait"] = answer
            full = full_tensors(state(model, optim, rank, 2 * EVERY))
            train(model, optim, rank, 2 * EVERY, 2 * EVERY + 2)
            after = full_tensors(state(model, optim, rank, 2 * EVERY + 2))
            if rank == 0:
                torch.save({"saved": full, "after": after}, Path(work) / "expected.pt")
        else:
            expected = torch.load(Path(work) / "expected.pt", weights_only=False)
            for key in ("saved", "after"):  # rank 0's own tensor is only rank 0's
                expected[key] = {k: v for k, v in expected[key].items()
                                 if not k.startswith("/per_rank/")}
            loaded = full_tensors(state(model, optim, rank, start))
            train(model, optim, rank, start, start + 2)
            after = full_tensors(state(model, optim, rank, start + 2))
            out["saved_equal"] = [k for k, v in expected["saved"].items()
                                  if not same_bits(v, loaded[k])]
            out["after_equal"] = [k for k, v in expected["after"].items()
                                  if not same_bits(v, after[k])]
            out["compared"] = len(expected["after"])
        (Path(work) / f"run{run}-rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def run(run_no: int, daemon: DaemonProcess, work: Path, *, killed: bool = False) -> None:
    context = mp.start_processes(
        job, args=(WORLD, str(work / f"init-{uuid.uuid4().hex}"), str(daemon.socket_path),
                   str(work), run_no),
        nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while True:
            codes = [p.exitcode for p in context.processes]
            if killed and codes[0] is not None:
                assert codes[0] == -signal.SIGKILL, f"rank 0 exited {codes[0]}, not killed"
                return  # the job is dead: the harness takes the other rank down too
            if not killed and all(c is not None for c in codes):
                if codes != [0] * WORLD:
                    context.join()  # raises with the failed rank's traceback
                return
            assert time.monotonic() < deadline, f"run {run_no} did not finish in {TIMEOUT_S} s"
            time.sleep(0.1)
    finally:
        for p in context.processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(10)


def test_a_job_killed_during_a_save_resaves_the_step_and_resumes_bitwise(
        make_daemon: Any, tmp_path: Path) -> None:
    daemon: DaemonProcess = make_daemon()
    run(1, daemon, tmp_path, killed=True)
    client = daemon.client()
    assert client.latest(JOB) == EVERY  # the killed save never committed
    run(2, daemon, tmp_path)
    for rank in range(WORLD):
        out = json.loads((tmp_path / f"run2-rank{rank}.json").read_text())
        assert out["resumed_from"] == EVERY and out["commit"] is True
    early = json.loads((tmp_path / "run2-rank0.json").read_text())["early_wait"]
    assert early.get("committed") is True, early  # not the killed attempt's failure
    assert client.latest(JOB) == 2 * EVERY
    run(3, daemon, tmp_path)
    for rank in range(WORLD):
        out = json.loads((tmp_path / f"run3-rank{rank}.json").read_text())
        assert out["resumed_from"] == 2 * EVERY
        assert out["saved_equal"] == [] and out["after_equal"] == [], out
        assert out["compared"] >= 6 + 3 * 6
        assert set(out["sources"].values()) == {"local"}  # the node's own copy fed the load
    status = client.status()
    assert all(g["state"] in ("committed", "failed", "cancelled")
               for g in status["generations"]), status["generations"]
