"""DrainReader (loads from this node's checked local copy, else the destination) and
DrainWriter's one-copy staging for async_save, against real daemons and torch's own DCP."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from ckptdrain.client import NotFound
from ckptdrain.client.dcp import DrainReader, DrainWriter
from tests.conftest import DaemonProcess, wait_for
from tests.integration.test_dcp import SINGLE_PROCESS_WARNING, compare, generation_dir

pytestmark = pytest.mark.torch

JOB = "reader"


def saved_state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(256, 128, generator=gen),
        "t": torch.randn(64, 32, generator=gen).t(),  # not contiguous: strides survive
        "b": torch.randn(32, generator=gen).to(torch.bfloat16),
        "nested": {"steps": torch.tensor(seed), "note": f"seed {seed}",
                   "list": [torch.ones(3) * seed, seed]},
    }


def blank() -> dict[str, Any]:
    return {"w": torch.zeros(256, 128), "t": torch.zeros(64, 32).t(),
            "b": torch.zeros(32, dtype=torch.bfloat16),
            "nested": {"steps": torch.tensor(0), "note": "", "list": [torch.zeros(3), 0]}}


def save(daemon: DaemonProcess, step: int, seed: int, **kw: Any) -> None:
    with DrainWriter(JOB, step, socket_path=daemon.socket_path, **kw) as writer:
        with pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING):
            dcp.save(saved_state(seed), storage_writer=writer)
        writer.wait(60)


def load(daemon: DaemonProcess, step: int | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    target = blank()
    with DrainReader(JOB, step, socket_path=daemon.socket_path) as reader:
        with pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING):
            dcp.load(target, storage_reader=reader)
        return target, reader.sources


def staged_files(daemon: DaemonProcess) -> list[Path]:
    return sorted((daemon.staging / "shards").glob("*.data"))


def test_loads_the_newest_from_the_local_copy_then_from_the_destination(
        make_daemon: Any) -> None:
    daemon: DaemonProcess = make_daemon()
    with pytest.raises(NotFound, match="no committed generation"):
        DrainReader(JOB, socket_path=daemon.socket_path)
    save(daemon, 4, seed=4)
    save(daemon, 8, seed=8)
    loaded, sources = load(daemon)  # step=None: the newest committed, 8
    assert compare(saved_state(8), loaded) == 7
    assert sources == {".metadata": "local", "__0_0.distcp": "local"}
    loaded, sources = load(daemon, step=4)  # its copy went when 8 committed
    assert compare(saved_state(4), loaded) == 7
    assert set(sources.values()) == {"destination"}
    # A damaged local copy is never handed out: the daemon's check sends the reader away.
    biggest = max(staged_files(daemon), key=lambda p: p.stat().st_size)
    with open(biggest, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    loaded, sources = load(daemon)
    assert compare(saved_state(8), loaded) == 7
    assert sources == {".metadata": "local", "__0_0.distcp": "destination"}
    # The local copy deleted: everything comes from the destination, still bitwise.
    for path in staged_files(daemon):
        path.unlink()
    loaded, sources = load(daemon)
    assert compare(saved_state(8), loaded) == 7
    assert set(sources.values()) == {"destination"}
    path = daemon.client().latest_path(JOB)
    assert path == str(generation_dir(daemon.dest, JOB, 8))


def test_a_reader_refused_a_local_copy_for_its_uids_share_reads_from_the_destination(
        make_daemon: Any) -> None:
    # Found attacking: on a node with per-uid shares, a rank loading while another held its
    # local copies open was refused open_local (backpressure: "read this shard from the
    # destination"), and DrainReader did not: dcp.load failed on every rank.
    # The share holds the data file (149,735 bytes) but not it and .metadata (1,644) at once.
    daemon: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__MAX_RESERVED_BYTES_PER_UID="150600")
    save(daemon, 1, seed=1)
    with daemon.client() as other_rank:
        held = other_rank.open_local(JOB, 1, "__0_0.distcp")  # another rank reading it
        try:
            loaded, sources = load(daemon, step=1)
        finally:
            os.close(held)
    assert compare(saved_state(1), loaded) == 7
    assert sources[".metadata"] == "destination"


@pytest.mark.s3
def test_loads_from_an_s3_destination_through_the_daemon(make_daemon: Any, seaweedfs: Any,
                                                         s3_bucket: str) -> None:
    daemon: DaemonProcess = make_daemon(
        dest=f"s3://{s3_bucket}/ckpt", CKPTDRAIN_DESTINATION__ENDPOINT_URL=seaweedfs.endpoint_url)
    save(daemon, 3, seed=3)
    for path in staged_files(daemon):
        path.unlink()
    loaded, sources = load(daemon)
    assert compare(saved_state(3), loaded) == 7
    assert set(sources.values()) == {"destination"}
    assert daemon.client().latest_path(JOB) == f"s3://{s3_bucket}/ckpt/{JOB}/{3:020d}"


@pytest.mark.parametrize("ack", ["local", "memory"])
def test_async_save_stages_once_into_the_file_the_daemon_gets(make_daemon: Any, tmp_path: Path,
                                                              ack: str) -> None:
    """DrainWriter is async_save's stager: the staged state dict is views of the memfd that
    becomes the data file, every tensor is in it once, and training may change the live
    state as soon as async_save returns."""
    daemon: DaemonProcess = make_daemon()
    live = saved_state(5)
    with DrainWriter(JOB, 5, socket_path=daemon.socket_path, ack=ack) as writer:
        staged = writer.stage(live)
        assert writer._staged is not None
        memfd = os.readlink(f"/proc/self/fd/{writer._staged.file.fd}")
        assert memfd.startswith("/memfd:")
        assert staged["w"].data_ptr() != live["w"].data_ptr() and torch.equal(staged["w"], live["w"])
        assert staged["t"].stride() == live["t"].stride()
        writer.close()
    with DrainWriter(JOB, 5, socket_path=daemon.socket_path, ack=ack) as writer:
        # The single-process warning is raised in async_save's thread: not pytest.warns'.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*" + SINGLE_PROCESS_WARNING)
            future = dcp.async_save(live, storage_writer=writer)
            live["w"].add_(1.0)  # the training loop goes on
            live["nested"]["list"][0].zero_()
            future.result(timeout=60)
        writer.wait(60)
    gen_dir = generation_dir(daemon.dest, JOB, 5)
    target = blank()
    with pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING):
        dcp.load(target, storage_reader=FileSystemReader(gen_dir))
    assert compare(saved_state(5), target) == 7
    reference = tmp_path / "reference"
    with pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING):
        dcp.save(saved_state(5), storage_writer=FileSystemWriter(reference))
    # The same archives as FileSystemWriter's (in the staging order): nothing written twice.
    assert (gen_dir / "__0_0.distcp").stat().st_size == (reference / "__0_0.distcp").stat().st_size


def opened(daemon: DaemonProcess, checked: str) -> list[str]:
    """The files the daemon handed out after checking them that way (its log's events)."""
    return [line for line in daemon.log().splitlines()
            if "event=local_copy_opened" in line and f"checked={checked}" in line]


def test_a_copy_unchanged_since_its_drain_is_handed_out_without_hashing_it_again(
        make_daemon: Any) -> None:
    """The drain's checksum vouches for the staged file while its identity (inode, size,
    mtime, ctime) is the one recorded around that read; a restarted daemon has no record and
    hashes once, then trusts its own hash."""
    daemon: DaemonProcess = make_daemon()
    save(daemon, 2, seed=2)
    loaded, sources = load(daemon)
    assert compare(saved_state(2), loaded) == 7
    assert sources == {".metadata": "local", "__0_0.distcp": "local"}
    assert len(opened(daemon, "recorded")) == 2 and not opened(daemon, "hashed")
    daemon.stop()
    daemon.start()
    for _ in range(2):
        loaded, sources = load(daemon)
        assert compare(saved_state(2), loaded) == 7
        assert sources == {".metadata": "local", "__0_0.distcp": "local"}
    assert len(opened(daemon, "hashed")) == 2 and len(opened(daemon, "recorded")) == 2


def test_a_copy_changed_after_its_drain_is_caught_even_with_its_mtime_put_back(
        make_daemon: Any) -> None:
    daemon: DaemonProcess = make_daemon()
    save(daemon, 3, seed=3)
    biggest = max(staged_files(daemon), key=lambda p: p.stat().st_size)
    before = biggest.stat()
    with open(biggest, "r+b") as f:
        f.seek(before.st_size // 2)
        byte = f.read(1)
        f.seek(before.st_size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(biggest, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = biggest.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns)
    loaded, sources = load(daemon)
    assert compare(saved_state(3), loaded) == 7
    assert sources == {".metadata": "local", "__0_0.distcp": "destination"}
    assert any("event=local_copy_damaged" in line and "checked=hashed" in line
               for line in daemon.log().splitlines())
    # Dropped: the next reader goes to the destination at once; the file itself is unlinked
    # by a batched data-plane job after the reply, so its removal is awaited with a deadline.
    damaged = sum("event=local_copy_damaged" in line for line in daemon.log().splitlines())
    loaded, sources = load(daemon)
    assert compare(saved_state(3), loaded) == 7
    assert sources == {".metadata": "local", "__0_0.distcp": "destination"}
    assert sum("event=local_copy_damaged" in line
               for line in daemon.log().splitlines()) == damaged
    wait_for(lambda: not biggest.exists(), timeout_s=20)


def test_targets_of_other_dtypes_and_layouts_load_as_with_file_system_reader(
        make_daemon: Any) -> None:
    """Bytes go straight into a contiguous CPU target of the saved dtype; anything else (a
    float64 target for float32 bytes, a transposed target) is one copy_ from a mapping,
    converting as FileSystemReader's copy_ does."""
    daemon: DaemonProcess = make_daemon()
    save(daemon, 6, seed=6)

    def odd_target() -> dict[str, Any]:
        return {"w": torch.zeros(256, 128, dtype=torch.float64),
                "t": torch.zeros(64, 32).t().contiguous(),  # contiguous: the saved one is not
                "b": torch.zeros(32, dtype=torch.float32),
                "nested": {"steps": torch.tensor(0), "note": "",
                           "list": [torch.zeros(6)[::2], 0]}}  # a strided view of a bigger one

    ours = odd_target()
    with DrainReader(JOB, socket_path=daemon.socket_path) as reader:
        with pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING):
            dcp.load(ours, storage_reader=reader)
        assert set(reader.sources.values()) == {"local"}
    stock = odd_target()
    with pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING):
        dcp.load(stock, storage_reader=FileSystemReader(generation_dir(daemon.dest, JOB, 6)))
    assert compare(stock, ours) == 7
    assert ours["w"].dtype == torch.float64
    assert torch.equal(ours["w"], saved_state(6)["w"].double())
    assert torch.equal(ours["t"], saved_state(6)["t"])


def test_a_damaged_destination_file_is_never_loaded(make_daemon: Any) -> None:
    # Found attacking the read side: with no local copy, DrainReader opened a file:// shard
    # straight from the destination: bytes changed there loaded without a word, and a FIFO
    # planted in the shard's place hung the load for good.
    daemon: DaemonProcess = make_daemon(CKPTDRAIN_RETENTION__KEEP_LOCAL_COPY="false")
    save(daemon, 3, seed=3)
    shard = generation_dir(daemon.dest, JOB, 3) / "__0_0.distcp"
    good = shard.read_bytes()
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0xFF
    shard.write_bytes(bytes(flipped))
    # DCP wraps a rank's error; the daemon's refusal is inside.
    with pytest.raises(CheckpointException, match="does not match its manifest"):
        load(daemon)
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(CheckpointException, match="not a regular file"):
        load(daemon)
    shard.unlink()
    shard.write_bytes(good + b"longer")  # told by its size, before a byte is read
    with pytest.raises(CheckpointException, match="bytes where the manifest lists"):
        load(daemon)
    shard.write_bytes(good)
    loaded, sources = load(daemon)
    assert compare(saved_state(3), loaded) == 7
    assert set(sources.values()) == {"destination"}


def bit_views() -> dict[str, Any]:
    """Tensors whose stored bytes are not their values: a conjugate view (``w.mH``, the
    adjoint of a complex weight) and a negative view (what ``x.conj().imag`` is)."""
    w = torch.tensor([[1 + 2j, 3 - 4j], [5 + 6j, -7 - 8j]], dtype=torch.complex64)
    return {"adjoint": w.mH, "conj": w[0].conj(), "neg": w.conj().imag}


def bit_targets() -> dict[str, Any]:
    return {"adjoint": torch.zeros(2, 2, dtype=torch.complex64),
            "conj": torch.zeros(2, dtype=torch.complex64), "neg": torch.zeros(2, 2)}


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_conjugate_and_negative_views_load_as_their_values(make_daemon: Any, how: str) -> None:
    # Found attacking DCP: DrainReader copied the stored bytes without the view's bit, so the
    # adjoint of a weight loaded as the weight itself (and a negative view with its sign
    # flipped), silently; torch's FileSystemReader loaded the same files right.
    daemon: DaemonProcess = make_daemon()
    expected = {k: v.resolve_conj().resolve_neg() for k, v in bit_views().items()}
    assert bit_views()["adjoint"].is_conj() and bit_views()["neg"].is_neg()
    with DrainWriter(JOB, 7, socket_path=daemon.socket_path) as writer:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*" + SINGLE_PROCESS_WARNING)
            if how == "save":
                dcp.save(bit_views(), storage_writer=writer)
            else:
                staged = writer.stage(bit_views())  # async_save's stager: views of the memfd
                assert all(torch.equal(staged[k], expected[k]) for k in expected)
                writer.close()
                with DrainWriter(JOB, 7, socket_path=daemon.socket_path) as again:
                    dcp.async_save(bit_views(), storage_writer=again).result(timeout=60)
                    again.wait(60)
        if how == "save":
            writer.wait(60)
    stock = bit_targets()
    with pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING):
        dcp.load(stock, storage_reader=FileSystemReader(generation_dir(daemon.dest, JOB, 7)))
    for source in ("local", "destination"):
        if source == "destination":  # no local copy: read through the daemon from the files
            for f in staged_files(daemon):
                f.unlink()
        ours = bit_targets()
        with DrainReader(JOB, socket_path=daemon.socket_path) as reader:
            with pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING):
                dcp.load(ours, storage_reader=reader)
            assert set(reader.sources.values()) == {source}
        for key, value in expected.items():
            assert torch.equal(stock[key], value), key
            assert torch.equal(ours[key], value), (source, key)


def test_a_step_that_is_not_committed_is_refused_when_the_reader_is_made(
        make_daemon: Any) -> None:
    # Found attacking DCP: DrainReader(job, step) for a step still draining (or failed, or
    # never saved) was accepted, and dcp.load then failed as torch's "metadata is None" under
    # two chained tracebacks. It is refused as the newest-step form is: NotFound, at once.
    daemon: DaemonProcess = make_daemon()
    save(daemon, 4, seed=4)
    for step in (5, 400):
        with pytest.raises(NotFound, match="not committed"):
            DrainReader(JOB, step, socket_path=daemon.socket_path)
    loaded, sources = load(daemon, step=4)  # the .metadata opened to check it is what loads
    assert compare(saved_state(4), loaded) == 7
    assert sources == {".metadata": "local", "__0_0.distcp": "local"}
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(5):  # made and closed unused: the fd opened ahead is closed with it
        DrainReader(JOB, 4, socket_path=daemon.socket_path).close()
    assert len(os.listdir("/proc/self/fd")) == fds


def test_a_checkpoint_not_saved_through_dcp_is_refused_when_the_reader_is_made(
        make_daemon: Any) -> None:
    # Found as a job author: a step saved with Client.put, loaded with DrainReader(job), failed
    # inside dcp.load as torch's CheckpointException ("metadata is None; ... has no shard
    # '.metadata'") under chained tracebacks. It is NotFound when the reader is made, saying
    # what the step is, for the newest step and a named one alike.
    daemon: DaemonProcess = make_daemon()
    client = daemon.client()
    with client.generation(JOB, 9, rank=0, world_size=1) as gen:
        gen.put("model.pt", b"not dcp")
    client.wait(JOB, 9, timeout_s=60)
    fds = len(os.listdir("/proc/self/fd"))
    for step in (None, 9):
        with pytest.raises(NotFound, match="not saved through DCP") as refused:
            DrainReader(JOB, step, socket_path=daemon.socket_path)
        assert "step 9 of job 'reader' has no '.metadata'" in str(refused.value)
    assert len(os.listdir("/proc/self/fd")) == fds
    with pytest.raises(NotFound, match="not committed"):  # as before
        DrainReader(JOB, 10, socket_path=daemon.socket_path)


def test_plain_tensors_load_into_conjugate_and_negative_targets(make_daemon: Any) -> None:
    # Found attacking the fix above: with a plain tensor saved and a conjugate (or negative)
    # view as the target, the bytes went straight into the target's storage, which reads
    # them through its bit: the conjugate was loaded, silently.
    daemon: DaemonProcess = make_daemon()
    z = torch.tensor([[1 + 2j, 3 - 4j]], dtype=torch.complex64)
    r = torch.tensor([1.0, -2.0, 3.0])
    with DrainWriter(JOB, 9, socket_path=daemon.socket_path) as writer:
        with pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING):
            dcp.save({"z": z, "r": r}, storage_writer=writer)
        writer.wait(60)
    target = {"z": torch.zeros(1, 2, dtype=torch.complex64).conj(),
              "r": torch._neg_view(torch.zeros(3))}
    with (DrainReader(JOB, socket_path=daemon.socket_path) as reader,
          pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING)):
        dcp.load(target, storage_reader=reader)
    assert torch.equal(target["z"].resolve_conj(), z)
    assert torch.equal(target["r"].resolve_neg(), r)


def test_a_reader_dropped_unclosed_and_unloaded_leaks_no_fd(make_daemon: Any) -> None:
    # Found attacking: the .metadata a reader opens to check its step was closed only by
    # close() or a load; a reader made and dropped leaked it.
    import gc

    daemon: DaemonProcess = make_daemon()
    save(daemon, 4, seed=4)
    client = daemon.client()
    DrainReader(JOB, 4, client=client).close()  # the client's pooled connection, opened once
    # Earlier tests' garbage first: an fd it closed meanwhile read as one fewer after (seen
    # when the suite ran in two workers, each running a different order of tests).
    gc.collect()
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        DrainReader(JOB, 4, client=client)
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == fds


def quantized() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(11)
    return {"q": torch.quantize_per_tensor(torch.randn(64, generator=gen), 0.1, 10, torch.quint8),
            "qc": torch.quantize_per_channel(torch.randn(4, 8, generator=gen),
                                             torch.tensor([0.1, 0.2, 0.3, 0.4]),
                                             torch.tensor([0, 1, 2, 3]), 0, torch.qint8),
            "w": torch.randn(16, generator=gen)}


def quantized_targets() -> dict[str, Any]:
    return {"q": torch.quantize_per_tensor(torch.zeros(64), 0.1, 10, torch.quint8),
            "qc": torch.quantize_per_channel(torch.zeros(4, 8), torch.tensor([0.1, 0.2, 0.3, 0.4]),
                                             torch.tensor([0, 1, 2, 3]), 0, torch.qint8),
            "w": torch.zeros(16)}


# torch 2.13 deprecates making quantized tensors, and its torch.save of one reads the
# deprecated TypedStorage: torch's own warnings, raised by FileSystemWriter's save as well.
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")
@pytest.mark.parametrize("how", ["save", "async_save"])
def test_quantized_tensors_save_and_load_as_with_file_system_writer(make_daemon: Any,
                                                                   how: str) -> None:
    # Found attacking DCP: FileSystemWriter saved a quantized tensor; DrainWriter's archive,
    # written under torch's skip_data, raised torch's own RuntimeError ("Cannot serialize
    # qtensor under skip_data ... file an issue"), so a quantized model could not be saved.
    daemon: DaemonProcess = make_daemon()
    with DrainWriter(JOB, 8, socket_path=daemon.socket_path) as writer:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*" + SINGLE_PROCESS_WARNING)
            if how == "save":
                dcp.save(quantized(), storage_writer=writer)
            else:
                dcp.async_save(quantized(), storage_writer=writer).result(timeout=60)
        writer.wait(60)
    expected = quantized()
    stock = quantized_targets()
    with pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING):
        dcp.load(stock, storage_reader=FileSystemReader(generation_dir(daemon.dest, JOB, 8)))
    ours = quantized_targets()
    with DrainReader(JOB, socket_path=daemon.socket_path) as reader, \
            pytest.warns(UserWarning, match=SINGLE_PROCESS_WARNING):
        dcp.load(ours, storage_reader=reader)
    for key, value in expected.items():
        assert torch.equal(stock[key], value), key
        assert torch.equal(ours[key], value), key


READER_OUT_OF_FDS = textwrap.dedent("""
    import os, resource, sys, warnings
    import torch.distributed.checkpoint as dcp
    from ckptdrain.client import Client, DrainError
    from ckptdrain.client.dcp import DrainReader
    from tests.fdtable import fd_table_full
    from tests.integration.test_dcp import compare
    from tests.integration.test_dcp_reader import JOB, blank, saved_state
    warnings.simplefilter("ignore")
    open_now = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 64, open_now + 64))
    client = Client(sys.argv[1])
    client.latest(JOB)  # an idle connection the reader's first request reuses
    for free, shared in ((0, False), (1, False), (0, True), (1, True)):
        try:
            kw = {"client": client} if shared else {"socket_path": sys.argv[1]}
            with fd_table_full(free), DrainReader(JOB, 1, **kw) as reader:
                dcp.load(blank(), storage_reader=reader)
            print(free, "loaded", flush=True)
        except DrainError as exc:
            print(free, type(exc).__name__, "versions match" in str(exc), flush=True)
        except BaseException as exc:
            print(free, "untyped", type(exc).__name__, exc, flush=True)
    target = blank()
    with DrainReader(JOB, 1, socket_path=sys.argv[1]) as reader:  # fds back: it loads
        dcp.load(target, storage_reader=reader)
    print("compared", compare(saved_state(1), target), sorted(set(reader.sources.values())),
          flush=True)
""")


def test_a_reader_out_of_descriptors_gets_a_typed_error(make_daemon: Any) -> None:
    # Found attacking a resume at a low RLIMIT_NOFILE: with the process's fd table full, the
    # fallback to the destination raised the bare OSError of memfd_create (outside DrainError,
    # the root of every error the client raises), and with one fd free, which the connection
    # took, the local copy's fd the kernel dropped (MSG_CTRUNC) read as "the daemon answered
    # 'open' with 0 file descriptors ... check that client and daemon versions match".
    d: DaemonProcess = make_daemon()
    save(d, 1, seed=1)
    out = subprocess.run([sys.executable, "-c", READER_OUT_OF_FDS, str(d.socket_path)],
                         capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parents[2])
    assert out.stdout.split("\n")[:5] == [
        "0 DaemonUnavailable False", "1 DaemonUnavailable False",
        "0 DaemonUnavailable False", "1 DaemonUnavailable False",
        "compared 7 ['local']"], out.stdout + out.stderr


WRITER_OUT_OF_FDS = textwrap.dedent("""
    import resource, sys, warnings
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from ckptdrain.client import Client, DrainError
    from ckptdrain.client.dcp import DrainWriter
    from tests.fdtable import fd_table_full
    from tests.integration.test_dcp_reader import JOB, saved_state
    warnings.simplefilter("ignore")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    client = Client(sys.argv[1])
    for step, free in ((1, 0), (2, 1)):
        client.status()  # an idle connection the save's first request reuses
        try:
            with DrainWriter(JOB, step, client=client) as writer, fd_table_full(free):
                dcp.save(saved_state(step), storage_writer=writer)
            print(step, "saved", flush=True)
        except BaseException as exc:
            # DCP reports a rank's failure inside a CheckpointException: (error, traceback).
            inner = ([e for e, _ in exc.failures.values()]
                     if isinstance(exc, CheckpointException) else [exc])
            print(step, *(type(e).__name__ if isinstance(e, DrainError) else
                          f"untyped {type(e).__name__}: {e}" for e in inner), flush=True)
    with DrainWriter(JOB, 3, client=client) as writer:  # fds back: it saves
        dcp.save(saved_state(3), storage_writer=writer)
    print("committed", writer.wait(60)["committed"], flush=True)
""")


def test_a_writer_out_of_descriptors_gets_a_typed_error(make_daemon: Any) -> None:
    # Found attacking a save at a low RLIMIT_NOFILE: with the rank's fd table full, the memfd
    # each data file is serialized into could not be made, and the bare OSError reached the
    # caller inside DCP's CheckpointException, outside DrainError.
    d: DaemonProcess = make_daemon()
    out = subprocess.run([sys.executable, "-c", WRITER_OUT_OF_FDS, str(d.socket_path)],
                         capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parents[2])
    assert out.stdout.split("\n")[:3] == [
        "1 DaemonUnavailable", "2 DaemonUnavailable", "committed True"], out.stdout + out.stderr
    assert not generation_dir(d.dest, JOB, 1).exists()
    assert not generation_dir(d.dest, JOB, 2).exists()
