"""What each rank spent each step on, for `polytrain bench`: a callback that runs on every rank.

After `warmup` steps it times `steps` steps. Every measured step starts after a barrier, so all ranks start
it together, and ends with the device synchronised and a second barrier, whose wait is time this rank was
idle while a slower rank finished. A step's time is split into

- data: the loader handing over the batch (the trainer times it);
- communication and idle: what the strategy attributes itself (`Strategy.phases`: a parameter server's push
  and pull, a pipeline's waits between its passes), plus the wait at the closing barrier (idle);
- compute: the rest.

A strategy that attributes nothing on several ranks hides its communication inside forward and backward
(DDP's bucket all-reduces, FSDP2's gathers). For it the clock also times a plain replica of the model on
the same slice, on every rank at once, after the measured steps: its median is the compute, and the rest
of the step is communication. On a GPU the barriers synchronise the device, so host clocks time GPU work.
"""
from __future__ import annotations

import copy
import statistics
import time

import torch

from .callbacks import Callback


def held_bytes(strategy) -> int:
    """Bytes of the tensors this rank keeps between steps: its parameters (its shard, under sharding), their
    gradients, and the optimizer's parameters (a server's master weights) and state."""
    seen, total = set(), 0
    tensors = list(strategy.model.parameters())
    tensors += [p.grad for p in strategy.model.parameters() if p.grad is not None]
    for group in strategy.optimizer.param_groups:
        tensors += list(group["params"])
    tensors += [value for state in strategy.optimizer.state.values() for value in state.values()
                if isinstance(value, torch.Tensor)]
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        key = (local.device, local.data_ptr()) if local.numel() else id(local)
        if key not in seen:
            seen.add(key)
            total += local.numel() * local.element_size()
    return total


class StepClock(Callback):
    def __init__(self, *, warmup: int, steps: int, model, reference_repeats: int = 5):
        self.warmup, self.steps = warmup, steps
        self.model = model                      # the untouched model, for the compute reference
        self.reference_repeats = reference_repeats
        self.started = 0
        self.records = []                        # per measured step: phases, step, data, waiting (seconds)
        self.result = None                       # on rank 0 at the end: every rank's records and memory

    def _measuring(self) -> bool:
        return self.warmup < self.started <= self.warmup + self.steps

    def _barrier(self, strategy) -> None:
        strategy.synchronize()
        strategy.reduce(torch.zeros(1, device=strategy.device))
        strategy.synchronize()

    def on_step_start(self, trainer, step):
        self.started += 1
        if not self._measuring():
            return
        strategy = trainer.strategy
        if self.started == self.warmup + 1:
            strategy.start_trace()
            if strategy.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(strategy.device)
        strategy.phases = {}
        self._barrier(strategy)
        self.data = trainer.data_seconds
        self.began = time.perf_counter()

    def on_step_end(self, trainer, step):
        if not self._measuring():
            return
        strategy = trainer.strategy
        strategy.synchronize()
        ended = time.perf_counter()
        self._barrier(strategy)
        self.records.append(dict(strategy.phases, step=ended - self.began, data=self.data,
                                 waiting=time.perf_counter() - ended))
        if self.started == self.warmup + self.steps:
            self._finish(trainer)

    def _finish(self, trainer) -> None:
        strategy = trainer.strategy
        strategy.stop_trace()
        attributed = strategy.reduce(torch.tensor([float(any("communication" in r or "idle" in r
                                                              for r in self.records))], device=strategy.device))
        reference = None
        if strategy.world_size > 1 and float(attributed) == 0:
            reference = self._reference(trainer)
        peak = torch.cuda.max_memory_allocated(strategy.device) if strategy.device.type == "cuda" else None
        mine = {"rank": strategy.rank, "device": str(strategy.device), "steps": self.records,
                "reference": reference, "held_bytes": held_bytes(strategy), "peak_bytes": peak,
                "threads": torch.get_num_threads()}
        gathered = strategy.gather_object(mine)
        if strategy.is_main:
            self.result = gathered

    def _reference(self, trainer) -> float:
        """Median seconds of a plain replica's forward, backward and update on this rank's slice, every rank
        running its own at the same time (as they share the machine during the real steps)."""
        strategy, batch = trainer.strategy, trainer.batch
        replica = copy.deepcopy(self.model).to(strategy.device)
        if strategy.channels_last:
            replica = replica.to(memory_format=torch.channels_last)
        optimizer = torch.optim.SGD(replica.parameters(), lr=1e-6, momentum=0.9)
        times = []
        for _ in range(self.reference_repeats + 1):
            self._barrier(strategy)
            began = time.perf_counter()
            with strategy.autocast():
                outputs = replica(batch.x)
            loss = strategy.objective.loss_sum(outputs, batch.y) / max(1, len(batch.y))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            strategy.synchronize()
            times.append(time.perf_counter() - began)
        return statistics.median(times[1:])
