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

from .callbacks import Monitor, check_logged, check_monitor
from .errors import UserError
from .optim.steps import Position, planned_steps


class NonFiniteLoss(UserError):
    """The training loss became NaN or infinite."""


@dataclass
class History:
    """What training produced: one record per epoch (`epochs`), the records of validations within epochs
    (`validations`, with `--val-every`: their epoch, step in it and global step), the monitored figure's best
    (`best`: metric, mode, value, epoch, step) and, when it ended before its epochs, why (`stopped`, one line)."""

    epochs: List[dict] = field(default_factory=list)
    validations: List[dict] = field(default_factory=list)
    best: dict = field(default_factory=dict)
    stopped: Optional[str] = None

    def __getitem__(self, key: str) -> list:
        return [record[key] for record in self.epochs]

    @property
    def last(self) -> dict:
        """The latest figures: the last epoch's record, or a record within a later epoch (a run that --max-steps
        or a stop ended within an epoch: its partial training figures, and a validation at that step);
        {} before any."""
        done = self.epochs[-1]["epoch"] if self.epochs else 0
        later = [record for record in self.validations if record.get("epoch", 0) > done]
        return later[-1] if later else self.epochs[-1] if self.epochs else {}


class Trainer:
    """Runs the epochs. Callbacks see it as `trainer`: `epoch` (the epoch in progress or just ended, from 1),
    `step` (optimizer steps done in all), `metrics` (the latest figures), `model`, `history`, and
    `should_stop`, which a callback sets to True to end training with a checkpoint (as in Lightning)."""

    def __init__(
        self,
        strategy,
        train_loader,
        val_loader,
        *,
        epochs: int,
        callbacks=(),
        resumed: Optional[dict] = None,
        checkpointer=None,
        checkpoint_every: int = 0,
        max_steps: int = 0,
        stop_vote=None,
        val_every: int = 0,
        monitor: Optional[Monitor] = None,
    ):
        self.strategy = strategy
        self.train_loader, self.val_loader = train_loader, val_loader
        self.epochs = epochs
        self.callbacks = list(callbacks)
        # where training stands: from the checkpoint a run resumes (`resumed`, as Checkpointer.save wrote it)
        self.position = Position.from_dict(resumed["position"]) if resumed else Position()
        self.history = (
            History(list(resumed["history"]), list(resumed.get("validations") or []))
            if resumed
            else History()
        )
        self.steps_per_epoch = len(train_loader)
        self.total_steps = planned_steps(epochs, self.steps_per_epoch)  # --epochs 1.5 ends within epoch 2
        self.checkpointer = checkpointer  # called on every rank; writes on the main rank only
        self.checkpoint_every = checkpoint_every
        self.max_steps = max_steps  # stop early after this many steps in all (0: never)
        self.running = None  # (loss and correct sums on the device, count, start time)
        # asked on every rank after every step with whether this rank wants a stop (a callback set should_stop);
        # True (on all ranks at once: a signal, or a request) ends training with a checkpoint
        self.stop_vote = stop_vote or (lambda requested=False: requested)
        self.should_stop = False  # a callback's request to stop (set on the main rank)
        self.interrupted = False  # the stop vote ended training
        self.val_every = val_every  # also validate every this many optimizer steps (0: never)
        self.monitor = monitor or Monitor()  # the best validation so far and the patience spent
        if resumed:
            self.monitor.restore(resumed.get("monitor"))
        self.epoch = self.position.epoch + (self.position.step > 0)
        self.latest: dict = {}  # the latest validation's record
        self.last_stats = None  # the latest step's StepStats (on the device), for loggers
        self.data_seconds = 0.0  # host time the latest batch took to arrive from the loader
        self.batch = None  # the latest batch
        # False where the objective has nothing to validate with (a LightningModule without validation_step)
        self.validates = getattr(strategy.objective, "validates", True)
        self.logs_more = getattr(strategy.objective, "logs_more", False)

    def _emit(self, event: str, *args) -> None:
        for callback in self.callbacks:
            method = getattr(callback, event, None)
            if method is not None:
                method(self, *args)

    @property
    def step(self) -> int:
        """Optimizer steps done in all (also those before a resume)."""
        return self.position.epoch * self.steps_per_epoch + self.position.step

    @property
    def global_step(self) -> int:
        """Lightning's name for `step`."""
        return self.step

    @property
    def current_epoch(self) -> int:
        """Lightning's: the epoch in progress, from 0."""
        return max(self.epoch - 1, 0)

    @property
    def max_epochs(self) -> float:
        return self.epochs

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.is_main

    @property
    def callback_metrics(self) -> dict:
        """Lightning's: the latest figures as tensors."""
        return {
            key: torch.tensor(float(value), dtype=torch.float64)
            for key, value in self.metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        }

    @property
    def model(self):
        """The plain module this rank trains (with split strategies: this rank's part of it)."""
        return self.strategy.model

    @property
    def metrics(self) -> dict:
        """The latest validation's record (the epoch's, after an epoch) and, after a step, `step_loss` and
        `step_<metric>`: that step's figures on this rank's share of the batch (read from the device here)."""
        values = dict(self.latest)
        stats = self.last_stats
        if stats is not None and stats.count:
            row = torch.cat(
                [stats.loss_sum.detach().reshape(1).double(), stats.metrics.detach().double()]
            ).tolist()
            values.update(
                {f"step_{name}": value / stats.count for name, value in zip(self.metric_names, row[1:])}
            )
            values["step_loss"] = (
                row[0] / float(stats.loss_count) if float(stats.loss_count) else float("nan")
            )
        return values

    def fit(self) -> History:
        if self.validates:
            check_monitor(self.monitor.metric, self.metric_names, logs_more=self.logs_more)
        elif self.val_every or self.monitor.patience:
            raise UserError(
                f"{'--val-every' if self.val_every else '--patience'} needs validation, and the "
                f"LightningModule has no validation_step; add one, or drop the option"
            )
        self.history.best = self.monitor.summary()
        self._emit("on_fit_start")
        try:
            if self.monitor.stopped and self.monitor.exhausted:  # a resumed run that had stopped early
                self.history.stopped = (
                    f"{self.monitor.early_stop_line()}; it had stopped there: resume with "
                    f"--patience above {self.monitor.bad} (patience= from Python) to train on"
                )
            else:
                self._run_epochs()
        finally:
            self._emit("on_fit_end")  # also on failure: e.g. the watchdog must stop watching
        return self.history

    def _save(self, position) -> None:
        """A checkpoint at `position` (with a run folder): what callbacks log up to it is written first
        (`before_checkpoint`), since a resume from it does not log those steps again."""
        if self.checkpointer is None:
            return
        self._emit("before_checkpoint")
        self.checkpointer.save(self, position)

    def _agreed(self, wanted: bool) -> bool:
        """A callback's request on the main rank, known to every rank (at epoch ends and validations)."""
        return bool(self.strategy.broadcast_object(bool(wanted)))

    def _run_epochs(self) -> None:
        while self.step < self.total_steps:
            self.epoch = self.position.epoch + 1
            record = self._train_epoch(self.position.epoch)
            if record is None:
                break
            # an epoch a fractional --epochs had ended early, completed after a resume: its record replaced
            same = bool(self.history.epochs) and self.history.epochs[-1]["epoch"] == record["epoch"]
            self.history.epochs[len(self.history.epochs) - same :] = [record]
            if self.validates:
                self._emit("on_validation_end", record)
            finished = self.max_steps and self.step >= self.max_steps
            self._emit("on_epoch_end", record)  # (loggers write the epoch's figures before the checkpoint)
            self._save(self.position)
            self.should_stop = self._agreed(self.should_stop)
            if finished or self.interrupted or self.should_stop or self.history.stopped:
                break

    def _judge(self, record: dict) -> None:
        """Every rank, after a validation: track the best (writing best.pt) and the patience."""
        self.latest = dict(record)
        check_logged(self.monitor.metric, record)
        improved = self.monitor.update(
            record[self.monitor.metric], epoch=record["epoch"], within=record.get("step", 0), step=self.step
        )
        if improved and self.checkpointer is not None:
            self.checkpointer.save_best(self)
        self.history.best = self.monitor.summary()
        self.monitor.stopped = self.monitor.exhausted and self.step < self.total_steps
        if self.monitor.stopped:
            self.history.stopped = self.monitor.early_stop_line()

    def _validate_within_epoch(self, epoch: int) -> bool:
        """A validation after the step just taken (--val-every); True when training is to stop here."""
        val = self.evaluate()
        record = {
            "epoch": epoch + 1,
            "step": self.position.step,
            "global_step": self.step,
            "val_loss": val["loss"],
            **{f"val_{name}": val[name] for name in self.metric_names},
            "lr": self.strategy.optimizer.param_groups[0]["lr"],
        }
        self._emit("on_figures", record)
        self.history.validations.append(record)
        self._judge(record)
        self._emit("on_validation_end", record)
        self.should_stop = self._agreed(self.should_stop)
        return self.should_stop or self.history.stopped is not None

    def _partial_record(self, epoch: int, step: int, totals: torch.Tensor, count: float) -> None:
        """Every rank, where --max-steps ends a run within an epoch: the training figures of the epoch's steps
        so far, among the records within epochs (metrics.jsonl, curves.png; kept by the checkpoint), merged
        into a validation taken at the same step."""
        loss_sum, loss_count, metric_sums, count = self.reduce_sums(totals, count)
        figures = {
            "partial": True,
            "train_loss": loss_sum / loss_count if loss_count else math.nan,
            **{f"train_{name}": value / count for name, value in zip(self.metric_names, metric_sums)},
        }
        last = self.history.validations[-1] if self.history.validations else {}
        if (last.get("epoch"), last.get("step")) == (epoch + 1, step):
            last.update(figures)
        else:
            self.history.validations.append(
                {
                    "epoch": epoch + 1,
                    "step": step,
                    "global_step": self.step,
                    **figures,
                    "lr": self.strategy.optimizer.param_groups[0]["lr"],
                }
            )
        self._emit("on_partial_record", self.history.validations[-1])

    def _train_epoch(self, epoch: int) -> dict:
        start = self.position
        # A resumed epoch's earlier sums are global (reduced when saved): only the main rank re-adds them.
        share = 1.0 if self.strategy.is_main else 0.0
        metrics = start.metrics or (0.0,) * len(self.metric_names)
        loss_count = start.count if start.loss_count is None else start.loss_count
        totals = torch.tensor(
            [start.loss_sum * share, loss_count * share, *(value * share for value in metrics)],
            dtype=torch.float64,
            device=self.strategy.device,
        )
        loss_total, count_total, metric_totals = totals[0], totals[1], totals[2:]  # views: updated in place
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
            count_total += stats.loss_count
            metric_totals += stats.metrics
            count += stats.count
            self.position = Position(epoch, batch.step + 1)
            self.running = (totals, count, began)
            self._emit("on_step_end", batch.step)
            done = epoch * self.steps_per_epoch + batch.step + 1
            last_of_epoch = batch.step + 1 == self.steps_per_epoch or done >= self.total_steps
            stop = False
            if self.val_every and done % self.val_every == 0 and not last_of_epoch:
                batches.close()  # (a Dataset's loader processes serve the validation too)
                paused = time.perf_counter()
                stop = self._validate_within_epoch(epoch)
                began += time.perf_counter() - paused  # the epoch's time is training time
                self.running = (totals, count, began)
                batches = self.train_loader.train_batches(epoch, start_step=batch.step + 1)
            if self.stop_vote(self.should_stop):  # a signal, or a callback's request, on any rank
                self.interrupted = self.should_stop = True
            paused = bool(self.max_steps and done >= self.max_steps)
            stop = stop or self.interrupted or paused
            if paused and not last_of_epoch:  # --max-steps: what the steps so far did, before the checkpoint
                self._partial_record(epoch, batch.step + 1, totals, count)
            due = self.checkpoint_every and (batch.step + 1) % self.checkpoint_every == 0
            # (the position's sums are reduced over the ranks: only where a checkpoint is written)
            if (due or stop) and not last_of_epoch and self.checkpointer is not None:
                self._save(self._global_position(epoch, batch.step + 1, totals, count, began))
            if stop and not last_of_epoch:
                return None
            if done >= self.total_steps:  # the last step of the run (also within an epoch)
                batches.close()
                break
        self.strategy.synchronize()
        seconds = time.perf_counter() - began
        loss_sum, loss_count, metric_sums, count = self.reduce_sums(totals, count)
        if not math.isfinite(loss_sum):
            raise NonFiniteLoss(
                f"the training loss became {loss_sum / loss_count} in epoch {epoch + 1}; the last good "
                f"weights are kept; lower --lr or use --precision fp32"
            )
        val = self.evaluate() if self.validates else None
        extras = self.strategy.epoch_figures()
        record = {
            **extras,
            "epoch": epoch + 1,
            "train_loss": loss_sum / loss_count,
            **{f"train_{name}": value / count for name, value in zip(self.metric_names, metric_sums)},
            **(
                {"val_loss": val["loss"], **{f"val_{name}": val[name] for name in self.metric_names}}
                if val
                else {}
            ),
            "epoch_seconds": seconds,
            "samples_per_second": count / seconds if seconds > 0 else float("inf"),
            "lr": self.strategy.optimizer.param_groups[0]["lr"],
        }
        tokens = getattr(self.train_loader, "tokens_per_sample", None)
        if tokens:  # a language model: nats per token, perplexity, tokens per second
            # the tokens trained: the loss's count is in windows of `tokens`, less any labelled -100
            record.update(
                **({"perplexity": math.exp(min(val["loss"], 700.0))} if val else {}),
                tokens_per_second=loss_count * tokens / seconds if seconds > 0 else float("inf"),
            )
        steps = self.position.step  # the whole epoch, or where a fractional --epochs ends it
        self.position = (
            Position(epoch + 1)
            if steps == self.steps_per_epoch
            else Position(epoch, steps, loss_sum, metric_sums, count, seconds, loss_count)
        )
        self._emit("on_figures", record)
        self.strategy.end_of_epoch(record)
        if self.validates:
            self._judge(record)
        else:
            self.latest = dict(record)
        return record

    @property
    def metric_names(self) -> tuple:
        return self.strategy.objective.names

    def reduce_sums(self, totals: torch.Tensor, count: float):
        """(loss sum, elements it covers, metric sums, samples) summed over all ranks from this rank's `totals`
        (loss sum, loss count, metric sums) and `count`: sums of counts, never means of means."""
        with_count = torch.cat(
            [totals, torch.tensor([float(count)], dtype=torch.float64, device=totals.device)]
        )
        values = self.strategy.reduce(with_count).tolist()
        return values[0], values[1], tuple(values[2:-1]), values[-1]

    def _global_position(self, epoch, step, totals, count, began) -> Position:
        loss_sum, loss_count, metric_sums, count = self.reduce_sums(totals, count)
        if not math.isfinite(loss_sum):
            raise NonFiniteLoss(
                f"the training loss became {loss_sum / loss_count} in epoch {epoch + 1} before step "
                f"{step}; the last good checkpoint is kept; lower --lr or use --precision fp32"
            )
        return Position(epoch, step, loss_sum, metric_sums, count, time.perf_counter() - began, loss_count)

    def running_totals(self):
        """(loss_sum, elements it covers, metric sums, count, seconds) of this rank's epoch so far; reads the
        device (a sync)."""
        totals, count, began = self.running
        loss_sum, loss_count, *metric_sums = totals.tolist()
        return loss_sum, loss_count, tuple(metric_sums), count, time.perf_counter() - began

    def evaluate(self, loader=None) -> dict:
        loader = loader or self.val_loader
        self.strategy.before_evaluation()
        self._emit("on_validation_start")
        totals = torch.zeros(2 + len(self.metric_names), dtype=torch.float64, device=self.strategy.device)
        count = 0
        for batch in loader.eval_batches():
            stats = self.strategy.eval_step(batch)
            self._emit("on_eval_step", batch.step)
            totals[0] += stats.loss_sum.double()
            totals[1] += stats.loss_count
            totals[2:] += stats.metrics.double()
            count += stats.count
        loss_sum, loss_count, metric_sums, count = self.reduce_sums(totals, count)
        if self.strategy.objective.counted and not loss_count > 0:
            raise UserError(
                f"the loss counted no elements in the whole validation set of {int(count)} samples; "
                f"validation needs at least one counted element (e.g. not only padding)"
            )
        return {
            "loss": loss_sum / loss_count,
            **{name: value / count for name, value in zip(self.metric_names, metric_sums)},
            "count": int(count),
        }
