"""`polytrain verify` catches real faults with its default settings: each fault of faults/sitecustomize.py
(one micro-batch's gradient dropped, one rank's gradient scaled by 1 + 1e-6, one stale parameter element after
a step), injected into the workers of a strategy that verify passes without it, makes verify FAIL. Also the
verdict's arithmetic, exactly.

The fault travels with the workers' entry point (`in_worker`), not in their environment: a launch whose
environment changed spawns its workers (seconds each on 2 cores) instead of forking them."""

import functools

import pytest
import torch
from conftest import polytrain_here
from faults.sitecustomize import in_worker

from polytrain.runtime import launch
from polytrain.runtime.verify import FLOOR_MULTIPLE, judge, relative_difference, step_differences


def test_the_difference_is_relative_to_the_largest_parameter():
    reference = torch.tensor([4.0, -2.0, 0.5], dtype=torch.float64)
    other = reference.clone()
    other[2] += 4e-10  # one element off by 1e-10 of the largest magnitude (4)
    assert relative_difference(reference, other) == pytest.approx(1e-10)
    assert relative_difference(reference, reference.clone()) == 0.0
    assert step_differences([(1.0, reference), (0.5, reference)], [(1.0, reference), (0.5, other)]) == [
        0.0,
        pytest.approx(1e-10),
    ]


def test_the_verdict_in_float64_and_against_the_noise_floor():
    assert judge([1e-16, 5e-11], steps_match=True, tolerance=1e-10).passed
    failed = judge([1e-16, 2e-10], steps_match=True, tolerance=1e-10)
    assert not failed.passed and "FAIL" in failed.line() and "2.000e-10" in failed.line()
    assert not judge([0.0], steps_match=False, tolerance=1e-10).passed  # a run that stopped early
    eps = torch.finfo(torch.float32).eps
    # as trained: within FLOOR_MULTIPLE times the floor (never below float32's epsilon)
    assert judge([9e-6], steps_match=True, tolerance=0, floor_differences=[1e-6, 3e-7]).passed
    assert not judge([1.1e-5], steps_match=True, tolerance=0, floor_differences=[1e-6]).passed
    tiny_floor = judge([FLOOR_MULTIPLE * eps * 0.9], steps_match=True, tolerance=0, floor_differences=[0.0])
    assert tiny_floor.passed and tiny_floor.floor == 0.0 and "noise floor" in tiny_floor.line()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "fault, argv",
    [
        ("drop", ["--model", "lenet"]),
        ("scale", ["--model", "lenet"]),
        ("stale", ["--model", "lenet"]),
        ("scale", ["--model", "mlp", "--strategy", "sharded"]),
        ("scale", ["--model", "mlp", "--strategy", "tensor"]),
    ],
)
def test_verify_fails_on_each_injected_fault(fault, argv, capfd, monkeypatch):
    handed = launch.with_this_output  # (what gives the launcher the workers' entry point and its arguments)

    def with_the_fault(entry, job, method):
        return handed(functools.partial(in_worker, fault, entry), job, method)

    monkeypatch.setattr(launch, "with_this_output", with_the_fault)
    result = polytrain_here(
        capfd,
        "verify",
        "--devices",
        "2",
        "--steps",
        "4",
        "--batch-size",
        "32",
        "--dataset",
        "mnist-sample",
        *argv,
    )
    assert "fault injected on rank 1" in result.stderr, result.stdout + result.stderr
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL: largest parameter difference" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert float(rows[0][3]) <= 1e-13  # the step before the fault agrees to float64 rounding
