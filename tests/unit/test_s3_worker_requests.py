"""An upload worker answers every request exactly once and closes every fd it is given, also
a request cancelled before its task ever ran (the daemon waits for that answer: without it a
stopping daemon waited a minute per such request, past its stop budget)."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from ckptdrain.daemon.backends.s3errors import S3Failure
from ckptdrain.daemon.backends.s3messages import (
    failure_from,
    failure_message,
    from_memfd,
    receive_ready,
    send_message,
    to_memfd,
)
from ckptdrain.daemon.backends.s3pool import WorkerSenders
from ckptdrain.daemon.config import DestinationConfig


@pytest.fixture
def spawned() -> Iterator[tuple[socket.socket, dict[str, object]]]:
    """A worker given its configuration, and the start-up figures it sends before serving."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptdrain.daemon.backends.s3worker", str(theirs.fileno()), "0"],
        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
        env={**os.environ, "BOTO_DISABLE_CRT": "true", "AWS_ACCESS_KEY_ID": "k",
             "AWS_SECRET_ACCESS_KEY": "s", "AWS_EC2_METADATA_DISABLED": "true"})
    theirs.close()
    # An endpoint nothing listens on: no request here may reach a server.
    config = DestinationConfig(uri="s3://bucket/prefix", endpoint_url="http://127.0.0.1:9",
                               region="us-east-1", addressing_style="path")
    ours.sendall(json.dumps({"config": config.model_dump(mode="json"),
                             "node_id": "n"}).encode())
    ours.settimeout(60)
    try:
        yield ours, _answer(ours)
    finally:
        ours.close()
        proc.wait(30)


@pytest.fixture
def worker(spawned: tuple[socket.socket, dict[str, object]]) -> socket.socket:
    return spawned[0]


def _answer(sock: socket.socket) -> dict[str, object]:
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 4)
    assert not fds
    answer = json.loads(data)
    assert isinstance(answer, dict)
    return answer


def test_a_worker_reports_what_its_start_cost_before_it_serves(
        spawned: tuple[socket.socket, dict[str, object]]) -> None:
    """The daemon logs these (s3_worker_ready): a worker's imports and botocore's service model
    cost about a CPU second, once per worker start, and must not be read as drain cost."""
    _, first = spawned
    assert set(first) == {"started"}
    figures = first["started"]
    assert isinstance(figures, dict)
    cpu, main_thread = float(figures["cpu_s"]), float(figures["main_thread_cpu_s"])
    # Importing botocore alone is well above a hundredth of a CPU second.
    assert 0.01 < main_thread <= cpu


def test_a_request_cancelled_before_it_ran_is_answered_and_its_fd_closed(
        worker: socket.socket) -> None:
    read_end, write_end = os.pipe()
    part = {"id": 1, "op": "part", "key": "k", "full": "prefix/k", "upload_id": "u",
            "number": 1, "offset": 0, "length": 10, "kept_crc": None, "kept_etag": ""}
    call = {"id": 2, "op": "call", "what": "checking k", "operation": "head_object",
            "params": {"Bucket": "bucket", "Key": "prefix/k"}}
    # Both requests and both cancels queued before the worker reads any: it reads them in
    # one go, so neither request's task has started when its cancel arrives.
    socket.send_fds(worker, [json.dumps(part).encode()], [read_end])
    worker.sendall(json.dumps(call).encode())
    worker.sendall(json.dumps({"cancel": 1}).encode())
    worker.sendall(json.dumps({"cancel": 2}).encode())
    os.close(read_end)
    answers = {int(str(a["id"])): a for a in (_answer(worker), _answer(worker))}
    assert set(answers) == {1, 2}
    for answer in answers.values():
        assert answer["error"] == {"message": "cancelled", "transient": True, "kind": "io"}
    # The worker closed its copy of the pipe's read end: nobody holds it open any more.
    with pytest.raises(OSError) as broken:
        os.write(write_end, b"x")
    assert broken.value.errno == errno.EPIPE
    os.close(write_end)


def test_a_failed_request_is_answered_with_its_error_and_the_worker_serves_on(
        worker: socket.socket) -> None:
    # Each of these fails inside its own request; none may end the worker.
    unknown = {"id": 1, "op": "call", "what": "deleting k", "operation": "delete_bucket",
               "params": {"Bucket": "bucket"}}
    no_fd = {"id": 2, "op": "put", "key": "k", "full": "prefix/k", "size": 1,
             "metadata": {}, "exclusive": False}
    for request in (unknown, no_fd):
        worker.sendall(json.dumps(request).encode())
        answer = _answer(worker)
        assert answer["id"] == request["id"]
        error = answer["error"]
        assert isinstance(error, dict)
        assert str(error["message"]).startswith("ValueError"), error
    # Still serving: a third request is answered too (cancelled here, nothing reaches S3).
    read_end, write_end = os.pipe()
    socket.send_fds(worker, [json.dumps({**no_fd, "id": 3}).encode()], [read_end])
    worker.sendall(json.dumps({"cancel": 3}).encode())
    os.close(read_end)
    os.close(write_end)
    assert _answer(worker)["id"] == 3


def test_a_request_whose_memfd_is_missing_or_wrong_is_refused_and_its_fd_closed(
        worker: socket.socket) -> None:
    """A small request's bytes (an object to write, or the request itself when it is longer
    than a datagram) come in a memfd. Without it, or naming a request workers do not send,
    the request is answered with its error, the fd it came with is closed, and the worker
    serves on."""
    spilled_without_fd = {"id": 1, "op": "call", "spilled": True}
    worker.sendall(json.dumps(spilled_without_fd).encode())
    assert "memfd did not come" in str(_error_of(_answer(worker), 1)["message"])

    spilled = os.memfd_create("request")
    os.write(spilled, json.dumps({"op": "call", "what": "deleting", "operation": "delete_bucket",
                                  "params": {"Bucket": "bucket"}}).encode())
    socket.send_fds(worker, [json.dumps({"id": 2, "op": "call", "spilled": True}).encode()],
                    [spilled])
    os.close(spilled)
    assert "delete_bucket is not sent by workers" in str(_error_of(_answer(worker), 2)["message"])

    # A body that is not a memfd (a pipe: nothing to read), for a request workers do not send.
    read_end, write_end = os.pipe()
    body = {"id": 3, "op": "call", "what": "deleting", "operation": "delete_bucket",
            "params": {"Bucket": "bucket"}, "body": True}
    socket.send_fds(worker, [json.dumps(body).encode()], [read_end])
    os.close(read_end)
    assert "not sent by workers" in str(_error_of(_answer(worker), 3)["message"])
    with pytest.raises(OSError) as broken:
        os.write(write_end, b"x")
    assert broken.value.errno == errno.EPIPE
    os.close(write_end)


def _error_of(answer: dict[str, object], request_id: int) -> dict[str, object]:
    assert answer["id"] == request_id
    error = answer["error"]
    assert isinstance(error, dict)
    return error


def test_a_memfd_longer_than_its_limit_is_not_read() -> None:
    fd = to_memfd(b"x" * 100)
    try:
        assert from_memfd(fd, 100) == b"x" * 100
        with pytest.raises(ValueError, match="more than 99"):
            from_memfd(fd, 99)
    finally:
        os.close(fd)


@pytest.mark.asyncio
async def test_a_malformed_answer_is_a_transient_failure_and_its_fds_stay_the_callers() -> None:
    fd = to_memfd(b"not json")
    try:
        for reply, fds in (({"id": 1}, []), ({"id": 1, "answer_fd": 0}, [fd]),
                           ({"id": 1, "answer": {}, "body_fd": 3}, [fd])):
            with pytest.raises(S3Failure) as failed:
                await WorkerSenders._answer_of(reply, fds, "reading k", 10)
            assert failed.value.transient and "answer was malformed" in str(failed.value)
        os.fstat(fd)  # still open: the caller closes what came with the answer
    finally:
        os.close(fd)


def test_an_answer_travels_unchanged_whatever_its_user_metadata_is_named() -> None:
    """Found attacking the workers: user metadata with the key ``__datetime__`` (any client
    of the bucket can write it) was read back as a date, and a stat of that object failed
    with an untyped AttributeError, or, not being a date, as malformed on every retry."""
    import datetime

    from ckptdrain.daemon.backends.s3senders import from_message, to_message

    when = datetime.datetime(2026, 12, 4, 8, 0, tzinfo=datetime.UTC)
    answer = {
        "LastModified": when,
        "Metadata": {"__datetime__": "2020-01-01T00:00:00"},
        "Other": {"__dict__": {"__datetime__": "x"}},
        "Pages": [{"__datetime__": "not a date"}, {"__dict__": 1}, {"a": when}],
        "ContentLength": 3,
    }
    assert from_message(json.loads(json.dumps(to_message(answer)))) == answer


@pytest.mark.parametrize("head", [{"LastModified": "2026-12-04", "ContentLength": 1},
                                  {"ContentLength": "many"}, {"Metadata": "none"}])
def test_a_malformed_head_answer_is_a_transient_failure(head: dict[str, object]) -> None:
    """Found reviewing 083b29f: a stat read its (worker's) answer outside the answer's
    boundary, so a date that was not one raised an untyped AttributeError."""
    from ckptdrain.daemon.backends.s3client import S3Client

    with pytest.raises(S3Failure) as failed:
        S3Client._info("job/1/a.bin", head)
    assert failed.value.transient and "checking job/1/a.bin" in str(failed.value)


@pytest.mark.asyncio
@pytest.mark.parametrize("filler", ["x", "\U0001f600"], ids=["ascii", "escaped"])
async def test_a_failure_whose_server_message_is_huge_is_answered_cut_to_fit(
        filler: str) -> None:
    # Found attacking the workers: a server's error message of 300 KB made a worker's answer
    # too long for a datagram (EMSGSIZE: dropped, and the request waited 650 s for it while
    # the worker answered every ping); one over 64 KiB was cut by the daemon's read, which
    # replaced the worker at every retry. The message is cut in its middle instead: what
    # failed at its start, what to do at its end.
    advice = "check the credentials and the bucket's policy"
    failure = S3Failure(f"reading k at s3://bucket/prefix: An error occurred (AccessDenied): "
                        f"{filler * 300_000}; {advice}", transient=False, kind="auth",
                        code="AccessDenied", status=403)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    theirs.setblocking(False)
    try:
        await send_message(ours, {"id": 7, "error": failure_message(failure)}, timeout_s=30)
        got = receive_ready(theirs)
    finally:
        ours.close()
        theirs.close()
    assert got is not None
    reply, fds = got
    assert reply["id"] == 7 and not fds
    again = failure_from(reply["error"])
    assert isinstance(again, S3Failure)
    assert (again.kind, again.transient, again.code, again.status) == (
        "auth", False, "AccessDenied", 403)
    assert str(again).startswith("reading k at s3://bucket/prefix: An error occurred")
    assert str(again).endswith(advice) and "characters cut" in str(again)
