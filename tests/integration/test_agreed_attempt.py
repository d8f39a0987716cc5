"""``agreed_attempt()``: one attempt for every rank of a run, whatever each node counted.

torchrun's restart count is each node's own: after a restart the ranks of one run may see
different ``TORCHELASTIC_RESTART_COUNT``s, and a step they save through the client on several
nodes would then never commit (each node waits for the others' part records of its attempt).
Two real gloo ranks here are given different counts, as two nodes' agents would."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.integration.test_promtool import free_port

pytestmark = pytest.mark.torch

RANK = r"""
import sys
import torch.distributed as dist
from ckptdrain.client.dcp import agreed_attempt
from ckptdrain.client.generation import default_attempt
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}",
                        rank=int(sys.argv[2]), world_size=2)
print(default_attempt(), agreed_attempt(), flush=True)
dist.destroy_process_group()
"""


def test_every_rank_takes_rank_0s_attempt() -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTDRAIN_", "SLURM_"))}
    env.pop("PMIX_NAMESPACE", None)
    ranks = []
    for rank in (0, 1):
        ranks.append(subprocess.Popen(
            [sys.executable, "-c", RANK, str(port), str(rank)], stdout=subprocess.PIPE,
            text=True, env=env | {"TORCHELASTIC_RUN_ID": "job7",
                                  "TORCHELASTIC_RESTART_COUNT": str(rank)}))
    try:
        said = [p.communicate(timeout=120)[0].split() for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in ranks] == [0, 0]
    assert [own for own, _ in said] == ["torchelastic:job7:0", "torchelastic:job7:1"]
    assert [agreed for _, agreed in said] == ["torchelastic:job7:0"] * 2


def test_without_a_process_group_it_is_the_default_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptdrain.client.dcp import agreed_attempt
    from ckptdrain.client.generation import default_attempt

    monkeypatch.setenv("CKPTDRAIN_ATTEMPT", "mine")
    assert agreed_attempt() == default_attempt() == "mine"
