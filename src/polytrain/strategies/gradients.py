"""What happens to the gradients between the last backward pass and the optimizer step, the same on every
strategy: fp16 loss scaling, clipping by the global norm (or by value), and the figures an epoch reports.

Each strategy knows where its gradients live and over which ranks they differ, and says so with two groups:
- `norm_group`: the ranks whose *local* gradients are parts of the whole model's (pipeline stages, parameter
  servers). Their squared norms are summed over it, so the norm is the one-device norm of the whole model
  (torchtitan #596: a stage-local norm clips each stage differently). None where every rank already holds
  the whole gradient (data parallelism, after the all-reduce) or where DTensor sums the shards (FSDP2).
- `overflow_group`: the ranks that must agree whether any gradient overflowed in fp16, so that all of them
  skip the same step. None where every rank sees the same gradients.
Where both are the same group, the squared norm and the overflow flag travel in one all-reduce of two numbers.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from .holdings import whole


def total_norm(grads: list) -> torch.Tensor:
    """The L2 norm of all `grads` together (0 for none), as `torch.nn.utils.clip_grad_norm_` computes it; DTensors
    of different meshes (experts split over ranks beside the rest, parallel/experts.py) each over their own."""
    if not grads:
        return torch.zeros(())
    meshes = {}
    for grad in grads:
        meshes.setdefault(getattr(grad, "device_mesh", None), []).append(grad)
    if len(meshes) > 1:
        norms = [total_norm(group) for group in meshes.values()]
        return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device, torch.float64) for n in norms]))
    if hasattr(torch.nn.utils, "get_total_norm"):
        return whole(torch.nn.utils.get_total_norm(grads, 2.0))  # a DTensor norm: its full value
    return torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g, dtype=_norm_dtype(g)) for g in grads])
    )


def _norm_dtype(tensor: torch.Tensor) -> torch.dtype:
    """float32 for half-precision gradients, float64 for float64 ones (never a rounding below the gradients')."""
    return torch.promote_types(tensor.dtype, torch.float32)


def scale_to_norm(grads: list, max_norm: float, norm: torch.Tensor) -> None:
    """Multiply `grads` by min(1, max_norm / (norm + 1e-6)): `clip_grad_norm_`'s rule, given the global norm."""
    if not grads:
        return
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    # one multi-tensor kernel per device and dtype, as clip_grad_norm_ does, not one mul_ per gradient (52 for
    # the GPT, each a parallel region that waits for a busy core); DTensors (FSDP2, tensor parallel) take a number
    groups = {}
    for grad in grads:
        if hasattr(grad, "device_mesh"):
            grad.mul_(coefficient.item())
        else:
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, dtype), group in groups.items():
        torch._foreach_mul_(group, coefficient.to(device, dtype))


class Gradients:
    """Loss scaling, clipping and their per-epoch figures for one rank's optimizer."""

    def __init__(
        self,
        *,
        device: torch.device,
        accumulate: int = 1,
        clip_norm: Optional[float] = None,
        clip_value: Optional[float] = None,
        fp16: bool = False,
    ):
        self.device = torch.device(device)
        self.accumulate = accumulate
        self.clip_norm, self.clip_value = clip_norm, clip_value
        self.scaler = None
        if fp16:
            self.scaler = torch.amp.GradScaler(self.device.type)
            self.scaler.scale(torch.ones((), device=self.device))  # every rank holds the scale, loss or not
        # per epoch, on the device: sum and max of the norms before clipping, clipped steps, skipped steps
        self.figures = torch.zeros(4, dtype=torch.float64, device=self.device)
        self.steps = 0
        self.last_norm: Optional[torch.Tensor] = None

    @property
    def active(self) -> bool:
        return self.scaler is not None or self.clip_norm is not None or self.clip_value is not None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def step(self, optimizer, params, *, norm_group=None, overflow_group=None) -> None:
        """Unscale, agree on overflow, clip, then step `optimizer` (skipped, on every rank, after an overflow)."""
        self.steps += 1
        if not self.active:
            optimizer.step()
            return
        grads = [p.grad for p in params if p.grad is not None]
        found = None
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
            found = self._found_inf(optimizer)
        if self.clip_value is not None and grads:
            torch.nn.utils.clip_grad_value_([p for p in params if p.grad is not None], self.clip_value)
        squared = None
        if self.clip_norm is not None:
            # float64 on every rank, whatever the gradients' dtype, so that ranks with and without gradients
            # agree on the all-reduce and float64 training keeps its precision
            squared = total_norm(grads).to(self.device, torch.float64).square()
        squared, found = self._agree(squared, found, norm_group, overflow_group)
        norm = squared.sqrt() if squared is not None else None
        if found is not None:
            self._set_found_inf(optimizer, found)
        if norm is not None:
            scale_to_norm(grads, self.clip_norm, norm)
            self.last_norm = norm
            finite = torch.isfinite(norm)
            value = torch.where(
                finite, norm.double(), torch.zeros((), dtype=torch.float64, device=norm.device)
            )
            self.figures[0] += value.to(self.figures.device)
            self.figures[1] = torch.maximum(self.figures[1], value.to(self.figures.device))
            self.figures[2] += ((norm > self.clip_norm) & finite).to(self.figures.device, torch.float64)
        if self.scaler is not None:
            self.figures[3] += found.to(self.figures.device, torch.float64).clamp(max=1)
            self.scaler.step(optimizer)
            self.scaler.update()
            # A step the scaler skips still counts for the schedule, which advances by steps as on one device;
            # the flag torch's step sets tells a scheduler stepped next that its optimizer's step came first
            # (else torch warns that `lr_scheduler.step()` was called before `optimizer.step()`).
            optimizer._opt_called = True
        else:
            optimizer.step()

    def _agree(self, squared, found, norm_group, overflow_group):
        """Sum the squared norm over `norm_group` and the overflow flag over `overflow_group`: one all-reduce
        of two numbers where the groups are the same, one of one number where only one is needed."""
        sum_norm = squared is not None and norm_group is not None
        sum_found = found is not None and overflow_group is not None
        if sum_norm and sum_found and norm_group is overflow_group:
            both = self._all_reduce(torch.stack([squared, found.to(squared.dtype)]), norm_group)
            return both[0], both[1]
        if sum_norm:
            squared = self._all_reduce(squared.reshape(1), norm_group)[0]
        if sum_found:
            found = self._all_reduce(found.reshape(1).float(), overflow_group)[0]
        return squared, found

    @staticmethod
    def _all_reduce(values: torch.Tensor, group) -> torch.Tensor:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=None if group is dist.group.WORLD else group)
        return values

    def _found_inf(self, optimizer) -> torch.Tensor:
        found = self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        if not found:  # no gradient on this rank (a placeholder, frozen layers): nothing overflowed
            found[self.device] = torch.zeros((), dtype=torch.float32, device=self.device)
        return sum(value.to(self.device) for value in found.values()).reshape(())

    def _set_found_inf(self, optimizer, found: torch.Tensor) -> None:
        flag = (found > 0).float()
        for value in self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            value.copy_(flag.to(value.device))

    def epoch_figures(self) -> dict:
        """This epoch's clipping and loss-scaling figures for its record (the same on every rank), then reset."""
        if not self.active or self.steps == 0:
            return {}
        norm_sum, norm_max, clipped, skipped = self.figures.tolist()
        figures, notes = {}, []
        if self.clip_norm is not None:
            counted = self.steps - skipped
            figures.update(
                grad_norm_mean=norm_sum / counted if counted else math.nan,
                grad_norm_max=norm_max,
                clipped_steps=int(clipped),
            )
            notes.append(
                f"grad norm {figures['grad_norm_mean']:.3g} (max {norm_max:.3g}), clipped {int(clipped)}"
                f"/{self.steps} steps"
            )
        if self.scaler is not None:
            figures.update(skipped_steps=int(skipped), loss_scale=float(self.scaler.get_scale()))
            notes.append(
                f"fp16 scale {figures['loss_scale']:g}, skipped {int(skipped)} step"
                f"{'s' if skipped != 1 else ''}"
            )
        self.figures.zero_()
        self.steps = 0
        return dict(figures, note="; ".join(notes))

    def state_dict(self) -> dict:
        """The loss scale and the epoch's figures so far (the same on every rank), for a checkpoint."""
        state = {"figures": self.figures.tolist(), "steps": self.steps}
        return dict(state, scaler=self.scaler.state_dict()) if self.scaler is not None else state

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        if state and "figures" in state:
            self.figures.copy_(torch.tensor(state["figures"], dtype=torch.float64))
            self.steps = state["steps"]


def check_fp16(device_type: str) -> None:
    """Refuse, in one line, fp16 where this torch cannot autocast to it or scale the loss."""
    import warnings

    from ..errors import ConfigError

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autocast(device_type, dtype=torch.float16):
                pass
            supported = hasattr(torch.amp, "GradScaler") and not caught
        except RuntimeError:
            supported = False
    if not supported:
        raise ConfigError(
            f"--precision fp16 on {device_type} needs a torch that autocasts to float16 and scales "
            f"the loss there (torch.amp.GradScaler; this is {torch.__version__}); upgrade torch, or use "
            f"--precision bf16 or fp32"
        )
