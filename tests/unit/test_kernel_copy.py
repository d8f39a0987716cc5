"""dataplane.kernel_copy: a client's file into a staged file, by the kernel where it can,
else through a buffer; every chunk lands where it belongs, whichever way it went."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from ckptdrain.daemon import dataplane


def test_a_chunk_the_kernel_refuses_lands_in_place_among_chunks_it_copies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Found attacking the fallback: copy_file_range and sendfile write at the staged file's
    # position, the fallback wrote with pwrite and left it where it was, so the chunk after a
    # refused one overwrote it (a 3 MiB copy came out 2 MiB, silently).
    monkeypatch.setattr(dataplane, "COPY_CHUNK_BYTES", 1 << 20)
    real_copy, real_sendfile = os.copy_file_range, os.sendfile
    chunks = {"n": 0}

    def copy_file_range(src: int, dst: int, count: int, *offsets: int | None) -> int:
        chunks["n"] += 1
        if chunks["n"] == 2:
            raise OSError(errno.EIO, "refused once")
        return real_copy(src, dst, count, *offsets)

    def sendfile(out: int, src: int, offset: int, count: int) -> int:
        if chunks["n"] == 2:
            raise OSError(errno.EIO, "refused once")
        return real_sendfile(out, src, offset, count)

    monkeypatch.setattr(os, "copy_file_range", copy_file_range)
    monkeypatch.setattr(os, "sendfile", sendfile)
    data = os.urandom(3 << 20)
    (tmp_path / "src").write_bytes(data)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        dataplane.kernel_copy(src, dst, len(data))
    finally:
        os.close(src)
        os.close(dst)
    assert chunks["n"] == 3
    assert (tmp_path / "dst").read_bytes() == data
