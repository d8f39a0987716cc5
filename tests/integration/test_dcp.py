"""PyTorch Distributed Checkpoint through ckptdrain: ``DrainWriter`` against real daemons.

Multi-rank tests run real gloo process groups on CPU: 4 ranks as 2 "nodes" (ranks 0,1 hand
off to daemon node-a, ranks 2,3 to node-b; both daemons drain to one ``file://``
destination). The model is sharded with FSDP2 (``fully_shard``), so every rank holds different
shards of the weights and of AdamW's state (``step`` counters included). What the daemons
commit is loaded back with torch's stock ``FileSystemReader`` and compared bit for bit.

The 4-rank job runs once per module (it is most of this file's runtime): it saves step 100
with ``dcp.save`` and step 200 with ``dcp.async_save``, loads each back on the same 4 ranks,
and leaves its results and the expected full tensors in a work directory for the tests.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import io
import json
import os
import pickle
import shutil
import signal
import struct
import sys
import tempfile
import time
import uuid
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ckptdrain.client import Client, GenerationFailed, RejectedInput
from ckptdrain.client.dcp import DrainReader, DrainWriter
from ckptdrain.daemon.checksums import of_bytes
from tests.conftest import DaemonProcess

pytestmark = pytest.mark.torch

JOB = "dcp-test"
SYNC_STEP = 100
ASYNC_STEP = 200
WORLD = 4
RANKS_PER_NODE = 2
RANKS_TIMEOUT_S = 150.0
COMMIT_TIMEOUT_S = 60.0
SINGLE_PROCESS_WARNING = "assuming the intent is to (save|load) in a single process"


def generation_dir(dest: Path, job: str, step: int) -> Path:
    return dest / job / f"{step:020d}"


# -- what the ranks run (module level: spawned processes import this module) --------------------
def build(world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small MLP sharded by FSDP2 over all ranks, and AdamW over its sharded parameters."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8), torch.nn.ReLU(),
        torch.nn.Linear(8, 4),
    )
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, rank: int, steps: int) -> None:
    for i in range(steps):
        gen = torch.Generator().manual_seed(1000 * rank + i)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        optim.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optim.step()


def state(model: torch.nn.Module, optim: torch.optim.Optimizer, rank: int,
          step: int) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optim)
    return {
        "model": model_sd,
        "optim": optim_sd,
        # A tensor only this rank has, and a plain value: DCP saves both kinds.
        "per_rank": {f"rank{rank}": torch.arange(5, dtype=torch.float64) * (rank + 1)},
        "progress": {"step": step},
    }


def leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from leaves(obj[key], f"{prefix}/{key}")
    elif isinstance(obj, list | tuple):
        for index, value in enumerate(obj):
            yield from leaves(value, f"{prefix}/{index}")
    else:
        yield prefix, obj


def same_bits(a: Any, b: Any) -> bool:
    """Bitwise equality of tensors (DTensors by their local shard), == for anything else."""
    if isinstance(a, DTensor) or isinstance(b, DTensor):
        if not (isinstance(a, DTensor) and isinstance(b, DTensor)):
            return False
        return a.placements == b.placements and same_bits(a.to_local(), b.to_local())
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return bool(torch.equal(a.detach().reshape(-1).contiguous().view(torch.uint8),
                                b.detach().reshape(-1).contiguous().view(torch.uint8)))
    return bool(a == b)


def compare(expected: dict[str, Any], actual: dict[str, Any]) -> int:
    """Raise on the first leaf that differs; return how many leaves were compared."""
    want, got = dict(leaves(expected)), dict(leaves(actual))
    assert want.keys() == got.keys(), sorted(want.keys() ^ got.keys())
    for key, value in want.items():
        assert same_bits(value, got[key]), f"{key}: saved {value!r}, loaded {got[key]!r}"
    return len(want)


def clone(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: clone(v) if isinstance(v, dict) else
            ([clone(x) if isinstance(x, dict) else x for x in v] if isinstance(v, list) else
             (v.detach().clone() if isinstance(v, torch.Tensor) else v))
            for k, v in sd.items()}


def load_and_compare(gen_dir: Path, expected: dict[str, Any], world: int, rank: int,
                     step: int) -> dict[str, int]:
    """Load ``gen_dir`` into a differently initialised model with the stock reader; compare."""
    model, optim = build(world, seed=99)
    target = state(model, optim, rank, step=-1)
    dcp.load(target, storage_reader=FileSystemReader(gen_dir))
    loaded = compare(expected, target)
    set_state_dict(model, optim, model_state_dict=target["model"],
                   optim_state_dict=target["optim"])
    model_sd, optim_sd = get_state_dict(model, optim)
    applied = compare({"model": expected["model"], "optim": expected["optim"]},
                      {"model": model_sd, "optim": optim_sd})
    return {"loaded": loaded, "applied": applied}


def full_tensors(sd: dict[str, Any]) -> dict[str, Any]:
    """Every leaf as a full (unsharded) value; a collective: all ranks must call it."""
    return {key: value.full_tensor() if isinstance(value, DTensor) else value
            for key, value in leaves(sd)}


def init_group(rank: int, world: int, init_file: str) -> None:
    # A rank that torch's C++ aborts leaves no Python traceback; this prints every thread's
    # stack to the captured stderr, so one says where it happened (see end_rank).
    faulthandler.enable(all_threads=True)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)


def end_rank() -> None:
    """A rank whose work is done and checked (its results written) ends here, every rank
    together (a barrier), without the interpreter's teardown. torch aborted a rank at that
    teardown three times in CI ("terminate called without an active exception" in C++, the
    main thread in no Python frame: static destructors after the rank's function had
    returned), on the resharded loads through DrainReader; not reproduced on demand."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def save_ranks(rank: int, world: int, init_file: str, sockets: list[str], dest: str,
               work: str) -> None:
    init_group(rank, world, init_file)
    try:
        socket_path = sockets[rank // RANKS_PER_NODE]
        model, optim = build(world, seed=0)
        train(model, optim, rank, steps=3)
        result: dict[str, Any] = {"rank": rank}

        sd = state(model, optim, rank, SYNC_STEP)
        expected = clone(sd)
        with DrainWriter(JOB, SYNC_STEP, socket_path=socket_path) as writer:
            dcp.save(sd, storage_writer=writer)
            result["sync_commit"] = writer.wait(COMMIT_TIMEOUT_S)["committed"]
        full = full_tensors(expected)
        if rank == 0:
            torch.save(full, Path(work) / f"expected-{SYNC_STEP}.pt")
        result["sync"] = load_and_compare(
            Path(dest) / JOB / f"{SYNC_STEP:020d}", expected, world, rank, SYNC_STEP)

        train(model, optim, rank, steps=2)
        sd = state(model, optim, rank, ASYNC_STEP)
        expected = clone(sd)
        # Its own group: the save's collectives run in a background thread while training's
        # run here, and two threads sharing one gloo group would interleave differently.
        checkpoint_group = dist.new_group(backend="gloo")
        with DrainWriter(JOB, ASYNC_STEP, socket_path=socket_path) as writer:
            future = dcp.async_save(sd, storage_writer=writer, process_group=checkpoint_group)
            # The state dict was staged by async_save: training goes on meanwhile.
            train(model, optim, rank, steps=1)
            future.result(timeout=COMMIT_TIMEOUT_S)
            result["async_commit"] = writer.wait(COMMIT_TIMEOUT_S)["committed"]
        full = full_tensors(expected)
        if rank == 0:
            torch.save(full, Path(work) / f"expected-{ASYNC_STEP}.pt")
        result["async"] = load_and_compare(
            Path(dest) / JOB / f"{ASYNC_STEP:020d}", expected, world, rank, ASYNC_STEP)
        (Path(work) / f"save-rank{rank}.json").write_text(json.dumps(result))
    except BaseException:
        dist.destroy_process_group()
        raise
    end_rank()


def load_resharded(rank: int, world: int, init_file: str, dest: str, work: str,
                   socket_path: str = "") -> None:
    init_group(rank, world, init_file)
    try:
        model, optim = build(world, seed=7)
        model_sd, optim_sd = get_state_dict(model, optim)
        target = {"model": model_sd, "optim": optim_sd, "progress": {"step": -1}}
        sources: dict[str, str] = {}
        step = ASYNC_STEP if socket_path else SYNC_STEP
        if socket_path:  # through one node's daemon: its local copies, the rest from dest
            # The newest committed step: the one whose local copies the daemons keep.
            with DrainReader(JOB, socket_path=socket_path) as reader:
                dcp.load(target, storage_reader=reader)
                sources = reader.sources
        else:
            dcp.load(target, storage_reader=FileSystemReader(Path(dest) / JOB / f"{SYNC_STEP:020d}"))
        set_state_dict(model, optim, model_state_dict=target["model"],
                       optim_state_dict=target["optim"])
        model_sd, optim_sd = get_state_dict(model, optim)
        loaded = full_tensors({"model": model_sd, "optim": optim_sd,
                               "progress": target["progress"]})
        expected = torch.load(Path(work) / f"expected-{step}.pt", weights_only=False)
        expected = {k: v for k, v in expected.items() if not k.startswith("/per_rank/")}
        assert expected.keys() == loaded.keys(), sorted(expected.keys() ^ loaded.keys())
        for key, value in expected.items():
            assert same_bits(value, loaded[key]), f"{key}: saved {value!r}, loaded {loaded[key]!r}"
        shards = [v.to_local().shape for v in model_sd.values() if isinstance(v, DTensor)]
        tag = "drain" if socket_path else "fs"
        (Path(work) / f"reshard-{tag}-rank{rank}.json").write_text(
            json.dumps({"compared": len(expected), "local_shapes": [list(s) for s in shards],
                        "sources": sources}))
    except BaseException:
        dist.destroy_process_group()
        raise
    end_rank()


def run_ranks(fn: Callable[..., None], world: int, *args: Any,
              timeout_s: float = RANKS_TIMEOUT_S) -> None:
    """Spawn ``world`` ranks of ``fn``; a rank's exception fails the test with its traceback."""
    context = mp.start_processes(fn, args=(world, *args), nprocs=world, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise AssertionError(f"{world} ranks of {fn.__name__} did not finish in {timeout_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
                process.join(10)


# -- the shared 4-rank job ---------------------------------------------------------------------
@dataclass
class Cluster:
    daemons: list[DaemonProcess]
    dest: Path
    work: Path

    def result(self, name: str) -> dict[str, Any]:
        return json.loads((self.work / name).read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("dcp")
    sockets = Path(tempfile.mkdtemp(prefix="ckd-dcp-", dir="/tmp"))  # sun_path is short
    dest = root / "dest"
    daemons: list[DaemonProcess] = []
    try:
        for node in ("node-a", "node-b"):
            (root / node).mkdir()
            daemon = DaemonProcess(root=root / node, socket_path=sockets / f"{node}.sock",
                                   node_id=node, dest_uri=f"file://{dest}")
            daemons.append(daemon)
            daemon.start()
        work = root / "work"
        work.mkdir()
        run_ranks(save_ranks, WORLD, str(root / f"init-{uuid.uuid4().hex}"),
                  [str(d.socket_path) for d in daemons], str(dest), str(work))
        yield Cluster(daemons, dest, work)
    finally:
        for daemon in daemons:
            with contextlib.suppress(AssertionError):
                daemon.stop(timeout_s=20)
        shutil.rmtree(sockets, ignore_errors=True)


def test_save_by_four_ranks_loads_bitwise_equal_with_stock_reader(cluster: Cluster) -> None:
    for rank in range(WORLD):
        result = cluster.result(f"save-rank{rank}.json")
        assert result["sync_commit"] is True
        # model (3 layers x weight, bias) + AdamW (step, exp_avg, exp_avg_sq per parameter,
        # param group settings) + this rank's tensor + progress: compared leaf by leaf.
        assert result["sync"]["loaded"] >= 6 + 3 * 6 + 2
        assert result["sync"]["applied"] >= 6 + 3 * 6


def test_async_save_by_four_ranks_loads_bitwise_equal(cluster: Cluster) -> None:
    for rank in range(WORLD):
        result = cluster.result(f"save-rank{rank}.json")
        assert result["async_commit"] is True
        assert result["async"]["loaded"] == result["sync"]["loaded"]
        assert result["async"]["applied"] == result["sync"]["applied"]


def test_saved_by_four_ranks_loads_resharded_on_two(cluster: Cluster, tmp_path: Path) -> None:
    run_ranks(load_resharded, 2, str(tmp_path / "init"), str(cluster.dest), str(cluster.work))
    for rank in range(2):
        result = cluster.result(f"reshard-fs-rank{rank}.json")
        assert result["compared"] >= 6 + 3 * 6 + 1
        # Two ranks, so each holds half of every weight's rows: really a different layout.
        assert [16, 16] in result["local_shapes"]


def test_drain_reader_loads_resharded_from_local_copies_and_the_destination(
        cluster: Cluster, tmp_path: Path) -> None:
    """Two ranks on node-a load the 4-rank save through DrainReader: node-a's own ranks'
    files from its checked local copies, node-b's from the destination, resharded."""
    run_ranks(load_resharded, 2, str(tmp_path / "init"), str(cluster.dest), str(cluster.work),
              str(cluster.daemons[0].socket_path))
    sources: dict[str, set[str]] = {}
    for rank in range(2):
        result = cluster.result(f"reshard-drain-rank{rank}.json")
        assert result["compared"] >= 6 + 3 * 6 + 1
        assert [16, 16] in result["local_shapes"]
        assert result["sources"][".metadata"] == "local"
        for name, source in result["sources"].items():  # each rank reads what it needs
            sources.setdefault(name, set()).add(source)
    assert {name: sources[name] for name in sorted(sources) if name != ".metadata"} == {
        "__0_0.distcp": {"local"}, "__1_0.distcp": {"local"},
        "__2_0.distcp": {"destination"}, "__3_0.distcp": {"destination"}}


@pytest.mark.parametrize("step", [SYNC_STEP, ASYNC_STEP])
def test_manifest_lists_metadata_and_every_distcp_file(cluster: Cluster, step: int) -> None:
    gen_dir = generation_dir(cluster.dest, JOB, step)
    manifest = json.loads((gen_dir / "MANIFEST.json").read_text())
    assert (manifest["job"], manifest["generation"], manifest["world_size"]) == (JOB, step, WORLD)
    shards = {s["path"]: s for s in manifest["shards"]}
    on_disk = {p.name for p in gen_dir.glob("*.distcp")}
    assert on_disk == {f"__{rank}_0.distcp" for rank in range(WORLD)}
    assert set(shards) == on_disk | {".metadata"}
    assert (shards[".metadata"]["rank"], shards[".metadata"]["node"]) == (0, "node-a")
    for rank in range(WORLD):
        entry = shards[f"__{rank}_0.distcp"]
        assert entry["rank"] == rank
        assert entry["node"] == ("node-a" if rank < RANKS_PER_NODE else "node-b")
    for path, entry in shards.items():
        data = (gen_dir / path).read_bytes()
        assert entry["size"] == len(data)
        assert entry["checksum"] == of_bytes(data)
    assert {c.latest(JOB) for c in (d.client() for d in cluster.daemons)} == {ASYNC_STEP}


# -- single process (no process group): rank 0 of world size 1 ------------------------------------
def plain_state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(64, 32, generator=gen),
        "b": torch.randn(32, generator=gen).to(torch.bfloat16),
        "nested": {"steps": torch.tensor(17), "note": "text survives too"},
    }


def archive_records(archive: bytes) -> dict[str, tuple[int, int, bytes]]:
    """name -> (header offset, CRC-32 field, the record's stored bytes) of a torch.save zip
    (read raw: zipfile.read would check the CRC-32)."""
    records = {}
    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        for info in zf.infolist():
            name_len, extra_len = struct.unpack_from("<26xHH", archive, info.header_offset)
            start = info.header_offset + 30 + name_len + extra_len
            records[info.filename] = (info.header_offset, info.CRC,
                                      archive[start:start + info.file_size])
    return records


def assert_same_archives(ours: Path, reference: Path) -> None:
    """DrainWriter's data files are FileSystemWriter's, archive by archive, with the same
    records at the same offsets and the same bytes, but for what skip_data leaves out of a
    storage record: its CRC-32 field is 0, and the archive's serialization_id (torch derives it
    from the records' CRCs) differs."""
    layout = FileSystemReader(reference).read_metadata().storage_data
    assert {(k, v.relative_path, v.offset, v.length) for k, v in layout.items()} == {
        (k, v.relative_path, v.offset, v.length)
        for k, v in FileSystemReader(ours).read_metadata().storage_data.items()}
    for info in layout.values():
        mine, theirs = ((d / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
                        for d in (ours, reference))
        if not mine.startswith(b"PK"):
            assert mine == theirs  # a BYTE_IO item, as it was given
            continue
        got, want = archive_records(mine), archive_records(theirs)
        assert got.keys() == want.keys()
        for name, (offset, crc, data) in got.items():
            assert offset == want[name][0], name
            if name.endswith("/.data/serialization_id"):
                continue
            assert data == want[name][2], name
            assert crc == (0 if "/data/" in name else want[name][1]), name


def test_single_process_save_matches_file_system_writer(make_daemon: Any, tmp_path: Path) -> None:
    daemon = make_daemon()
    sd = plain_state()
    with DrainWriter(JOB, 5, socket_path=daemon.socket_path) as writer:
        with pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING):
            dcp.save(sd, storage_writer=writer)
        writer.wait(COMMIT_TIMEOUT_S)
    gen_dir = generation_dir(daemon.dest, JOB, 5)

    reference = tmp_path / "reference"
    with pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING):
        dcp.save(plain_state(), storage_writer=FileSystemWriter(reference))
    ours = {p.name for p in gen_dir.iterdir()} - {"MANIFEST.json", "_parts"}
    assert ours == {p.name for p in reference.iterdir()} == {"__0_0.distcp", ".metadata"}
    # Same serializer, same archives: the data file is FileSystemWriter's but for CRC fields.
    assert_same_archives(gen_dir, reference)

    target = {"w": torch.zeros(64, 32), "b": torch.zeros(32, dtype=torch.bfloat16),
              "nested": {"steps": torch.tensor(0), "note": ""}}
    with pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING):
        dcp.load(target, storage_reader=FileSystemReader(gen_dir))
    assert compare(plain_state(), target) == 4


def test_thread_count_splits_files_like_file_system_writer(make_daemon: Any,
                                                           tmp_path: Path) -> None:
    daemon = make_daemon()
    with DrainWriter(JOB, 6, socket_path=daemon.socket_path, thread_count=3) as writer:
        with pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING):
            dcp.save(plain_state(), storage_writer=writer)
        writer.wait(COMMIT_TIMEOUT_S)
    gen_dir = generation_dir(daemon.dest, JOB, 6)
    reference = tmp_path / "reference"
    with pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING):
        dcp.save(plain_state(), storage_writer=FileSystemWriter(reference, thread_count=3))
    names = sorted(p.name for p in reference.glob("*.distcp"))
    assert names == ["__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    assert sorted(p.name for p in gen_dir.glob("*.distcp")) == names
    assert_same_archives(gen_dir, reference)
    target = {"w": torch.zeros(64, 32), "b": torch.zeros(32, dtype=torch.bfloat16),
              "nested": {"steps": torch.tensor(0), "note": ""}}
    with pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING):
        dcp.load(target, storage_reader=FileSystemReader(gen_dir))
    assert compare(plain_state(), target) == 4


class Unpicklable:
    def __reduce__(self) -> Any:
        raise RuntimeError("this value cannot be serialized")


def test_failed_save_aborts_the_generation(make_daemon: Any) -> None:
    daemon = make_daemon()
    sd = {"w": torch.ones(8), "bad": Unpicklable()}
    with DrainWriter(JOB, 7, socket_path=daemon.socket_path) as writer, \
            pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING), \
            pytest.raises(CheckpointException, match="cannot be serialized"):
        dcp.save(sd, storage_writer=writer)
    with daemon.client() as client:
        with pytest.raises(GenerationFailed, match="aborted"):
            client.wait(JOB, 7, timeout_s=COMMIT_TIMEOUT_S)
        assert client.latest(JOB) is None
    assert not (generation_dir(daemon.dest, JOB, 7) / "MANIFEST.json").exists()


def test_coordinator_part_left_open_by_a_failed_save_is_aborted_when_dropped(
        make_daemon: Any) -> None:
    """DCP does not call finish() when another rank failed; dropping the writer aborts."""
    daemon = make_daemon()
    writer = DrainWriter(JOB, 8, socket_path=daemon.socket_path)
    planner = DefaultSavePlanner()
    planner.set_up_planner(plain_state(), storage_meta=writer.storage_meta(), is_coordinator=True)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    local = writer.prepare_local_plan(planner.create_local_plan())
    plans, _metadata = planner.create_global_plan([local])
    plans = writer.prepare_global_plan(plans)
    writer.write_data(planner.finish_plan(plans[0]), planner).wait()
    with daemon.client() as client:
        status = {(g["job"], g["step"]): g for g in client.status()["generations"]}
        assert status[(JOB, 8)]["ranks"] == {"0": "open"}
        del writer
        gc.collect()
        with pytest.raises(GenerationFailed, match="dropped before the save finished"):
            client.wait(JOB, 8, timeout_s=COMMIT_TIMEOUT_S)


def test_one_writer_saves_one_generation(make_daemon: Any) -> None:
    daemon = make_daemon()
    with DrainWriter(JOB, 9, socket_path=daemon.socket_path) as writer:
        with pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING):
            dcp.save(plain_state(), storage_writer=writer)
        with pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING), \
                pytest.raises(CheckpointException, match="create a DrainWriter"):
            dcp.save(plain_state(), storage_writer=writer)
        writer.wait(COMMIT_TIMEOUT_S)


def test_checkpoint_id_and_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING), \
            pytest.raises(RejectedInput, match="without checkpoint_id"):
        dcp.save(plain_state(), checkpoint_id=str(tmp_path),
                 storage_writer=DrainWriter(JOB, 1, socket_path=tmp_path / "none.sock"))
    with pytest.raises(RejectedInput, match="not both"):
        DrainWriter(JOB, 1, client=Client(tmp_path / "x.sock"), socket_path=tmp_path / "x.sock")
    with pytest.raises(RejectedInput, match="job name"):
        DrainWriter("../etc", 1)
    with pytest.raises(RejectedInput, match="step"):
        DrainWriter(JOB, -1)


def test_writer_pickles_without_its_sockets_for_a_checkpoint_process(make_daemon: Any) -> None:
    """async_save(..., async_checkpointer_type=PROCESS) pickles the writer into another process."""
    daemon = make_daemon()
    with DrainWriter(JOB, 10, socket_path=daemon.socket_path, thread_count=2) as original:
        copy = pickle.loads(pickle.dumps(original))
    with copy:
        assert (copy.job, copy.step, copy.thread_count) == (JOB, 10, 2)
        with pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING):
            dcp.save(plain_state(), storage_writer=copy)
        copy.wait(COMMIT_TIMEOUT_S)
        with pytest.raises(RejectedInput, match="cannot be copied"):
            pickle.dumps(copy)
    assert (generation_dir(daemon.dest, JOB, 10) / ".metadata").exists()


def test_a_failed_save_retried_under_plan_caching_is_a_new_attempt(make_daemon: Any) -> None:
    # Found attacking: DCP's plan caching gives later saves the first save's plan, and the
    # attempt DrainWriter's coordinator named in it with it. The retry of a failed step came
    # as the failed attempt: GenerationFailed ("failed for this attempt"), save after save.
    daemon = make_daemon(CKPTDRAIN_LIMITS__MAX_STAGED_BYTES="24MiB",
                         CKPTDRAIN_LIMITS__ON_FULL="reject")
    sd = {"w": torch.ones(4 << 20)}  # 16 MiB
    with daemon.client() as client:
        hog = client.generation("hog", 1, rank=0, world_size=2)
        hog.__enter__()
        hog.put("big", b"h" * (16 << 20), deferred=True)  # the room the first save needs
        with DrainWriter(JOB, 10, socket_path=daemon.socket_path) as writer, \
                pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING), \
                pytest.raises(CheckpointException, match="backpressure"):
            dcp.save(sd, storage_writer=writer,
                     planner=DefaultSavePlanner(enable_plan_caching=True))
        hog.abort("room back")
        hog.__exit__(None, None, None)
        failed = writer._attempt
        with DrainWriter(JOB, 10, socket_path=daemon.socket_path) as writer, \
                pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING):
            dcp.save(sd, storage_writer=writer,
                     planner=DefaultSavePlanner(enable_plan_caching=True))
            assert writer._attempt != failed
            assert writer.wait(COMMIT_TIMEOUT_S)["committed"]
        assert client.latest(JOB) == 10
