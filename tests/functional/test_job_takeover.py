"""A second uid cannot take over a job the node no longer tracks.

Found attacking the daemon as a second user: with the default ``limits.max_jobs`` (1000), a
user who began and aborted 1000 jobs of their own (2-4 s) made the node forget another user's
idle committed job, and its owner with it. The second user could then read the job's newest
step and its shards through the daemon (``latest``, ``fetch`` from the destination, read with
the daemon's rights), commit steps above the owner's (``LATEST`` moved to theirs), and their
retention deleted the owner's committed generations. The same held on any node that never ran
the job (a fresh node, another node of the cluster).

Now the owner is also read from the destination (the part records of the job's newest commit
name it): a job the node does not track is refused to another uid at ``begin``, ``latest`` and
``fetch``; every commit checks it again; and making room under ``limits.max_jobs`` forgets the
asking user's own idle jobs first.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptdrain.client import Client, GenerationFailed, PermissionDenied
from tests.conftest import DaemonProcess

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="dropping to another uid needs root (CI runs as root)")
VICTIM = 65533
HOSTILE = 65534
ACCESS = {"CKPTDRAIN_ACCESS__SOCKET_MODE": "0666",
          "CKPTDRAIN_ACCESS__ALLOWED_UIDS": f"[{VICTIM}, {HOSTILE}]"}


def start_as(uid: int, fn: Callable[[], str]) -> tuple[int, int]:
    """``fn()`` in a forked child running as ``uid`` (the kernel reports that uid to the
    daemon); returns (pid, fd to read its answer from) at once."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            try:
                out = fn()
            except PermissionDenied as exc:
                out = f"DENIED {exc}"
            except GenerationFailed as exc:
                out = f"FAILED {exc}"
            except BaseException:
                out = "ERROR " + traceback.format_exc()
            os.write(w, out.encode())
        finally:
            os._exit(0)
    os.close(w)
    return pid, r


def answer(child: tuple[int, int]) -> str:
    pid, r = child
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


def run_as(uid: int, fn: Callable[[], str]) -> str:
    return answer(start_as(uid, fn))


def save(d: DaemonProcess, job: str, step: int, data: bytes) -> str:
    with Client(d.socket_path, timeout_s=20) as c:
        with c.generation(job, step, rank=0, world_size=1) as gen:
            gen.put("w.bin", data)
        c.wait(job, step, timeout_s=30)
    return "SAVED"


def latest(d: DaemonProcess, job: str) -> str:
    return f"LATEST {Client(d.socket_path, timeout_s=20).latest(job)}"


def fetch(d: DaemonProcess, job: str, step: int, into: Path) -> str:
    fd = os.open(into, os.O_WRONLY | os.O_TRUNC)
    try:
        Client(d.socket_path, timeout_s=20).fetch_from_destination(job, step, "w.bin", fd)
    finally:
        os.close(fd)
    return "FETCHED"


def begin_and_abort(d: DaemonProcess, jobs: list[str]) -> str:
    with Client(d.socket_path, timeout_s=20) as c:
        for job in jobs:
            with c.generation(job, 1, rank=0, world_size=1) as gen:
                gen.abort("evicting")
    return "ABORTED"


def open_to_all(*daemons: DaemonProcess) -> None:
    for d in daemons:
        os.chmod(d.socket_path.parent, 0o755)


def writable_by_all(d: DaemonProcess) -> Path:
    """An empty file the other users may write, for a fetch to fill."""
    into = d.socket_path.parent / "stolen.bin"
    into.touch()
    os.chmod(into, 0o666)
    return into


def test_a_user_filling_max_jobs_forgets_their_own_jobs_not_another_users(
        make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__MAX_JOBS="4", **ACCESS)
    open_to_all(d)
    assert run_as(VICTIM, lambda: save(d, "llama", 1, b"victim-data")) == "SAVED"
    # Twice the cap of the hostile's own jobs, begun and aborted.
    out = run_as(HOSTILE, lambda: begin_and_abort(d, [f"h{i}" for i in range(8)]))
    assert out == "ABORTED", out
    owners = {g["job"]: g.get("uid") for g in d.client().status()["generations"]}
    assert owners.get("llama") == VICTIM, owners  # still tracked, with its owner
    into = writable_by_all(d)
    for attempt in (lambda: latest(d, "llama"), lambda: fetch(d, "llama", 1, into),
                    lambda: save(d, "llama", 2, b"poison")):
        out = run_as(HOSTILE, attempt)
        assert out.startswith("DENIED") and "belongs to another user" in out, out
    assert into.read_bytes() == b""
    assert Client(d.socket_path).latest("llama") == 1


def test_a_node_that_never_ran_a_job_refuses_it_to_another_user(
        make_daemon) -> None:  # type: ignore[no-untyped-def]
    node_a: DaemonProcess = make_daemon("node-a", **ACCESS)
    open_to_all(node_a)
    assert run_as(VICTIM, lambda: save(node_a, "llama", 1, b"victim-data")) == "SAVED"
    # Another node, on the same destination: it never knew the job or its owner (so also a
    # node that forgot it after forget_after_s, or lost its journal).
    node_b: DaemonProcess = make_daemon("node-b", **ACCESS)
    open_to_all(node_a, node_b)
    into = writable_by_all(node_b)
    for attempt in (lambda: latest(node_b, "llama"), lambda: fetch(node_b, "llama", 1, into),
                    lambda: save(node_b, "llama", 2, b"poison")):
        out = run_as(HOSTILE, attempt)
        assert out.startswith("DENIED") and "belongs to another user" in out, out
        assert "65533" not in out  # the other user is not named
    assert into.read_bytes() == b""
    # The owner itself, and root, are served there.
    assert run_as(VICTIM, lambda: latest(node_b, "llama")) == "LATEST 1"
    assert run_as(VICTIM, lambda: save(node_b, "llama", 2, b"victim-2")) == "SAVED"
    assert node_b.client().latest("llama") == 2


def test_a_commit_is_refused_when_the_job_has_become_another_users(
        make_daemon) -> None:  # type: ignore[no-untyped-def]
    # The begin's check found no owner (the job had no commit yet; a destination that did
    # not answer at the begin goes the same way): the commit checks again.
    node_a: DaemonProcess = make_daemon("node-a", **ACCESS)
    node_b: DaemonProcess = make_daemon("node-b", **ACCESS)
    open_to_all(node_a, node_b)
    go = node_b.socket_path.parent / "go"  # the hostile child only looks for it

    def hostile() -> str:
        with Client(node_b.socket_path, timeout_s=20) as c:
            with c.generation("llama", 9, rank=0, world_size=1) as gen:
                gen.put("w.bin", b"poison")
                deadline = time.monotonic() + 60
                while not go.exists():  # sealed only once the owner has committed
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
            c.wait("llama", 9, timeout_s=30)
        return "COMMITTED"

    child = start_as(HOSTILE, hostile)
    deadline = time.monotonic() + 30
    while not any(g["job"] == "llama" for g in node_b.client().status()["generations"]):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert run_as(VICTIM, lambda: save(node_a, "llama", 1, b"victim-data")) == "SAVED"
    go.touch()
    out = answer(child)
    assert out.startswith("FAILED") and "belongs to uid 65533" in out, out
    assert node_a.client().latest("llama") == 1
    assert not (node_a.dest / "llama" / f"{9:020d}" / "MANIFEST.json").exists()


def test_a_damaged_newest_manifest_does_not_stop_the_jobs_commits(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # The owner lookup reads the newest commit's manifest: a damaged one is skipped, as
    # catalog.latest skips it, instead of failing every later commit of the job.
    node_a: DaemonProcess = make_daemon("node-a", **ACCESS)
    node_b: DaemonProcess = make_daemon("node-b", **ACCESS)
    open_to_all(node_a, node_b)
    assert run_as(VICTIM, lambda: save(node_a, "llama", 1, b"victim-data")) == "SAVED"
    (node_a.dest / "llama" / f"{1:020d}" / "MANIFEST.json").write_bytes(b"{not json")
    assert run_as(VICTIM, lambda: save(node_b, "llama", 2, b"victim-2")) == "SAVED"
    assert node_b.client().latest("llama") == 2


def wait_for_step(d: DaemonProcess, job: str, step: int) -> str:
    return f"WAITED {Client(d.socket_path, timeout_s=20).wait(job, step, timeout_s=5)}"


def test_a_begin_the_destination_could_not_check_grants_nothing(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking the fix: when the owner lookup failed at the begin (the begin goes on,
    # so a save survives a destination blip), the node recorded the second uid as the job's
    # owner and then served it the owner's newest step and shards, and refused the owner.
    node_a: DaemonProcess = make_daemon("node-a", **ACCESS)
    node_b: DaemonProcess = make_daemon("node-b", **ACCESS)
    open_to_all(node_a, node_b)
    assert run_as(VICTIM, lambda: save(node_a, "llama", 1, b"victim-data")) == "SAVED"
    record = node_a.dest / "llama" / f"{1:020d}" / "_parts" / "node-a.json"
    kept = record.read_bytes()
    with open(record, "r+b") as f:  # sparse, over the limit of a read: node b cannot tell
        f.truncate(65 << 20)       # the owner now

    def squat() -> str:
        with Client(node_b.socket_path, timeout_s=20) as c, \
                c.generation("llama", 7, rank=0, world_size=1) as gen:
            gen.put("w.bin", b"poison")
        return "BEGUN"

    assert run_as(HOSTILE, squat) == "BEGUN"
    assert "event=owner_check_failed" in node_b.log()
    record.write_bytes(kept)
    into = writable_by_all(node_b)
    for attempt in (lambda: latest(node_b, "llama"), lambda: fetch(node_b, "llama", 1, into),
                    lambda: wait_for_step(node_b, "llama", 1)):
        out = run_as(HOSTILE, attempt)
        assert out.startswith("DENIED") and "belongs to another user" in out, out
    assert into.read_bytes() == b""
    # The owner is served on node b again, and the squatter's step never commits.
    assert run_as(VICTIM, lambda: latest(node_b, "llama")) == "LATEST 1"
    assert run_as(VICTIM, lambda: save(node_b, "llama", 2, b"victim-2")) == "SAVED"
    assert node_a.client().latest("llama") == 2
    assert not (node_a.dest / "llama" / f"{7:020d}" / "MANIFEST.json").exists()


def test_wait_tells_another_user_nothing_of_a_job_the_node_does_not_track(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking the fix: `latest` was refused, but `wait` on each step answered
    # whether it was committed.
    node_a: DaemonProcess = make_daemon("node-a", **ACCESS)
    node_b: DaemonProcess = make_daemon("node-b", **ACCESS)
    open_to_all(node_a, node_b)
    assert run_as(VICTIM, lambda: save(node_a, "llama", 1, b"victim-data")) == "SAVED"
    out = run_as(HOSTILE, lambda: wait_for_step(node_b, "llama", 1))
    assert out.startswith("DENIED") and "belongs to another user" in out, out
    assert run_as(VICTIM, lambda: wait_for_step(node_b, "llama", 1)).startswith("WAITED")


def test_nothing_is_written_into_another_users_job(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking the fix: a second uid whose begin went on unverified wrote into the
    # owner's job at the destination: an aborted rank's failure record (its world_size
    # then failed the owner's commit of that step) and, sealed, its shards.
    node_a: DaemonProcess = make_daemon("node-a", **ACCESS)
    node_b: DaemonProcess = make_daemon("node-b", **ACCESS)
    open_to_all(node_a, node_b)
    assert run_as(VICTIM, lambda: save(node_a, "llama", 1, b"victim-data")) == "SAVED"
    record = node_a.dest / "llama" / f"{1:020d}" / "_parts" / "node-a.json"
    kept = record.read_bytes()
    with open(record, "r+b") as f:  # node b cannot tell the owner while this lasts
        f.truncate(65 << 20)
    go = node_b.socket_path.parent / "go"

    def squat() -> str:
        with Client(node_b.socket_path, timeout_s=20) as c:
            aborting = c.generation("llama", 3, rank=1, world_size=2)
            sealing = c.generation("llama", 4, rank=0, world_size=1)
            with aborting as gen3, sealing as gen4:  # both begun unverified
                deadline = time.monotonic() + 60
                while not go.exists():
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
                gen4.put("w.bin", b"poison")
                gen3.abort("gone")
        return "DONE"

    child = start_as(HOSTILE, squat)
    deadline = time.monotonic() + 30
    while {g["step"] for g in node_b.client().status()["generations"]} != {3, 4}:
        assert time.monotonic() < deadline, node_b.log()[-2000:]
        time.sleep(0.02)
    assert "event=owner_check_failed" in node_b.log()
    record.write_bytes(kept)  # the destination answers again
    go.touch()
    out = answer(child)  # step 4 ended before its seal: its shard was the first write
    assert out.startswith("FAILED") and "belongs to uid 65533" in out, out
    for step, why in ((3, "the client aborted"), (4, "belongs to uid 65533")):
        with pytest.raises(GenerationFailed, match=why):
            node_b.client().wait("llama", step, timeout_s=30)
    # Nothing of the squatter's reached the owner's job, and the owner saves both steps.
    for step in (3, 4):
        assert not (node_a.dest / "llama" / f"{step:020d}").exists()
        assert run_as(VICTIM, lambda step=step: save(node_a, "llama", step, b"mine")) == "SAVED"
