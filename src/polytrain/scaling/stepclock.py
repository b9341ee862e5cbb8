"""What each rank spent each step on, for `polytrain bench`: a callback that runs on every rank.

After `warmup` steps it times a window of `steps` steps, which all ranks start together after a barrier and
end together at a second one; the window's wall-clock time over its steps is the step time. Inside it each
rank times every step (host clock; CUDA events on a GPU) without further barriers: a barrier per step cost
3.7 ms of a 17 ms data-parallel step on 2 CPU processes, far more than it would measure. A step is split into

- data: the loader handing over the batch (the trainer times it);
- communication and idle: what the strategy attributes itself (`Strategy.phases`: a parameter server's push
  and pull, a pipeline's waits between its passes); time of the window outside the steps is idle too
  (waiting for the slowest rank at the closing barrier, callbacks);
- all-to-all: where a mixture's experts are split over ranks, the exchanges of tokens with them, which the
  expert groups time themselves (parallel/experts.py `exchange_figures`), apart from the other communication,
  with the (token, choice) pairs each rank's experts computed;
- compute: the rest.

A strategy that attributes nothing on several ranks hides its communication inside forward and backward
(DDP's bucket all-reduces, FSDP2's gathers). For it the clock also times a plain replica of the model on
the same slice, on every rank at once, after the window: its median is the compute, and the rest of the
step is communication. Every rank with others also times all-reduces of a few sizes over its process group,
the link the cost model needs, measured between the processes that train.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.distributed as dist

from ..callbacks import Callback
from ..parallel.experts import exchange_figures
from ..parallel.tensor_plan import TensorPlan
from ..strategies.holdings import local_part
from .tensor_inputs import narrowed


def held_bytes(strategy) -> int:
    """Bytes of the tensors this rank keeps between steps: its parameters (its shard, under sharding), their
    gradients, and the optimizer's parameters (a server's master weights) and state."""
    seen, total = set(), 0
    tensors = list(strategy.model.parameters())
    tensors += [p.grad for p in strategy.model.parameters() if p.grad is not None]
    for group in strategy.optimizer.param_groups:
        tensors += list(group["params"])
    tensors += [
        value
        for state in strategy.optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
    for tensor in tensors:
        part = local_part(tensor)
        key = (part.device, part.data_ptr()) if part.numel() else id(part)
        if key not in seen:
            seen.add(key)
            total += part.numel() * part.element_size()
    return total


class StepClock(Callback):
    def __init__(self, *, warmup: int, steps: int, model, reference_repeats: int = 5):
        self.warmup, self.steps = warmup, steps
        self.model = model  # the untouched model, for the compute reference
        self.reference_repeats = reference_repeats
        self.started = 0
        self.records = []  # per measured step: phases, step, data (seconds)
        self.paused, self.excluded = None, 0.0  # between epochs (evaluation) inside the window
        self.result = None  # on rank 0 at the end: every rank's records and memory

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
            self._barrier(strategy)
            self.window = time.perf_counter()
        if self.paused is not None:  # an epoch ended inside the window: its evaluation is no step
            self.excluded += time.perf_counter() - self.paused
            self.paused = None
        strategy.phases = {}
        exchange_figures(strategy.model)  # (from this step on)
        self.data = trainer.data_seconds
        self.events = None
        if strategy.device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.began = time.perf_counter()

    def on_step_end(self, trainer, step):
        if not self._measuring():
            return
        strategy = trainer.strategy
        if self.events is not None:
            self.events[1].record()
        record = dict(
            strategy.phases, step=time.perf_counter() - self.began, data=self.data, events=self.events
        )
        exchanged = exchange_figures(strategy.model)
        if exchanged is not None:
            record["routed"], record["all-to-all"] = exchanged
        self.records.append(record)
        if self.started == self.warmup + self.steps:
            self._barrier(strategy)
            self.window = time.perf_counter() - self.window - self.excluded
            self._finish(trainer)
        elif step + 1 == trainer.steps_per_epoch:
            self.paused = time.perf_counter()

    def _finish(self, trainer) -> None:
        strategy = trainer.strategy
        strategy.stop_trace()
        for record in self.records:  # GPU steps: the device's time between the events
            events = record.pop("events")
            if events is not None:
                record["step"] = events[0].elapsed_time(events[1]) / 1e3
        attributed = strategy.reduce(
            torch.tensor(
                [float(any("communication" in r or "idle" in r for r in self.records))],
                device=strategy.device,
            )
        )
        reference = None
        if strategy.world_size > 1 and float(attributed) == 0:
            reference = self._reference(trainer)
        link = self._link(strategy) if strategy.world_size > 1 else None
        peak = torch.cuda.max_memory_allocated(strategy.device) if strategy.device.type == "cuda" else None
        mine = {
            "rank": strategy.rank,
            "device": str(strategy.device),
            "steps": self.records,
            "window": self.window,
            "reference": reference,
            "held_bytes": held_bytes(strategy),
            "peak_bytes": peak,
            "threads": torch.get_num_threads(),
            "link": link,
        }
        gathered = strategy.gather_object(mine)
        if strategy.is_main:
            self.result = gathered

    def _link(
        self, strategy, sizes=(4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20), repeats: int = 10
    ) -> dict:
        """Median seconds of an all-reduce over all ranks, by message bytes."""
        timings = {}
        for size in sizes:
            tensor = torch.ones(size // 4, device=strategy.device)
            times = []
            for _ in range(repeats + 1):
                self._barrier(strategy)
                began = time.perf_counter()
                dist.all_reduce(tensor)
                strategy.synchronize()
                times.append(time.perf_counter() - began)
            timings[size] = statistics.median(times[1:])
        return timings

    def _reference(self, trainer) -> float:
        """Median seconds of a plain replica's forward, backward and update on this rank's slice, every rank
        running its own at the same time (as they share the machine during the real steps); under tensor
        parallelism, the replica's split layers cut to the rank's share (`tensor_inputs.narrowed`)."""
        strategy, batch = trainer.strategy, trainer.batch
        replica = copy.deepcopy(self.model).to(strategy.device)
        plan = getattr(strategy, "plan", None)
        if (
            isinstance(plan, TensorPlan) and plan.styles
        ):  # a tensor rank computes its share of the split layers
            replica = narrowed(replica, plan, strategy.layout.tensor) or replica
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
