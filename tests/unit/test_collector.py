"""The daemon's collector settings (daemon/collector.py), in a process of their own so the
test process's collector is left as it was."""

from __future__ import annotations

import subprocess
import sys

from ckptdrain.daemon.collector import YOUNG_THRESHOLD

PROBE = """
import gc
from ckptdrain.daemon import collector
before = gc.get_threshold()
collector.tune()
print(gc.get_threshold()[0] == collector.YOUNG_THRESHOLD, gc.get_threshold()[1:] == before[1:])
assert gc.get_freeze_count() == 0
collector.freeze_started()
first = gc.get_freeze_count()
kept = [[] for _ in range(1000)]  # alive after the first freeze
collector.freeze_started()  # a second daemon start in one process freezes nothing more
print(first > 0, gc.get_freeze_count() == first)
"""


def test_the_young_generation_is_larger_and_start_up_is_frozen_once() -> None:
    assert YOUNG_THRESHOLD > 700  # the interpreter's default
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.split() == ["True", "True", "True", "True"], out.stdout + out.stderr
