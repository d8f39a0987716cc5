"""The randomized kill matrix: seeded trials of kill -9, syscall faults and S3 faults.

Each trial's seed picks the destination (every 4th seed: S3 on SeaweedFS, else file://),
the fault, the limits and the workload; a failure prints ``CHAOS_SEED=<n>`` to replay it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.conftest import kill_seeds
from tests.chaos.matrix import S3Target, Trial, dest_of, trial_spec

pytestmark = pytest.mark.timeout(600)

SEEDS = kill_seeds()


@pytest.mark.parametrize("seed", [s for s in SEEDS if dest_of(s) == "file"],
                         ids=lambda s: f"seed={s}")
def test_kill_trial_file(seed: int, tmp_path: Path, sock_dir: Path) -> None:
    trial = Trial(trial_spec(seed), tmp_path, sock_dir).run()
    assert not trial.violations, trial.report()


@pytest.mark.s3
@pytest.mark.parametrize("seed", [s for s in SEEDS if dest_of(s) == "s3"],
                         ids=lambda s: f"seed={s}")
def test_kill_trial_s3(seed: int, tmp_path: Path, sock_dir: Path, chaos_s3: S3Target) -> None:
    trial = Trial(trial_spec(seed), tmp_path, sock_dir, chaos_s3).run()
    assert not trial.violations, trial.report()
