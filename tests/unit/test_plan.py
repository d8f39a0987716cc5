"""The sizing worksheet: a worked example, input checks, and the flags."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from ckptdrain.daemon.plan import (
    Plan,
    PlanError,
    PlanInput,
    add_plan_arguments,
    compute_plan,
    parse_count,
    plan_from_args,
    render_plan,
    render_plan_json,
)

# The worked example: four 70B jobs at 14 B/parameter, 8 servers each, 60 s deadline,
# one checkpoint per 900 s, 70 % ceiling, three generations kept.
SEED = PlanInput(
    parameters=70e9,
    bytes_per_parameter=14,
    allowance=0.10,
    jobs=4,
    servers_per_job=8,
    deadline_s=60,
    interval_s=900,
    utilization=0.70,
    retained=3,
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptdrain plan", exit_on_error=False)
    add_plan_arguments(p)
    return p


def test_seed_worked_example() -> None:
    plan = compute_plan(SEED)
    assert round(plan.checkpoint_gb, 2) == 1078.00
    assert round(plan.burst_gbps, 2) == 71.87
    assert round(plan.service_gbps, 2) == 102.67
    assert round(plan.average_gbps, 2) == 4.79
    assert round(plan.per_server_gbps, 2) == 2.25
    assert round(plan.per_server_gb, 2) == 134.75
    assert plan.units_400g == 3
    assert round(plan.retained_tb, 3) == 12.936
    assert round(plan.peak_tb, 3) == 17.248


def test_seed_ten_seconds_of_commit_work() -> None:
    # Seed section 3: with 10 s of non-overlapping work only 50 s remain for transfer.
    plan = compute_plan(
        PlanInput(parameters=70e9, bytes_per_parameter=14, jobs=4, servers_per_job=8,
                  deadline_s=50, interval_s=900)
    )
    assert round(plan.burst_gbps, 2) == 86.24
    assert round(plan.service_gbps, 2) == 123.20


def test_units_round_up_but_not_on_float_noise() -> None:
    exact = compute_plan(
        PlanInput(parameters=100e9, bytes_per_parameter=1, allowance=0, deadline_s=1,
                  interval_s=10, utilization=1.0)
    )
    assert exact.service_gbps == pytest.approx(100.0)
    assert exact.units_400g == 2
    over = compute_plan(
        PlanInput(parameters=100.5e9, bytes_per_parameter=1, allowance=0, deadline_s=1,
                  interval_s=10, utilization=1.0)
    )
    assert over.units_400g == 3


def test_utilization_one_is_accepted() -> None:
    plan = compute_plan(PlanInput(parameters=1e9, bytes_per_parameter=2, deadline_s=10,
                                  interval_s=100, utilization=1.0))
    assert plan.service_gbps == pytest.approx(plan.burst_gbps)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"deadline_s": 0}, "deadline must be > 0 seconds (got 0)"),
        ({"deadline_s": -5}, "deadline must be > 0 seconds (got -5)"),
        ({"utilization": 0}, "utilization ceiling must be in (0, 1] (got 0)"),
        ({"utilization": -0.1}, "utilization ceiling must be in (0, 1] (got -0.1)"),
        ({"utilization": 1.01}, "utilization ceiling must be in (0, 1] (got 1.01)"),
        ({"utilization": 1.5}, "utilization ceiling must be in (0, 1] (got 1.5)"),
        ({"utilization": float("nan")}, "utilization ceiling must be a finite number"),
        ({"interval_s": 0}, "checkpoint interval must be > 0 seconds (got 0)"),
        ({"parameters": -1}, "parameter count must be > 0 (got -1)"),
        ({"parameters": float("inf")}, "parameter count must be a finite number"),
        ({"bytes_per_parameter": 0}, "bytes per parameter must be > 0"),
        ({"allowance": -0.1}, "allowance must be >= 0 (got -0.1)"),
        ({"jobs": 0}, "jobs must be >= 1 (got 0)"),
        ({"servers_per_job": 0}, "servers per job must be >= 1 (got 0)"),
        ({"servers_per_job": 1.5}, "servers per job must be a whole number"),
        ({"retained": 0}, "retained generations must be >= 1 (got 0)"),
    ],
)
def test_rejects_out_of_range(changes: dict[str, float], message: str) -> None:
    fields = {**SEED.__dict__, **changes}
    with pytest.raises(PlanError) as info:
        PlanInput(**fields)
    assert str(info.value) == message or str(info.value).startswith(message)
    assert isinstance(info.value, ValueError)


def test_to_dict_and_json() -> None:
    plan = compute_plan(SEED)
    data = plan.to_dict()
    assert set(data) == set(Plan.__dataclass_fields__)
    assert data["units_400g"] == 3
    decoded = json.loads(render_plan_json(plan, SEED))
    assert decoded["plan"]["units_400g"] == 3
    assert decoded["input"]["jobs"] == 4


def test_render_shows_every_result() -> None:
    text = render_plan(compute_plan(SEED), SEED)
    for fragment in ("1,078.00", "71.87", "102.67", "4.79", "2.25", "134.75", "12.936",
                     "17.248", "GB/s", "TB"):
        assert fragment in text
    units_line = next(line for line in text.splitlines() if "400 Gb/s units" in line)
    assert " 3 " in units_line


def test_render_notes_overlapping_checkpoints() -> None:
    inp = PlanInput(parameters=1e9, bytes_per_parameter=2, deadline_s=100, interval_s=50)
    assert "overlap" in render_plan(compute_plan(inp), inp)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("70e9", 70e9), ("70B", 70e9), ("70b", 70e9), ("1.5T", 1.5e12), ("7M", 7e6),
     ("70000000000", 70e9), ("70_000_000_000", 70e9), ("8K", 8e3), ("175G", 175e9)],
)
def test_parse_count(text: str, expected: float) -> None:
    assert parse_count(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "seventy", "70X", "-70B", "70 billion"])
def test_parse_count_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_count(text)


def test_flags_reproduce_the_seed() -> None:
    ns = parser().parse_args([
        "--parameters", "70B", "--bytes-per-parameter", "14", "--allowance", "10%",
        "--jobs", "4", "--servers-per-job", "8", "--deadline-s", "60", "--interval-s", "900",
        "--utilization", "0.7", "--retained", "3", "--json",
    ])
    assert ns.json is True
    inp = plan_from_args(ns)
    assert inp == SEED
    assert compute_plan(inp).units_400g == 3


def test_flag_defaults() -> None:
    ns = parser().parse_args(["--parameters", "7e9", "--deadline-s", "30", "--interval-s", "600"])
    inp = plan_from_args(ns)
    assert (inp.bytes_per_parameter, inp.allowance, inp.jobs, inp.servers_per_job) == (
        14.0, 0.10, 1, 1)
    assert (inp.utilization, inp.retained) == (0.70, 3)
    assert ns.json is False


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--deadline-s", "0"], "deadline must be > 0 seconds (got 0)"),
        (["--deadline-s", "-1"], "deadline must be > 0 seconds (got -1)"),
        (["--utilization", "0"], "utilization ceiling must be in (0, 1] (got 0)"),
        (["--utilization", "-0.1"], "utilization ceiling must be in (0, 1] (got -0.1)"),
        (["--utilization", "101%"], "utilization ceiling must be in (0, 1] (got 1.01)"),
    ],
)
def test_flags_out_of_range_raise_plan_error(flags: list[str], message: str) -> None:
    base = {"--parameters": "70B", "--deadline-s": "60", "--interval-s": "900"}
    args: list[str] = []
    for flag, value in base.items():
        if flag not in flags:
            args += [flag, value]
    ns = parser().parse_args(args + flags)
    with pytest.raises(PlanError, match=re.escape(message)):
        plan_from_args(ns)


def test_flags_reject_non_numbers() -> None:
    with pytest.raises(argparse.ArgumentError):
        parser().parse_args(["--parameters", "lots", "--deadline-s", "1", "--interval-s", "1"])
    with pytest.raises(argparse.ArgumentError):
        parser().parse_args(["--parameters", "1B", "--deadline-s", "soon", "--interval-s", "1"])


@pytest.mark.parametrize(
    "flags",
    [
        # Found attacking: each passed its own check, then math.ceil(inf) raised OverflowError
        # (a traceback, exit 1), or the table printed numbers 190 digits long.
        ["--utilization", "1e-320"],
        ["--allowance", "1e308"],
        ["--bytes-per-parameter", "1e308", "--jobs", "1000"],
        ["--deadline-s", "1e-300"],
    ],
)
def test_inputs_whose_results_are_beyond_reason_raise_plan_error(flags: list[str]) -> None:
    base = {"--parameters": "70B", "--deadline-s": "60", "--interval-s": "900"}
    args: list[str] = []
    for flag, value in base.items():
        if flag not in flags:
            args += [flag, value]
    inp = plan_from_args(parser().parse_args(args + flags))
    with pytest.raises(PlanError, match="check the units"):
        compute_plan(inp)
