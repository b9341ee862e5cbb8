"""`polytrain verify`: the same steps trained on one device and on N, compared parameter by parameter.

By default both sides train in float64 (on the CPU always; on a GPU that computes float64 at speed), so
rounding can neither hide a bug nor pass for one: float32 rounding, amplified by Adam's division by each
gradient's running root-mean-square, moves parameters by 1e-5 where nothing is wrong, while a float64 run of
the same strategies agrees to about 1e-14 of the parameters' scale. Where float64 cannot run (fp16 and bf16
autocast, a GPU without float64 speed), both sides train as configured, and the one-device run is repeated
in another summation order (each batch in two accumulation passes): the difference between those two is
the noise floor, and N devices pass within `FLOOR_MULTIPLE` times it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from ..errors import UserError
from .verify_limits import FLOAT64_GPUS, FLOOR_MULTIPLE


def relative_difference(reference: torch.Tensor, other: torch.Tensor) -> float:
    """max |reference - other| / max |reference|: the largest parameter difference on the parameters' scale."""
    if not reference.numel():
        return 0.0
    scale = max(float(reference.abs().max()), torch.finfo(torch.float64).tiny)
    return float((reference - other).abs().max()) / scale


def step_differences(reference: Sequence, other: Sequence) -> List[float]:
    """The relative parameter difference after each step of two recorded runs ((loss, parameters) per step)."""
    return [relative_difference(a[1], b[1]) for a, b in zip(reference, other)]


def compares_in_float64(compare: str, *, precision: str, device: torch.device) -> bool:
    """Whether `--compare-in` COMPARE trains both sides in float64 here (False: as trained)."""
    if compare != "auto":
        return compare == "float64"
    if precision != "fp32":
        return False
    return device.type != "cuda" or torch.cuda.get_device_capability(device) in FLOAT64_GPUS


@dataclass
class Verdict:
    passed: bool
    worst: float  # the largest relative parameter difference, N devices against one
    limit: float  # what it had to stay within
    floor: Optional[float] = None  # as trained: one device against itself in another summation order

    def line(self) -> str:
        floor = (
            ""
            if self.floor is None
            else f"; noise floor {self.floor:.3e} (one device, each batch in two passes), limit {FLOOR_MULTIPLE} x "
            f"max(floor, float32 epsilon)"
        )
        return (
            f"{'PASS' if self.passed else 'FAIL'}: largest parameter difference {self.worst:.3e} of the "
            f"parameters' scale ({'within' if self.passed else 'beyond'} {self.limit:.3g}{floor})"
        )


def judge(
    differences: Sequence[float],
    *,
    steps_match: bool,
    tolerance: float,
    floor_differences: Optional[Sequence[float]] = None,
) -> Verdict:
    """PASS where every step's difference stays within `tolerance` (float64), or within FLOOR_MULTIPLE times
    the noise floor where `floor_differences` (the one-device run against itself) are given."""
    worst = max(differences, default=0.0)
    if floor_differences is None:
        return Verdict(steps_match and worst <= tolerance, worst, tolerance)
    floor = max(floor_differences, default=0.0)
    limit = FLOOR_MULTIPLE * max(floor, torch.finfo(torch.float32).eps)
    return Verdict(steps_match and worst <= limit, worst, limit, floor)


def in_float64(model: torch.nn.Module, data):
    """The model and the dataset's float inputs in float64 (a copy of the model; token ids stay integers)."""
    model = copy.deepcopy(model).double()
    if hasattr(data, "dtype"):
        data = copy.copy(data)
        data.dtype = torch.float64
    return model, data


def reference_passes(model: torch.nn.Module, config, strategy: str, plan, *, float64: bool) -> int:
    """In how many passes the one-device reference takes each step: 1, or a pipeline's micro-batches for a
    model with BatchNorm (which normalises over each micro-batch there). One line where no reference can be
    equal: BatchNorm and Dropout compute over the global batch on data-parallel layouts
    (parallel/global_batch.py), and a pipeline's Dropout draws one device's masks, but not over the ranks of
    a tensor group; and BatchNorm normalises over each accumulation pass, which N devices cut from other samples than one."""
    from ..parallel.global_batch import per_rank_dropout_words, uses_whole_batch
    from ..strategy_registry import STRATEGIES

    per_rank = per_rank_dropout_words(model)
    if per_rank is not None:
        raise UserError(
            f"verify: {per_rank} dropout masks on each rank, so {config.devices} devices draw other masks than "
            f"one; verify a copy with their dropout at 0, or use nn.Dropout (drawn over the global batch on "
            f"data-parallel layouts)"
        )
    kinds = uses_whole_batch(model)
    if not kinds:
        return 1
    if "BatchNorm" in kinds and not float64:
        raise UserError(
            "verify: BatchNorm normalises over each pass, so the noise floor of a comparison as trained "
            "(the same steps in two passes) would not be rounding alone; verify in float64 (--precision fp32 "
            "--compare-in float64)"
        )
    if STRATEGIES[strategy].normalises_global_batch and config.layout.tensor == 1:
        if "BatchNorm" in kinds and config.accumulate > 1:
            raise UserError(
                f"verify: BatchNorm normalises over each pass, and --accumulate {config.accumulate} makes "
                f"{config.devices} devices' passes of other samples than one device's; verify without "
                f"--accumulate (training with it is fine: each pass is normalised over its samples)"
            )
        return 1
    # a pipeline: each micro-batch applies its rows of one device's dropout masks, BatchNorm normalises over it
    pipeline = hasattr(plan, "micro_batch_passes")
    passes = plan.micro_batch_passes(config.layout) if pipeline else None
    if "Dropout" not in kinds or (pipeline and plan.draws_dropout_as_one_device(config.layout)):
        if "BatchNorm" not in kinds:
            return 1
        if passes and config.accumulate == 1:
            return passes
    raise UserError(
        f"verify: the model's {' and '.join(sorted(kinds))} layers compute over the samples each rank holds, "
        f"which the {strategy} strategy cuts otherwise than one device (data-parallel strategies compute them "
        f"over the global batch, a pipeline Dropout as one device and BatchNorm over its micro-batches); "
        f"verify --strategy data, sharded or parameter-server"
    )
