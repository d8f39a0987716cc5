"""DCP data files as DrainWriter writes them: torch.save archives whose storage bytes are
written into the gap ``skip_data`` leaves, straight from the tensor."""

from __future__ import annotations

import io
import os
import zipfile

import pytest
import torch

from ckptdrain.client import dcpfiles, dcpstaging

pytestmark = pytest.mark.torch


def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {
        "float": torch.randn(300, 7, generator=gen),
        "bf16": torch.randn(33, generator=gen).to(torch.bfloat16),
        "transposed": torch.randn(16, 9, generator=gen).t(),  # own storage, not contiguous
        "slice": torch.arange(100, dtype=torch.int64)[10:20],  # a view: saved as its own bytes
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "bool": torch.tensor([True, False, True]),
    }


def test_each_archive_loads_with_torch_load_and_names_no_crc_for_its_data() -> None:
    file = dcpfiles.MemfdFile("__0_0.distcp")
    try:
        spans = {}
        for name, tensor in tensors().items():
            start = file.tell()
            file.write_tensor(dcpfiles.minimal(tensor))
            spans[name] = (start, file.tell() - start)
        raw = os.pread(file.fd, file.tell(), 0)
    finally:
        file.close()
    assert len(raw) == sum(length for _, length in spans.values())
    for name, tensor in tensors().items():
        start, length = spans[name]
        archive = raw[start:start + length]
        loaded = torch.load(io.BytesIO(archive), weights_only=True)
        assert loaded.dtype == tensor.dtype and torch.equal(loaded, tensor), name
        assert loaded.stride() == dcpfiles.minimal(tensor).stride(), name
        with zipfile.ZipFile(io.BytesIO(archive)) as zf:
            data = [i for i in zf.infolist() if i.filename.endswith("/data/0")]
            # As torch writes it with set_crc32_options(False); torch.load does not check it.
            assert [i.CRC for i in data] == [0], name


def test_the_staged_views_are_the_bytes_written_into_the_file() -> None:
    state = {"a": tensors()["float"], "nested": [tensors()["transposed"], "text"]}
    staged_dict, staged = dcpstaging.stage(state, "__0_0.distcp")
    try:
        view = staged_dict["a"]
        assert torch.equal(view, state["a"]) and view.data_ptr() != state["a"].data_ptr()
        assert torch.equal(staged_dict["nested"][0], state["nested"][0])
        assert staged_dict["nested"][1] == "text"
        # The view is the file: what the daemon reads is what DCP planned with.
        record = staged.records[dcpstaging._key(view)]
        archive = os.pread(staged.file.fd, record.length, record.offset)
        assert torch.equal(torch.load(io.BytesIO(archive), weights_only=True), state["a"])
        state["a"].add_(1.0)  # the training loop goes on: the staged copy stays
        assert not torch.equal(view, state["a"])
    finally:
        staged.file.close()
