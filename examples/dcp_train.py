"""`make demo-dcp`: a torchrun job checkpoints through ckptdrain with PyTorch DCP, is killed
mid-run, restarts, and carries on from its newest committed checkpoint.

What it shows:

1. Two ckptdrain daemons ("node-a", "node-b") start in a temp directory and drain to one
   ``file://`` destination, as two GPU nodes would drain to one Lustre tree.
2. ``torchrun --nproc-per-node 4`` trains a small FSDP2-sharded MLP on CPU (gloo). Local ranks
   0,1 hand their checkpoint files to node-a's daemon, ranks 2,3 to node-b's. Every few steps
   the ranks save model, optimizer, data position and RNG state with ``dcp.async_save`` and a
   ``DrainWriter``: training goes on while the daemons drain.
3. Partway through, this script kills torchrun (SIGTERM, as a scheduler preempting a job
   does). Checkpoints already handed off still commit: the daemons, not the job, own them.
4. torchrun starts again; the ranks ask ``Client.latest`` for the newest committed
   checkpoint, load it with torch's stock ``FileSystemReader`` and continue. The script checks
   that the resumed run starts right after that checkpoint and that its losses are those the
   first run computed for the same steps: same weights, optimizer state, data and dropout.

Run: ``make demo-dcp`` or ``.venv/bin/python examples/dcp_train.py [--keep]``. The same file
is the training script torchrun runs (with ``--worker``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptdrain.client import Client, DaemonUnavailable

JOB = "dcp-train"
WORLD_SIZE = 4
NODES = ("node-a", "node-b")
TOTAL_STEPS = 40
SAVE_EVERY = 5
KILL_AFTER_STEP = 17  # the first run is killed at the first quiet step from here on
STEP_PAUSE_S = 0.2  # stands in for the forward/backward time of a real model
SAMPLES = 2048
GLOBAL_BATCH = 64
RUN_TIMEOUT_S = 100.0
SETTLE_TIMEOUT_S = 60.0

STEP_LINE = re.compile(r"^step (\d+) loss (\S+)$")
SAVING_LINE = re.compile(r"^checkpoint (\d+) saving$")
HANDED_OFF_LINE = re.compile(r"^checkpoint (\d+) handed off$")
RESUMED_LINE = re.compile(r"^resumed from checkpoint (\d+)")


# ==== the training job (run by torchrun with --worker) ==========================================
def worker() -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.stateful import Stateful
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ckptdrain.client.dcp import DrainWriter

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    sockets = os.environ["DCP_TRAIN_SOCKETS"].split(",")
    # One torchrun here plays two nodes: each half of the local ranks uses one daemon.
    socket_path = sockets[local_rank * len(sockets) // world]
    dest = Path(os.environ["DCP_TRAIN_DEST"])
    Path(os.environ["DCP_TRAIN_PIDS"], f"rank{rank}").write_text(str(os.getpid()))

    dist.init_process_group("gloo")
    # async_save runs its collectives in a background thread; a group of its own keeps them
    # from interleaving with training's collectives.
    checkpoint_group = dist.new_group(backend="gloo")

    class Batches:
        """A shuffled pass over a fixed synthetic dataset; its position is checkpointed."""

        def __init__(self) -> None:
            gen = torch.Generator().manual_seed(0)
            self.x = torch.randn(SAMPLES, 32, generator=gen)
            w = torch.randn(32, 1, generator=gen)
            self.y = torch.sin(0.15 * self.x @ w) + 0.05 * torch.randn(SAMPLES, 1, generator=gen)
            self.epoch, self.offset = 0, 0

        def next(self) -> tuple[torch.Tensor, torch.Tensor]:
            if self.offset + GLOBAL_BATCH > SAMPLES:
                self.epoch, self.offset = self.epoch + 1, 0
            order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(self.epoch))
            per_rank = GLOBAL_BATCH // world
            start = self.offset + rank * per_rank
            index = order[start:start + per_rank]
            self.offset += GLOBAL_BATCH
            return self.x[index], self.y[index]

        def state_dict(self) -> dict[str, int]:
            return {"epoch": self.epoch, "offset": self.offset}

        def load_state_dict(self, sd: dict[str, int]) -> None:
            self.epoch, self.offset = sd["epoch"], sd["offset"]

    torch.manual_seed(0)  # the same initial weights on every rank before FSDP shards them
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1),
    )
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = Batches()
    torch.manual_seed(1000 + rank)  # dropout differs per rank: its RNG state is per rank

    class TrainState(Stateful):
        """Everything a restart needs, as DCP's Stateful: dcp.save/load call these."""

        def state_dict(self) -> dict[str, Any]:
            model_sd, optim_sd = get_state_dict(model, optim)
            return {"model": model_sd, "optim": optim_sd, "data": batches.state_dict(),
                    "rng": {f"rank{rank}": torch.get_rng_state()}}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            set_state_dict(model, optim, model_state_dict=sd["model"],
                           optim_state_dict=sd["optim"])
            batches.load_state_dict(sd["data"])
            torch.set_rng_state(sd["rng"][f"rank{rank}"])

    def say(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    with Client(socket_path) as client:
        # Rank 0 decides; every rank loads the same step even if one commits meanwhile.
        newest = [client.latest(JOB) if rank == 0 else None]
        dist.broadcast_object_list(newest, src=0)
        start = 0
        if newest[0] is not None:
            start = newest[0]
            dcp.load({"train": TrainState()},
                     storage_reader=FileSystemReader(dest / JOB / f"{start:020d}"))
            say(f"resumed from checkpoint {start} (epoch {batches.epoch}, "
                f"offset {batches.offset})")

    pending: tuple[int, DrainWriter, Any] | None = None

    def finish_pending(block: bool) -> None:
        nonlocal pending
        if pending is None:
            return
        step, writer, future = pending
        if not block and not future.done():
            return
        future.result(timeout=RUN_TIMEOUT_S)  # raises what the save raised
        writer.close()
        pending = None
        say(f"checkpoint {step} handed off")

    for step in range(start + 1, TOTAL_STEPS + 1):
        x, y = batches.next()
        optim.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        time.sleep(STEP_PAUSE_S)
        finish_pending(block=False)
        say(f"step {step} loss {mean_loss.item() / world!r}")
        if step % SAVE_EVERY == 0:
            finish_pending(block=True)  # one save in flight at a time
            writer = DrainWriter(JOB, step, socket_path=socket_path)
            future = dcp.async_save({"train": TrainState()}, storage_writer=writer,
                                    process_group=checkpoint_group)
            pending = (step, writer, future)
            say(f"checkpoint {step} saving")
    last = pending[1] if pending is not None else None
    finish_pending(block=True)
    if last is not None:
        with Client(socket_path) as client:
            client.wait(JOB, TOTAL_STEPS, timeout_s=RUN_TIMEOUT_S)
        say(f"checkpoint {TOTAL_STEPS} committed")
    dist.destroy_process_group()


# ==== the launcher: daemons, torchrun, the kill and the checks ===================================
class DemoFailed(Exception):
    """A check of the demo failed; the message says which."""


@dataclass
class Run:
    """What rank 0 printed during one torchrun run."""

    losses: dict[int, str] = field(default_factory=dict)
    saving: list[int] = field(default_factory=list)
    handed_off: list[int] = field(default_factory=list)
    resumed_from: int | None = None
    killed_at: int | None = None
    returncode: int | None = None

    def observe(self, line: str) -> None:
        if m := STEP_LINE.match(line):
            self.losses[int(m[1])] = m[2]
        elif m := SAVING_LINE.match(line):
            self.saving.append(int(m[1]))
        elif m := HANDED_OFF_LINE.match(line):
            self.handed_off.append(int(m[1]))
        elif m := RESUMED_LINE.match(line):
            self.resumed_from = int(m[1])

    def quiet(self, step: int) -> bool:
        """No save in flight, and none begins before the next step line."""
        return (set(self.saving) == set(self.handed_off)
                and step % SAVE_EVERY not in (0, SAVE_EVERY - 1))


class Daemon:
    def __init__(self, root: Path, node: str, dest: Path) -> None:
        self.node = node
        self.socket_path = root / f"{node}.sock"
        self.log_path = root / f"{node}.log"
        state = root / node
        state.mkdir()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTDRAIN_")}
        self.env.update({
            "CKPTDRAIN_NODE_ID": node,
            "CKPTDRAIN_SOCKET": str(self.socket_path),
            "CKPTDRAIN_STAGING_DIR": str(state / "staging"),
            "CKPTDRAIN_DESTINATION__URI": f"file://{dest}",
            "CKPTDRAIN_METRICS__LISTEN": "127.0.0.1:0",
            "CKPTDRAIN_DRAIN__COMMIT_POLL_INTERVAL_S": "0.2",
            "XDG_STATE_HOME": str(state / "xdg"),
        })
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        exe = str(Path(sys.executable).with_name("ckptdrain"))
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([exe, "serve"], env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise DemoFailed(f"daemon {self.node} exited {self.proc.returncode}; see {self.log_path}")
            with contextlib.suppress(DaemonUnavailable), Client(self.socket_path, timeout_s=5) as c:
                c.status()
                return
            if time.monotonic() > deadline:
                raise DemoFailed(f"daemon {self.node} did not come up in {timeout_s} s; see {self.log_path}")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def in_flight(self) -> list[str]:
        with Client(self.socket_path, timeout_s=10) as c:
            return [f"{g['job']}/{g['step']} {g['state']}" for g in c.status()["generations"]
                    if g["state"] in ("open", "recorded")]


def read_lines(stream: Any, lines: queue.Queue[str | None]) -> None:
    for raw in stream:
        lines.put(raw.decode(errors="replace").rstrip("\n"))
    lines.put(None)


def torchrun(root: Path, daemons: list[Daemon], dest: Path, title: str,
             kill_after: int | None) -> Run:
    """One torchrun run; with ``kill_after``, SIGTERM it at the first quiet step from there."""
    pids = root / "pids"
    pids.mkdir(exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               DCP_TRAIN_SOCKETS=",".join(str(d.socket_path) for d in daemons),
               DCP_TRAIN_DEST=str(dest), DCP_TRAIN_PIDS=str(pids))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(WORLD_SIZE), str(Path(__file__).resolve()), "--worker"]
    print(f"\n== {title}: torchrun --nproc-per-node {WORLD_SIZE} {Path(__file__).name}", flush=True)
    run = Run()
    stderr_path = root / f"torchrun-{title.split()[0]}.log"
    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=stderr,
                                start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()
    assert proc.stdout is not None
    reader = threading.Thread(target=read_lines, args=(proc.stdout, lines), daemon=True)
    reader.start()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise DemoFailed(f"{title} did not finish in {RUN_TIMEOUT_S:g} s; see {stderr_path}") from None
            if line is None:
                break
            print(f"   {line}", flush=True)
            run.observe(line)
            step = max(run.losses, default=0)
            if (kill_after is not None and run.killed_at is None and STEP_LINE.match(line)
                    and step >= kill_after and run.quiet(step)):
                print(f"   ** killing torchrun after step {step} (SIGTERM to pid {proc.pid}) **",
                      flush=True)
                run.killed_at = step
                proc.send_signal(signal.SIGTERM)
        run.returncode = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        # torchrun puts each rank in a session of its own: make sure none outlives it.
        for pid_file in pids.glob("rank*"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            pid_file.unlink()
        proc.stdout.close()
        reader.join(10)
    if kill_after is None and run.returncode != 0:
        raise DemoFailed(f"{title} exited {run.returncode}; see {stderr_path}")
    return run


def settle(daemons: list[Daemon]) -> None:
    """Wait until no daemon has a generation still draining or waiting for the other node."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while busy := [g for d in daemons for g in d.in_flight()]:
        if time.monotonic() > deadline:
            raise DemoFailed(f"generations still in flight after {SETTLE_TIMEOUT_S:g} s: {busy}")
        time.sleep(0.2)


def check(condition: bool, message: str) -> None:
    if not condition:
        raise DemoFailed(message)


def launch(keep: bool) -> int:
    root = Path(tempfile.mkdtemp(prefix="ckptdrain-dcp-"))  # short: it holds the sockets
    dest = root / "destination"
    daemons = [Daemon(root, node, dest) for node in NODES]
    started = time.monotonic()
    try:
        for daemon in daemons:
            daemon.start()
        print(f"daemons {', '.join(NODES)} up; destination file://{dest}")

        first = torchrun(root, daemons, dest, "first run", kill_after=KILL_AFTER_STEP)
        check(first.killed_at is not None, "the first run ended before it could be killed")
        check(first.returncode != 0, "torchrun exited 0 although it was killed")
        settle(daemons)
        with Client(daemons[0].socket_path) as client:
            latest = client.latest(JOB)
        print(f"\nafter the kill: newest committed checkpoint is {latest} "
              f"(handed off before the kill: {first.handed_off})")
        check(latest is not None, "no checkpoint committed before the kill")
        assert latest is not None
        check(latest == max(first.handed_off),
              f"checkpoint {max(first.handed_off)} was handed off but {latest} is the newest "
              "committed")

        second = torchrun(root, daemons, dest, "second run", kill_after=None)
        resumed_steps = sorted(second.losses)
        check(second.resumed_from == latest,
              f"the second run resumed from {second.resumed_from}, not {latest}")
        check(resumed_steps[0] == latest + 1,
              f"the second run began at step {resumed_steps[0]}, not {latest + 1}")
        check(resumed_steps[-1] == TOTAL_STEPS, f"the second run stopped at {resumed_steps[-1]}")
        overlap = [s for s in resumed_steps if s in first.losses]
        check(bool(overlap), "no step was computed by both runs")
        for step in overlap:
            a, b = float(first.losses[step]), float(second.losses[step])
            check(math.isclose(a, b, rel_tol=1e-6),
                  f"step {step}: the resumed run's loss {b} is not the first run's {a}")
        check(second.losses[latest + 1] != first.losses[1],
              "the resumed run's first loss is the first run's step-1 loss: it restarted")
        identical = all(first.losses[s] == second.losses[s] for s in overlap)
        with Client(daemons[1].socket_path) as client:
            final = client.latest(JOB)
        check(final == TOTAL_STEPS, f"the newest committed checkpoint is {final}, not {TOTAL_STEPS}")

        print("\n== summary")
        print(f"first run : steps 1..{first.killed_at}, killed; checkpoints handed off "
              f"{first.handed_off}, newest committed {latest}")
        print(f"second run: resumed from checkpoint {latest}, steps {latest + 1}..{TOTAL_STEPS}")
        print(f"steps {overlap[0]}..{overlap[-1]} ran in both runs: the losses are "
              f"{'bit-for-bit identical' if identical else 'equal within 1e-6'} "
              "(weights, AdamW state, data position and dropout RNG all restored)")
        print(f"committed: {sorted(int(p.parent.name) for p in (dest / JOB).glob('*/MANIFEST.json'))}"
              f", newest {final}; done in {time.monotonic() - started:.0f} s")
        return 0
    except DemoFailed as exc:
        print(f"\ndemo failed: {exc}", file=sys.stderr)
        return 1
    finally:
        for daemon in daemons:
            daemon.stop()
        if keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help="run as a torchrun rank")
    parser.add_argument("--keep", action="store_true", help="keep the temp directory")
    args = parser.parse_args()
    if args.worker:
        worker()
        return 0
    return launch(args.keep)


if __name__ == "__main__":
    sys.exit(main())
