"""What happens around the training loop on the main rank: progress, summaries, metrics file, plots."""
from __future__ import annotations

import json
import sys
from pathlib import Path


from .checkpoint import atomic_write_bytes
from .report import save_figure


class Callback:
    def on_fit_start(self, trainer): ...
    def on_epoch_start(self, trainer, epoch): ...
    def on_step_start(self, trainer, step): ...
    def on_step_end(self, trainer, step): ...
    def on_eval_step(self, trainer, step): ...
    def on_epoch_end(self, trainer, record): ...
    def on_fit_end(self, trainer): ...


def metric_names(record: dict) -> list:
    """The metrics an epoch record holds besides the loss (acc for classification, the user's own)."""
    return [key[4:] for key in record if key.startswith("val_") and key != "val_loss"]


def summary_line(record: dict, epochs: int) -> str:
    names = metric_names(record)

    def side(split: str) -> str:
        return f"{split} loss {record[f'{split}_loss']:.4f}" + "".join(
            f" {name} {record[f'{split}_{name}']:.4f}" for name in names)
    return (f"epoch {record['epoch']}/{epochs}  {side('train')}  {side('val')}  "
            f"{record['epoch_seconds']:.2f}s  {record['samples_per_second']:,.0f} samples/s"
            + (f"  {record['note']}" if record.get("note") else ""))


class ProgressBar(Callback):
    """A tqdm bar while an epoch runs on a terminal; one plain summary line per epoch either way.

    The bar reads the running loss from the device only every `refresh_steps` steps, so it does not add
    a host synchronisation to every step.
    """

    def __init__(self, stream=None, refresh_steps: int = 20, bar: bool = None):
        self.stream = stream or sys.stdout
        self.refresh_steps = refresh_steps
        self.use_bar = self.stream.isatty() if bar is None else bar
        self.bar = None

    def on_epoch_start(self, trainer, epoch):
        if self.use_bar:
            from tqdm import tqdm
            self.bar = tqdm(total=trainer.steps_per_epoch, initial=trainer.position.step, file=self.stream,
                            desc=f"epoch {epoch + 1}/{trainer.epochs}", leave=False, dynamic_ncols=True)

    def on_step_end(self, trainer, step):
        if self.bar is not None and ((step + 1) % self.refresh_steps == 0 or step + 1 == trainer.steps_per_epoch):
            loss_sum, metric_sums, count, _ = trainer.running_totals()
            values = dict(loss=loss_sum, **dict(zip(trainer.metric_names, metric_sums)))
            self.bar.set_postfix({name: f"{value / max(count, 1):.4f}" for name, value in values.items()})
            self.bar.update(step + 1 - self.bar.n)

    def on_epoch_end(self, trainer, record):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        print(summary_line(record, trainer.epochs), file=self.stream, flush=True)


class MetricsLog(Callback):
    """`metrics.jsonl`: one JSON object per epoch, rewritten whole (atomically) from the history, so a
    resumed run never repeats or loses a line."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def on_epoch_end(self, trainer, record):
        lines = "".join(json.dumps(r) + "\n" for r in trainer.history.epochs)
        atomic_write_bytes(self.path, lines.encode())


class Curves(Callback):
    """Redraws `curves.png` (loss and each metric per epoch, train and validation) after every epoch."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def on_epoch_end(self, trainer, record):
        plot_curves(trainer.history.epochs, self.path)


def plot_curves(records, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [r["epoch"] for r in records]
    keys = ["loss", *metric_names(records[-1])]
    figure, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for axis, key in zip(axes[0], keys):
        title = {"acc": "accuracy"}.get(key, key)
        axis.plot(epochs, [r[f"train_{key}"] for r in records], "o-", label="train")
        axis.plot(epochs, [r[f"val_{key}"] for r in records], "o-", label="validation")
        axis.set_xlabel("epoch")
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.legend()
    save_figure(figure, path)


class StepRecorder(Callback):
    """Each step's loss over the whole global batch and the parameters after it (used by `verify`).

    Runs on every rank, because reducing the loss across ranks is a collective operation.
    """

    def __init__(self):
        self.steps = []
        self.previous = (0.0, 0.0)

    def on_step_end(self, trainer, step):
        totals, count, _ = trainer.running
        loss_sum, _, count = trainer.reduce_sums(totals, count)
        loss = (loss_sum - self.previous[0]) / (count - self.previous[1])
        self.previous = (loss_sum, count)
        self.steps.append((loss, trainer.strategy.flat_parameters()))
