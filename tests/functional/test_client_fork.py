"""A Client used on both sides of a fork (a DataLoader worker inherits the trainer's): each
process talks to the daemon over connections and memfds of its own.

Found attacking from the training side: the child inherited the parent's idle connection, and
the two read each other's replies (98 of 300 `latest` calls on each side answered with the
other job's step; a `wait` for a step never saved returned another call's reply, as if
committed); and both filled the same pooled memfd with `ack = "memory"`, so a committed shard
held the other process's bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptdrain.client import Client, DrainError, GenerationFailed, RejectedInput, Timeout, forks
from tests.conftest import DaemonProcess


def in_child(work: Callable[[], object]) -> object:
    """Run ``work`` in a forked child; what it returned (JSON), or what it raised, by name."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(r)
            try:
                out: object = {"value": work()}
            except BaseException as exc:  # reported to the parent, which asserts on it
                out = {"raised": type(exc).__name__, "message": str(exc)}
            os.write(w, json.dumps(out).encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return json.loads(b"".join(chunks))


def committed(c: Client, job: str, step: int) -> None:
    with c.generation(job, step, rank=0, world_size=1) as gen:
        gen.put("a.bin", job.encode())
    c.wait(job, step, timeout_s=60)


def test_parent_and_child_each_get_their_own_answers(daemon: DaemonProcess) -> None:
    c = daemon.client()
    committed(c, "job-a", 5)
    committed(c, "job-b", 7)
    assert c.latest("job-a") == 5  # leaves an idle connection in the pool, inherited below
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            answers = [c.latest("job-b") for _ in range(200)]
            try:
                c.wait("job-a", 99, timeout_s=0.05)
                code = 4  # returned: it read a reply meant for another call
            except Timeout:
                code = 0 if answers == [7] * 200 else 2
        except BaseException:
            code = 3
        finally:
            os._exit(code)
    os.close(r)
    answers = [c.latest("job-a") for _ in range(200)]
    os.close(w)
    _, status = os.waitpid(pid, 0)
    assert answers == [5] * 200
    # 0: every answer was job-b's, and the wait for a step never saved timed out.
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_child_never_fills_a_memfd_its_parent_pooled(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACK="memory")
    c = d.client()
    committed(c, "prime", 1)  # leaves a memfd in the client's pool
    pooled = {os.fstat(fd).st_ino for fd in c._memfds._fds}
    assert pooled, "nothing pooled: the test proves nothing"

    def acquire_one() -> int:
        fd = c._memfds.acquire()
        return os.fstat(fd).st_ino

    got = in_child(acquire_one)
    assert isinstance(got, dict) and "value" in got, got
    assert got["value"] not in pooled
    # The parent's pool is as it was, and the child's own saves work.
    assert {os.fstat(fd).st_ino for fd in c._memfds._fds} == pooled
    child = in_child(lambda: committed(c, "child", 1))
    assert child == {"value": None}, child
    data = os.urandom(1 << 20)
    with c.generation("parent", 1, rank=0, world_size=1) as gen:
        gen.put("a.bin", data)
    c.wait("parent", 1, timeout_s=60)
    assert (d.dest / "parent" / f"{1:020d}" / "a.bin").read_bytes() == data
    assert (d.dest / "child" / f"{1:020d}" / "a.bin").read_bytes() == b"child"


def test_a_child_cannot_hand_off_into_its_parents_generation(daemon: DaemonProcess) -> None:
    c = daemon.client()
    with c.generation("shared", 1, rank=0, world_size=1) as gen:
        gen.put("before.bin", b"parent")
        got = in_child(lambda: gen.put("child.bin", b"child"))
        assert isinstance(got, dict) and got.get("raised") == RejectedInput.__name__, got
        assert "forked" in str(got["message"])
        gen.put("after.bin", b"parent again")
    c.wait("shared", 1, timeout_s=60)
    step = daemon.dest / "shared" / f"{1:020d}"
    assert sorted(p.name for p in step.iterdir() if p.suffix == ".bin") == [
        "after.bin", "before.bin"]


@pytest.mark.parametrize("ack", ["local", "memory"])
def test_a_client_made_in_the_child_works_as_any(make_daemon, ack: str) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACK=ack)
    got = in_child(lambda: committed(Client(d.socket_path), "fresh", 1))
    assert got == {"value": None}, got


def test_a_child_forked_while_a_parent_thread_puts_is_refused_not_hung(daemon: DaemonProcess) -> None:
    # Found attacking the fix above: the child waited for good on the generation's lock,
    # held at the fork by a parent thread that does not exist in the child.
    c = daemon.client()
    data = os.urandom(16 << 20)
    stop = threading.Event()
    with c.generation("busy", 1, rank=0, world_size=1) as gen:
        def keep_putting() -> None:
            i = 0
            while not stop.is_set():
                gen.put(f"s{i}", data)
                i += 1

        putter = threading.Thread(target=keep_putting)
        putter.start()
        try:
            time.sleep(0.2)  # the putter holds the generation's lock most of the time

            def child() -> object:
                signal.alarm(10)  # a hang ends the child (exit code != 0), not the test run
                gen.put("child", b"x")
                return "put"

            got = in_child(child)
        finally:
            stop.set()
            putter.join(60)
        assert isinstance(got, dict) and got.get("raised") == RejectedInput.__name__, got
    c.wait("busy", 1, timeout_s=60)


def test_a_killed_trainer_is_aborted_though_its_forked_worker_lives(
        daemon: DaemonProcess, tmp_path: Path) -> None:
    # Found attacking: the worker's copy of the generation's connection kept it open, so the
    # daemon never saw the trainer die; the rank stayed open and its restart was refused.
    aborted_though_its_worker_lives(daemon, tmp_path, "killed", 3, f"""
        import os, signal, sys, time
        from ckptdrain.client import Client
        c = Client({str(daemon.socket_path)!r})
        with c.generation("killed", 3, rank=0, world_size=1) as gen:
            gen.put("a.bin", b"a" * 4096)
            worker = os.fork()
            if worker == 0:  # a DataLoader worker outliving the trainer for a while
                time.sleep(30)
                os._exit(0)
            print(worker, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)


def aborted_though_its_worker_lives(daemon: DaemonProcess, tmp_path: Path, job: str,
                                    step: int, trainer_code: str) -> None:
    """Run ``trainer_code`` (it prints its forked worker's pid, then kills itself) and check
    that the daemon ends its generation while the worker lives."""
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(trainer_code))
    out = tmp_path / "trainer.out"
    with open(out, "wb") as stdout:  # a file: a pipe would be held open by the worker too
        trainer = subprocess.Popen([sys.executable, str(script)], stdout=stdout)
    assert trainer.wait(60) == -signal.SIGKILL
    worker = int(out.read_text().split()[0])
    try:
        with pytest.raises(GenerationFailed):
            daemon.client().wait(job, step, timeout_s=10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.timeout(60)
def test_a_signal_handler_calling_into_a_put_under_way_is_refused(daemon: DaemonProcess) -> None:
    # Found attacking: a handler's abort() re-entered the per-generation lock and wrote its
    # frame into the middle of the put's bytes; the call then hung until the daemon cut the
    # "slow" client off (14-66 s), or longer.
    c = daemon.client()
    data = os.urandom(64 << 20)
    with pytest.raises(DrainError) as caught, \
            c.generation("signalled", 1, rank=0, world_size=1) as gen:
        old = signal.signal(signal.SIGALRM, lambda *_: gen.abort("SIGALRM"))
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.005)
            for i in range(50):  # one of them is under way when the timer fires
                gen.put(f"s{i}", data)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    assert isinstance(caught.value, RejectedInput), caught.value
    with pytest.raises(GenerationFailed):
        c.wait("signalled", 1, timeout_s=30)


def test_a_client_pickles_as_a_new_client_and_a_generation_refuses(daemon: DaemonProcess) -> None:
    # Found attacking: both raised a raw TypeError (a lock cannot be pickled), what a spawned
    # DataLoader worker or a Pool given the client would see.
    c = daemon.client()
    committed(c, "pickled", 1)
    copy = pickle.loads(pickle.dumps(c))
    assert copy is not c and copy.socket_path == c.socket_path
    assert copy.latest("pickled") == 1
    with c.generation("pickled", 2, rank=0, world_size=1) as gen:
        with pytest.raises(RejectedInput, match="cannot be pickled"):
            pickle.dumps(gen)
        gen.put("a.bin", b"still fine")
    c.wait("pickled", 2, timeout_s=60)


def test_a_killed_trainer_is_aborted_though_a_worker_forked_mid_put_lives(
        daemon: DaemonProcess, tmp_path: Path) -> None:
    # Found attacking the fix above: a worker forked while a trainer thread was putting
    # through a pipe kept the pipe's write end, so the daemon waited on the pipe, and the
    # killed trainer's rank stayed open, until the worker exited.
    aborted_though_its_worker_lives(daemon, tmp_path, "piped", 1, f"""
        import os, signal, threading, time
        from ckptdrain.client import Client
        c = Client({str(daemon.socket_path)!r})
        gen = c.generation("piped", 1, rank=0, world_size=1).__enter__()
        data = bytearray(os.urandom(1 << 20)) * 384
        threading.Thread(target=gen.put, args=("big.bin", data), daemon=True).start()
        time.sleep(0.05)  # the put is under way
        worker = os.fork()
        if worker == 0:
            time.sleep(30)
            os._exit(0)
        print(worker, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)


@pytest.mark.timeout(30)
def test_a_save_from_a_signal_handler_while_the_memfd_pool_is_taken_completes(
        make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking: a handler's emergency save (ack=memory) waited for good on the memfd
    # pool's lock, taken by the thread it interrupted. Held here by hand, where a handler
    # would find it held.
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACK="memory")
    c = d.client()
    committed(c, "pooled", 1)
    with c._memfds._lock:
        committed(c, "pooled", 2)
    assert (d.dest / "pooled" / f"{2:020d}" / "a.bin").read_bytes() == b"pooled"


@pytest.mark.timeout(30)
def test_a_save_or_a_fork_from_a_signal_handler_inside_the_fork_lock_completes(
        daemon: DaemonProcess) -> None:
    # Found attacking client/forks.py: a handler that saved (a new connection, a pipe) or
    # forked while its thread was inside forks.creating() waited on itself for good. Held
    # here by hand, where a handler would find it held.
    c = daemon.client()
    with forks.creating():
        committed(c, "inside", 1)
        got = in_child(lambda: c.latest("inside"))
    assert got == {"value": 1}, got
