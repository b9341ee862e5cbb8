"""Loggers people already use, beside `metrics.jsonl` and `curves.png`: TensorBoard, CSV, or any object with
Lightning's `log_metrics(metrics, step)`.

Per-epoch scalars are the exact global figures of the epoch record. Per-step scalars are the main rank's
share of each global batch (the whole batch on one device): reducing every step across ranks would add a
collective to each step. They are read from the device every `every` steps, in one copy, so logging adds no
host synchronisation to the steps in between.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

import torch

from .callbacks import Callback
from .config.registry_names import LOGGERS, check_tensorboard
from .errors import UserError
from .run_dir import atomic_write_bytes


def split_logger_argument(logger) -> Tuple[Optional[str], tuple]:
    """`fit(logger=...)`: names go into the run's settings (and are resumed), objects are called directly."""
    items = (
        []
        if logger is None
        else [logger]
        if isinstance(logger, str) or not isinstance(logger, (list, tuple))
        else list(logger)
    )
    names = [item for item in items if isinstance(item, str)]
    objects = tuple(item for item in items if not isinstance(item, str))
    for item in objects:
        if not callable(getattr(item, "log_metrics", None)):
            raise UserError(
                f"logger= takes {', '.join(map(repr, LOGGERS))} or objects with a log_metrics(metrics, "
                f"step) method; got {type(item).__name__}"
            )
    return (",".join(names) or None), objects


def make_loggers(names: Iterable[str], objects: Iterable, run_dir: Optional[Path]) -> list:
    callbacks: List[Callback] = []
    for name in names:
        if run_dir is None:
            raise UserError(f"--logger {name} writes into the run folder; pass --out DIR")
        callbacks.append(
            TensorBoard(run_dir / "tensorboard") if name == "tensorboard" else CSVLog(run_dir / "metrics.csv")
        )
    callbacks += [StepLogger(obj) for obj in objects]
    return callbacks


class StepLogger(Callback):
    """Buffers each step's loss and metric sums on the device; hands `log` a dict per step and per epoch."""

    every = 20

    def __init__(self, target=None):
        self.target = target
        self.pending: list = []

    def log(self, metrics: dict, step: int) -> None:
        self.target.log_metrics(metrics, step)

    def on_step_end(self, trainer, step):
        stats = trainer.last_stats
        values = torch.cat([stats.loss_sum.detach().reshape(1).double(), stats.metrics.detach().double()])
        global_step = trainer.position.epoch * trainer.steps_per_epoch + step + 1
        lr = trainer.strategy.optimizer.param_groups[0]["lr"]
        if stats.grad_norm is not None:  # with clipping: the global norm before clipping
            values = torch.cat([values, stats.grad_norm.detach().reshape(1).double().to(values.device)])
        loss_count = stats.loss_count  # a (sum, count) loss's count stays on the device until flush
        if isinstance(loss_count, torch.Tensor):
            values, loss_count = (
                torch.cat([values, loss_count.detach().reshape(1).double().to(values.device)]),
                None,
            )
        self.pending.append((global_step, values, stats.count, lr, loss_count))
        if len(self.pending) >= self.every or step + 1 == trainer.steps_per_epoch:
            self.flush(trainer.metric_names)

    def flush(self, names) -> None:
        if not self.pending:
            return
        rows = torch.stack([values for _, values, *_ in self.pending]).tolist()  # one copy from the device
        for (global_step, _, count, lr, loss_count), row in zip(self.pending, rows):
            if loss_count is None:
                *row, loss_count = row
            if count and loss_count:
                metrics = {"train/step_loss": row[0] / loss_count, "lr": lr}
                metrics.update({f"train/step_{name}": value / count for name, value in zip(names, row[1:])})
                if len(row) == len(names) + 2:
                    metrics["train/grad_norm"] = row[-1]
                self.log(metrics, global_step)
        self.pending = []

    def persist(self) -> None:
        """Put what `log` wrote on disk (a logger that writes files; nothing for a logger object)."""

    def close(self) -> None:
        """Close what `log` writes to, at the end of fit."""

    def before_checkpoint(self, trainer):
        self.flush(trainer.metric_names)
        self.persist()  # on disk before the checkpoint that says they were logged

    def on_epoch_end(self, trainer, record):
        self.flush(trainer.metric_names)
        numbers = {
            key: value
            for key, value in record.items()
            if isinstance(value, (int, float)) and key != "epoch" and not isinstance(value, bool)
        }
        self.log({f"epoch/{key}": value for key, value in numbers.items()}, record["epoch"])
        self.persist()

    def on_fit_end(self, trainer):
        # a run stopped within an epoch (--max-steps, a signal) logs its steps too
        self.flush(trainer.metric_names)
        self.close()


class TensorBoard(StepLogger):
    """Event files under `RUN_DIR/tensorboard` (view with `tensorboard --logdir RUN_DIR`)."""

    def __init__(self, folder: Path):
        super().__init__()
        check_tensorboard()
        self.folder, self.writer = folder, None

    def on_fit_start(self, trainer):
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run drops what its predecessor logged after the checkpoint it continues from (from the start
        # where it had none): steps are logged as the count done after them, so its first is one past the
        # checkpoint's
        self.writer = SummaryWriter(str(self.folder), purge_step=trainer.step + 1)

    def log(self, metrics: dict, step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def persist(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class StepsFile(StepLogger):
    """`steps.jsonl`: one line per optimizer step, `{"step", "loss", the metrics, "lr"}` (and "grad_norm" with
    clipping), the per-step figures without TensorBoard. Written with the other loggers' figures (the main rank's
    share of each global batch), appended every `every` steps and before each checkpoint; a resumed run drops the
    lines past the checkpoint it continues from, as it trains those steps again."""

    def __init__(self, path: Path):
        super().__init__()
        self.path, self.handle = Path(path), None

    def on_fit_start(self, trainer):
        kept = []
        if self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    step = json.loads(line)["step"]
                except (ValueError, KeyError, TypeError):  # a line cut short by a killed run: the rest too
                    break
                if step > trainer.step:
                    break
                kept.append(line + "\n")
        atomic_write_bytes(self.path, "".join(kept).encode())
        self.handle = open(self.path, "a", encoding="utf-8")

    def log(self, metrics: dict, step: int) -> None:
        if "train/step_loss" not in metrics:  # an epoch's figures: metrics.jsonl holds them
            return
        record = {"step": step}
        for key, value in metrics.items():
            record[key.removeprefix("train/").removeprefix("step_")] = value
        self.handle.write(json.dumps(record) + "\n")

    def persist(self) -> None:
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


class CSVLog(Callback):
    """`metrics.csv`: one row per epoch, rewritten whole (atomically) from the history, like metrics.jsonl."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def on_epoch_end(self, trainer, record):
        records = trainer.history.epochs
        columns = list(dict.fromkeys(key for r in records for key in r))
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(records)
        atomic_write_bytes(self.path, text.getvalue().encode())
