"""rank and world_size: taken from torchrun's RANK / WORLD_SIZE when set, required otherwise
(a default world_size of 1 let three ranks that forgot it each commit a one-rank checkpoint).
Checked before any I/O: no daemon is needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptdrain.client import Client, RejectedInput


@pytest.fixture
def client(tmp_path: Path) -> Client:
    return Client(tmp_path / "no-daemon.sock")


def test_required_without_a_launcher(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RejectedInput, match=r"world_size is required.*torchrun.*\$WORLD_SIZE"):
        client.generation("job", 1)
    with pytest.raises(RejectedInput, match=r"rank is required"):
        client.generation("job", 1, world_size=3)
    gen = client.generation("job", 1, rank=2, world_size=3)
    assert (gen.rank, gen.world_size) == (2, 3)


def test_taken_from_torchrun(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    gen = client.generation("job", 1)
    assert (gen.rank, gen.world_size) == (5, 8)
    explicit = client.generation("job", 1, rank=0, world_size=1)  # arguments win
    assert (explicit.rank, explicit.world_size) == (0, 1)
    monkeypatch.setenv("RANK", "8")
    with pytest.raises(RejectedInput, match="out of range"):
        client.generation("job", 1)
    monkeypatch.setenv("WORLD_SIZE", "eight")
    with pytest.raises(RejectedInput, match=r"\$WORLD_SIZE is 'eight'"):
        client.generation("job", 1)
