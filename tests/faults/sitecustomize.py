"""Faults injected into the worker processes of a test's `polytrain verify` (test_verify_faults.py).

`in_worker(fault, entry)` runs a worker's entry point with the fault installed in that worker alone; the test
hands it to the launcher as the workers' entry point, so they still fork from the forkserver. By hand, this
module installs the fault that VERIFY_FAULT names in every process whose PYTHONPATH holds this folder (Python
imports it at start-up; the launches then spawn their workers, as their environment changed). Either way the
fault strikes on rank 1 only, at its FAULT_STEP-th backward pass (of real tensors) or optimizer step (the
one-device reference, outside any process group, is untouched):

  drop   that backward pass computes no gradient (one micro-batch's gradient lost before the all-reduce)
  scale  that backward pass's gradient is scaled by 1 + 1e-6 (one rank's contribution slightly off)
  stale  after that optimizer step, one element of the first parameter keeps its value from before the step
"""

import os
import sys

FAULT_STEP = 2


def in_worker(fault: str, entry, *args):
    """`entry(*args)` in a worker process, with `fault` installed in it first."""
    install(fault)
    return entry(*args)


def install(fault: str) -> None:
    import torch
    import torch.distributed as dist

    def _on_faulty_rank() -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_rank() == 1

    def _local(tensor):
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    def _announce(what: str) -> None:
        print(f"fault injected on rank 1: {what}", file=sys.stderr, flush=True)

    if fault in ("drop", "scale"):
        backward = torch.Tensor.backward
        calls = [0]

        def faulty_backward(self, *args, **kwargs):
            # (a worker's backward passes on the meta device, counting the model's FLOPs, are not training's)
            if _on_faulty_rank() and not self.is_meta:
                calls[0] += 1
                if calls[0] == FAULT_STEP:
                    self = self * 0.0 if fault == "drop" else self * (1.0 + 1e-6)
                    _announce(f"{fault} at backward {FAULT_STEP}")
            return backward(self, *args, **kwargs)

        torch.Tensor.backward = faulty_backward
    elif fault == "stale":
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        steps, saved = [0], {}

        def before(optimizer, args, kwargs):
            if _on_faulty_rank():
                steps[0] += 1
                if steps[0] == FAULT_STEP:
                    first = optimizer.param_groups[0]["params"][0]
                    saved["value"] = _local(first).detach().reshape(-1)[0].clone()

        def after(optimizer, args, kwargs):
            if "value" in saved:
                first = optimizer.param_groups[0]["params"][0]
                with torch.no_grad():
                    _local(first).reshape(-1)[0] = saved.pop("value")
                _announce(f"stale parameter after step {FAULT_STEP}")

        register_optimizer_step_pre_hook(before)
        register_optimizer_step_post_hook(after)
    else:
        raise SystemExit(f"unknown fault {fault!r}")


if os.environ.get("VERIFY_FAULT"):
    install(os.environ["VERIFY_FAULT"])
