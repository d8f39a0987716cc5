"""The chaos workload itself: a plan never saves one step twice, or the checker would compare
a shard with another generation's bytes (seed 1018 did, before the fix)."""

from __future__ import annotations

from tests.chaos.matrix import trial_spec


def test_plans_never_repeat_a_step() -> None:
    for seed in range(3000):
        steps = [g.step for g in trial_spec(seed).plan.generations]
        assert steps == sorted(set(steps)), (seed, steps)
