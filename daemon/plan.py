"""The checkpoint sizing worksheet (``ckptdrain plan``): bytes, bandwidth and capacity.

The sizing arithmetic, in decimal GB/TB and single-direction byte rates:

    checkpoint_GB   = parameters * bytes_per_parameter / 1e9 * (1 + allowance)
    burst_GBps      = jobs * checkpoint_GB / deadline_s       (every job saving at once)
    service_GBps    = burst_GBps / utilization               (headroom under a ceiling)
    average_GBps    = jobs * checkpoint_GB / interval_s
    per_server_GBps = checkpoint_GB / servers_per_job / deadline_s
    retained_TB     = jobs * retained * checkpoint_GB / 1000
    peak_TB         = jobs * (retained + 1) * checkpoint_GB / 1000   (+ one in progress per job)

Pure: no I/O; ``argparse`` is only described here, the CLI owns the parser.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from ckptdrain.daemon.errors import DaemonError

__all__ = [
    "GBPS_PER_400G_UNIT",
    "Plan",
    "PlanError",
    "PlanInput",
    "add_plan_arguments",
    "compute_plan",
    "parse_count",
    "plan_from_args",
    "render_plan",
    "render_plan_json",
]

# A 400 Gb/s link carries at most 50 GB/s in one direction (before protocol overhead).
GBPS_PER_400G_UNIT = 400 / 8


class PlanError(DaemonError, ValueError):
    """A worksheet input is out of range; the message names it and the accepted range."""


@dataclass(frozen=True, kw_only=True)
class PlanInput:
    parameters: float
    bytes_per_parameter: float
    allowance: float = 0.10
    jobs: int = 1
    servers_per_job: int = 1
    deadline_s: float
    interval_s: float
    utilization: float = 0.70
    retained: int = 3

    def __post_init__(self) -> None:
        _require_positive("parameter count", self.parameters)
        _require_positive("bytes per parameter", self.bytes_per_parameter)
        _require_finite("allowance", self.allowance)
        if self.allowance < 0:
            raise PlanError(f"allowance must be >= 0 (got {self.allowance:g})")
        _require_count("jobs", self.jobs)
        _require_count("servers per job", self.servers_per_job)
        _require_positive("deadline", self.deadline_s, " seconds")
        _require_positive("checkpoint interval", self.interval_s, " seconds")
        _require_finite("utilization ceiling", self.utilization)
        if not 0 < self.utilization <= 1:
            raise PlanError(f"utilization ceiling must be in (0, 1] (got {self.utilization:g})")
        _require_count("retained generations", self.retained)


def _require_finite(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PlanError(f"{name} must be a finite number (got {value!r})")


def _require_positive(name: str, value: float, unit: str = "") -> None:
    _require_finite(name, value)
    if value <= 0:
        raise PlanError(f"{name} must be > 0{unit} (got {value:g})")


def _require_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{name} must be a whole number (got {value!r})")
    if value < 1:
        raise PlanError(f"{name} must be >= 1 (got {value})")


@dataclass(frozen=True)
class Plan:
    checkpoint_gb: float  # one logical checkpoint of one job, allowance included
    per_server_gb: float  # staged per server for one checkpoint (balanced sharding)
    burst_gbps: float  # all jobs checkpointing within the deadline
    service_gbps: float  # burst / utilization ceiling: what to buy
    average_gbps: float  # long-run arrival rate: the drain must exceed it
    per_server_gbps: float  # each server's share of one job's burst
    units_400g: int  # 400 Gb/s paths needed for service_gbps (link lower bound)
    retained_tb: float  # retained generations of every job
    peak_tb: float  # retained plus one in-progress generation per job

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Past a zettabyte (per second), an input was given in the wrong unit.
MAX_RESULT = 1e12


def compute_plan(inp: PlanInput) -> Plan:
    """The worksheet's results for ``inp`` (validated when the PlanInput was built)."""
    checkpoint_gb = inp.parameters * inp.bytes_per_parameter / 1e9 * (1 + inp.allowance)
    burst = inp.jobs * checkpoint_gb / inp.deadline_s
    service = burst / inp.utilization
    for name, value in (("checkpoint size", checkpoint_gb), ("burst bandwidth", burst),
                        ("service bandwidth", service),
                        ("retained bytes", inp.jobs * (inp.retained + 1) * checkpoint_gb)):
        # Extreme inputs that each pass (1e308 bytes per parameter, a 1e-320 utilization)
        # overflowed into a traceback, or printed numbers 190 digits long (found attacking).
        if not value < MAX_RESULT:
            raise PlanError(f"the {name} these inputs give is beyond {MAX_RESULT:.0e} GB (or GB/s): "
                            "check the units of the inputs (sizes in bytes, times in seconds)")
    # A hair below the next integer is float noise, not a need for another link.
    units = max(1, math.ceil(service / GBPS_PER_400G_UNIT - 1e-9))
    return Plan(
        checkpoint_gb=checkpoint_gb,
        per_server_gb=checkpoint_gb / inp.servers_per_job,
        burst_gbps=burst,
        service_gbps=service,
        average_gbps=inp.jobs * checkpoint_gb / inp.interval_s,
        per_server_gbps=checkpoint_gb / inp.servers_per_job / inp.deadline_s,
        units_400g=units,
        retained_tb=inp.jobs * inp.retained * checkpoint_gb / 1000,
        peak_tb=inp.jobs * (inp.retained + 1) * checkpoint_gb / 1000,
    )


def _num(value: float, digits: int = 2) -> str:
    return f"{value:,.{digits}f}"


def render_plan(plan: Plan, inp: PlanInput) -> str:
    """A two-part table (inputs, results) for a terminal."""
    rows_in = [
        ("Parameters", f"{inp.parameters:,.0f}", ""),
        ("Bytes per parameter", f"{inp.bytes_per_parameter:g}", "B"),
        ("Allowance", f"{inp.allowance * 100:g}", "%"),
        ("Concurrent jobs", str(inp.jobs), ""),
        ("Servers per job", str(inp.servers_per_job), ""),
        ("Deadline", f"{inp.deadline_s:g}", "s"),
        ("Checkpoint interval", f"{inp.interval_s:g}", "s"),
        ("Utilization ceiling", f"{inp.utilization * 100:g}", "%"),
        ("Retained generations", str(inp.retained), "per job"),
    ]
    rows_out = [
        ("Checkpoint per job", _num(plan.checkpoint_gb), "GB"),
        ("Staged per server", _num(plan.per_server_gb), "GB"),
        ("Burst payload", _num(plan.burst_gbps), "GB/s"),
        ("Service target", _num(plan.service_gbps), "GB/s"),
        ("Average write rate", _num(plan.average_gbps), "GB/s"),
        ("Per-server payload", _num(plan.per_server_gbps), "GB/s"),
        ("400 Gb/s units", str(plan.units_400g), "(link lower bound)"),
        ("Retained capacity", _num(plan.retained_tb, 3), "TB"),
        ("Peak capacity", _num(plan.peak_tb, 3), "TB (+1 in progress per job)"),
    ]
    width_label = max(len(r[0]) for r in rows_in + rows_out)
    width_value = max(len(r[1]) for r in rows_in + rows_out)

    def line(label: str, value: str, unit: str) -> str:
        return f"  {label:<{width_label}}  {value:>{width_value}}  {unit}".rstrip()

    out = ["Inputs"]
    out += [line(*row) for row in rows_in]
    out += ["", "Results (decimal GB/TB, single-direction rates)"]
    out += [line(*row) for row in rows_out]
    if inp.interval_s < inp.deadline_s:
        out += ["", "Note: the interval is shorter than the deadline, so checkpoints overlap."]
    return "\n".join(out) + "\n"


def render_plan_json(plan: Plan, inp: PlanInput) -> str:
    """``{"input": ..., "plan": ...}`` as JSON, for ``ckptdrain plan --json``."""
    return json.dumps({"input": asdict(inp), "plan": plan.to_dict()}, indent=2, sort_keys=True)


# ---------------------------------------------------------------------------------------------
# Command line

_SCALE = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
_COUNT_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)\s*([KkMmBbGgTt]?)\s*$")


def parse_count(text: str) -> float:
    """``"70e9"``, ``"70B"`` (billion), ``"1.5T"``, ``"7M"`` or ``"70000000000"``."""
    match = _COUNT_RE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a parameter count; write e.g. 70e9 or 70B"
        )
    return float(match.group(1).replace("_", "")) * _SCALE[match.group(2).upper()]


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _fraction(text: str) -> float:
    """``0.7`` or ``70%``."""
    stripped = text.strip()
    if stripped.endswith("%"):
        return _number(stripped[:-1]) / 100
    return _number(stripped)


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The worksheet's flags, for ``ckptdrain plan``."""
    parser.add_argument(
        "--parameters", type=parse_count, required=True, metavar="N",
        help="model parameter count, e.g. 70e9 or 70B",
    )
    parser.add_argument(
        "--bytes-per-parameter", type=_number, default=14.0, metavar="B",
        help="saved bytes per parameter (weights + master weights + optimizer state; "
        "default 14)",
    )
    parser.add_argument(
        "--allowance", type=_fraction, default=0.10, metavar="F",
        help="extra saved state and serialization overhead, as a fraction or %% (default 0.10)",
    )
    parser.add_argument(
        "--jobs", type=_whole, default=1, metavar="N",
        help="jobs that may checkpoint at the same time (default 1)",
    )
    parser.add_argument(
        "--servers-per-job", type=_whole, default=1, metavar="N",
        help="servers each job's checkpoint is sharded across (default 1)",
    )
    parser.add_argument(
        "--deadline-s", type=_number, required=True, metavar="S",
        help="seconds within which a checkpoint must reach the destination",
    )
    parser.add_argument(
        "--interval-s", type=_number, required=True, metavar="S",
        help="seconds between checkpoint starts of one job",
    )
    parser.add_argument(
        "--utilization", type=_fraction, default=0.70, metavar="F",
        help="design utilization ceiling in (0, 1], as a fraction or %% (default 0.70)",
    )
    parser.add_argument(
        "--retained", type=_whole, default=3, metavar="N",
        help="committed generations kept per job (default 3)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def plan_from_args(ns: argparse.Namespace) -> PlanInput:
    """The PlanInput from parsed flags; raises :class:`PlanError` for out-of-range values."""
    return PlanInput(
        parameters=ns.parameters,
        bytes_per_parameter=ns.bytes_per_parameter,
        allowance=ns.allowance,
        jobs=ns.jobs,
        servers_per_job=ns.servers_per_job,
        deadline_s=ns.deadline_s,
        interval_s=ns.interval_s,
        utilization=ns.utilization,
        retained=ns.retained,
    )
