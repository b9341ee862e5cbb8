"""The epoch loop: steps through a strategy, reduces metrics across ranks, hands them to callbacks.

Nothing here depends on which strategy runs the steps. Per-step work stays on the device: losses and
correct counts accumulate in a device tensor and are read back once per epoch (and when a callback asks).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from .errors import UserError


class NonFiniteLoss(UserError):
    """The training loss became NaN or infinite."""


@dataclass
class Position:
    """Where training stands: the next step to run, and the running sums of the epoch in progress."""
    epoch: int = 0
    step: int = 0
    loss_sum: float = 0.0
    metrics: tuple = ()           # the objective's metric sums, in the order of its names
    count: float = 0.0
    seconds: float = 0.0

    @classmethod
    def from_dict(cls, values: dict) -> "Position":
        values = dict(values)
        if "correct" in values:        # checkpoints written before metrics were generalised
            values["metrics"] = (values.pop("correct"),)
        values["metrics"] = tuple(values.get("metrics", ()))
        return cls(**values)


@dataclass
class History:
    epochs: List[dict] = field(default_factory=list)

    def __getitem__(self, key: str) -> list:
        return [record[key] for record in self.epochs]

    @property
    def last(self) -> dict:
        return self.epochs[-1] if self.epochs else {}


class Trainer:
    def __init__(self, strategy, train_loader, val_loader, *, epochs: int, callbacks=(),
                 position: Optional[Position] = None, history: Optional[History] = None,
                 checkpointer=None, checkpoint_every: int = 0, max_steps: int = 0, should_stop=None):
        self.strategy = strategy
        self.train_loader, self.val_loader = train_loader, val_loader
        self.epochs = epochs
        self.callbacks = list(callbacks)
        self.position = position or Position()
        self.history = history or History()
        self.steps_per_epoch = len(train_loader)
        self.checkpointer = checkpointer          # called on every rank; writes on the main rank only
        self.checkpoint_every = checkpoint_every
        self.max_steps = max_steps                # stop early after this many steps in all (0: never)
        self.running = None                       # (loss and correct sums on the device, count, start time)
        # asked on every rank after every step; True (on all ranks at once) ends training with a checkpoint
        self.should_stop = should_stop or (lambda: False)
        self.interrupted = False
        self.last_stats = None                    # the latest step's StepStats (on the device), for loggers
        self.data_seconds = 0.0                   # host time the latest batch took to arrive from the loader
        self.batch = None                         # the latest batch

    def _emit(self, event: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, event)(self, *args)

    def fit(self) -> History:
        self._emit("on_fit_start")
        try:
            self._run_epochs()
        finally:
            self._emit("on_fit_end")       # also on failure: e.g. the watchdog must stop watching
        return self.history

    def _run_epochs(self) -> None:
        while self.position.epoch < self.epochs:
            record = self._train_epoch(self.position.epoch)
            if record is None:
                break
            self.history.epochs.append(record)
            self.position = Position(epoch=self.position.epoch + 1)
            finished = self.max_steps and self.position.epoch * self.steps_per_epoch >= self.max_steps
            if self.checkpointer is not None:
                self.checkpointer.save(self, self.position)
            self._emit("on_epoch_end", record)
            if finished or self.interrupted:
                break

    def _train_epoch(self, epoch: int) -> dict:
        start = self.position
        # A resumed epoch's earlier sums are global (reduced when saved): only the main rank re-adds them.
        share = 1.0 if self.strategy.is_main else 0.0
        metrics = start.metrics or (0.0,) * len(self.metric_names)
        totals = torch.tensor([start.loss_sum * share, *(value * share for value in metrics)],
                              dtype=torch.float64, device=self.strategy.device)
        loss_total, metric_totals = totals[0], totals[1:]        # views: updated in place, one kernel each
        count = start.count * share
        self._emit("on_epoch_start", epoch)
        self.strategy.synchronize()
        began = time.perf_counter() - start.seconds
        batches = self.train_loader.train_batches(epoch, start_step=start.step)
        while True:
            fetching = time.perf_counter()
            batch = next(batches, None)
            if batch is None:
                break
            self.data_seconds, self.batch = time.perf_counter() - fetching, batch
            self._emit("on_step_start", batch.step)
            stats = self.strategy.train_step(batch)
            self.last_stats = stats
            loss_total += stats.loss_sum
            metric_totals += stats.metrics
            count += stats.count
            self.position = Position(epoch, batch.step + 1)
            self.running = (totals, count, began)
            self._emit("on_step_end", batch.step)
            last_of_epoch = batch.step + 1 == self.steps_per_epoch
            self.interrupted = self.should_stop()
            done = epoch * self.steps_per_epoch + batch.step + 1
            stop = self.interrupted or (self.max_steps and done >= self.max_steps)
            due = self.checkpoint_every and (batch.step + 1) % self.checkpoint_every == 0
            if (due or stop) and not last_of_epoch and self.checkpointer is not None:
                self.checkpointer.save(self, self._global_position(epoch, batch.step + 1, totals, count, began))
            if stop and not last_of_epoch:
                return None
        self.strategy.synchronize()
        seconds = time.perf_counter() - began
        loss_sum, metric_sums, count = self.reduce_sums(totals, count)
        if not math.isfinite(loss_sum):
            raise NonFiniteLoss(f"the training loss became {loss_sum / count} in epoch {epoch + 1}; the last good "
                                f"weights are kept; lower --lr or use --precision fp32")
        val = self.evaluate()
        extras = self.strategy.epoch_extras()
        return {**extras, "epoch": epoch + 1, "train_loss": loss_sum / count,
                **{f"train_{name}": value / count for name, value in zip(self.metric_names, metric_sums)},
                "val_loss": val["loss"], **{f"val_{name}": val[name] for name in self.metric_names},
                "epoch_seconds": seconds, "samples_per_second": count / seconds if seconds > 0 else float("inf"),
                "lr": self.strategy.optimizer.param_groups[0]["lr"]}

    @property
    def metric_names(self) -> tuple:
        return self.strategy.objective.names

    def reduce_sums(self, totals: torch.Tensor, count: float):
        """(loss_sum, metric sums, count) summed over all ranks: sums of counts, never means of means."""
        with_count = torch.cat([totals, torch.tensor([float(count)], dtype=torch.float64, device=totals.device)])
        values = self.strategy.reduce(with_count).tolist()
        return values[0], tuple(values[1:-1]), values[-1]

    def _global_position(self, epoch, step, totals, count, began) -> Position:
        loss_sum, metric_sums, count = self.reduce_sums(totals, count)
        if not math.isfinite(loss_sum):
            raise NonFiniteLoss(f"the training loss became {loss_sum / count} in epoch {epoch + 1} before step "
                                f"{step}; the last good checkpoint is kept; lower --lr or use --precision fp32")
        return Position(epoch, step, loss_sum, metric_sums, count, time.perf_counter() - began)

    def running_totals(self):
        """(loss_sum, metric sums, count, seconds) of this rank's epoch so far; reads the device (a sync)."""
        totals, count, began = self.running
        loss_sum, *metric_sums = totals.tolist()
        return loss_sum, tuple(metric_sums), count, time.perf_counter() - began

    def evaluate(self, loader=None) -> dict:
        loader = loader or self.val_loader
        self.strategy.before_evaluation()
        totals = torch.zeros(1 + len(self.metric_names), dtype=torch.float64, device=self.strategy.device)
        count = 0
        for batch in loader.eval_batches():
            stats = self.strategy.eval_step(batch)
            self._emit("on_eval_step", batch.step)
            totals[0] += stats.loss_sum.double()
            totals[1:] += stats.metrics.double()
            count += stats.count
        loss_sum, metric_sums, count = self.reduce_sums(totals, count)
        return {"loss": loss_sum / count, **{name: value / count for name, value in zip(self.metric_names, metric_sums)},
                "count": int(count)}
