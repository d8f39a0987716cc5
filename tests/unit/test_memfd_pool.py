"""The client's memfd pool (client/memfd.py) keeps idle memfds within its bounds, in count
and in bytes, closing the oldest first; real memfds."""

from __future__ import annotations

import os

import pytest

from ckptdrain.client.memfd import MemfdPool, fill


def _made(pool: MemfdPool, size: int) -> int:
    fd = pool.acquire()
    fill(fd, memoryview(b"x" * size))
    return fd


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def test_idle_memfds_are_kept_within_the_byte_bound_oldest_closed_first() -> None:
    pool = MemfdPool(max_fds=8, max_idle_bytes=3000)
    try:
        fds = [_made(pool, 1000) for _ in range(5)]
        for fd in fds:
            pool.release(fd, 1000)
        assert pool._fds == fds[2:]
        assert all(_closed(fd) for fd in fds[:2])
        big = _made(pool, 2500)  # reuses the oldest idle one
        assert big == fds[2]
        pool.release(big, 2500)  # 1000 + 1000 + 2500: the two older ones go
        assert pool._fds == [big] and _closed(fds[3]) and _closed(fds[4])
    finally:
        pool.close()


def test_a_pool_of_no_bytes_keeps_no_memfd() -> None:
    pool = MemfdPool(max_idle_bytes=0)
    fd = _made(pool, 10)
    pool.release(fd, 10)
    assert pool._fds == [] and _closed(fd)
    pool.close()


@pytest.mark.parametrize("count", [1, 3])
def test_idle_memfds_are_kept_within_the_count_bound(count: int) -> None:
    pool = MemfdPool(max_fds=count)
    try:
        fds = [_made(pool, 1) for _ in range(count + 2)]
        for fd in fds:
            pool.release(fd, 1)
        assert pool._fds == fds[2:]
    finally:
        pool.close()
