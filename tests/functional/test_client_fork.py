"""A Client used on both sides of a fork (a DataLoader worker inherits the trainer's): each
process talks to the daemon over connections and memfds of its own.

Found attacking from the training side: the child inherited the parent's idle connection, and
the two read each other's replies (98 of 300 `latest` calls on each side answered with the
other job's step; a `wait` for a step never saved returned another call's reply, as if
committed); and both filled the same pooled memfd with `ack = "memory"`, so a committed shard
held the other process's bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest

from ckptdrain.client import Client, RejectedInput, Timeout
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
