"""The benchmark harness (`make bench`) still runs: its cheapest benchmark in --quick mode.

This checks the harness, not the figures (quick sizes measure nothing): it must start a real
daemon, measure ours and the baseline, and write a report with a ratio in it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _bench(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTDRAIN_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(
        [sys.executable, "-m", "tests.bench", *args, "--workdir", str(tmp_path / "work")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False)


def test_quick_handoff_benchmark_reports_a_ratio(tmp_path: Path) -> None:
    out = tmp_path / "bench.md"
    result = _bench("handoff", "--quick", "--strict", "--out", str(out), tmp_path=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    report = out.read_text()
    assert "# Benchmarks" in report and "## Machine and run" in report
    rows = [line for line in report.splitlines() if line.startswith("| `put(bytes)`")]
    assert rows, report
    # case | ours | baseline | ratio | ...: both sides measured and a numeric ratio.
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert re.fullmatch(r"\d+\.\d\d", cells[3]), rows[0]
    assert "write+fsync:" in cells[2]
    # Nothing of the run is left behind: its work directory is removed.
    assert not any((tmp_path / "work").iterdir())


def test_unknown_benchmark_is_a_usage_error(tmp_path: Path) -> None:
    result = _bench("no-such-bench", tmp_path=tmp_path)
    assert result.returncode == 2
    assert "unknown benchmark" in result.stderr and "handoff" in result.stderr


def test_quick_hostile_benchmark_reports_a_ratio(tmp_path: Path) -> None:
    out = tmp_path / "bench.md"
    result = _bench("hostile", "--quick", "--strict", "--out", str(out), tmp_path=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in out.read_text().splitlines() if line.startswith("| p99 `put(bytes)`")]
    assert rows, out.read_text()
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert re.fullmatch(r"\d+\.\d\d", cells[3]), rows[0]
    assert "the same client alone:" in cells[2]
