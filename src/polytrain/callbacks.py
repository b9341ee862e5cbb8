"""What happens around the training loop on the main rank: progress, summaries, metrics file, plots."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .errors import ConfigError
from .report import save_figure
from .run_dir import atomic_write_bytes


class Callback:
    """polytrain's own callbacks (user callbacks are plain objects, see `UserCallbacks`)."""

    def on_fit_start(self, trainer): ...
    def on_epoch_start(self, trainer, epoch): ...
    def on_step_start(self, trainer, step): ...
    def on_step_end(self, trainer, step): ...
    def on_eval_step(self, trainer, step): ...
    def on_validation_start(self, trainer): ...  # every rank, before a validation pass
    def on_figures(self, trainer, record): ...  # every rank, before a record is judged: may add figures
    def on_validation_end(self, trainer, record): ...
    def on_epoch_end(self, trainer, record): ...
    def before_checkpoint(self, trainer): ...  # before each checkpoint: write what was logged up to it
    def on_fit_end(self, trainer): ...


def monitor_names(metric_names) -> list:
    """The figures `--monitor` may name: those of every validation record."""
    return ["val_loss", *(f"val_{name}" for name in metric_names)]


def check_monitor(metric: str, metric_names, *, logs_more: bool = False) -> None:
    """Refuse a --monitor that names no validation figure of the run. `logs_more`: the model logs figures of
    its own (a LightningModule's `self.log`), known at its first validation; any `val_` name waits for it."""
    available = monitor_names(metric_names)
    if metric not in available and not (logs_more and metric.startswith("val_")):
        raise ConfigError(
            f"--monitor {metric!r} is not a validation figure of this run; choose one of "
            f"{', '.join(available)}"
        )


# Figures where lower is better besides losses: errors and perplexity (Keras' `auto` mode minimises all but
# accuracies; the rule here also maximises a user's own score, such as val_f1 or val_iou).
LOWER_IS_BETTER = ("loss", "error", "err", "mae", "mse", "rmse", "perplexity", "ppl", "cer", "wer")


def check_logged(metric: str, record: dict) -> None:
    """After a validation: the monitored figure is among those the validation gave (a LightningModule's
    validation_step may not have logged it)."""
    if metric not in record:
        given = sorted(key for key in record if key.startswith("val_"))
        raise ConfigError(
            f"monitor={metric!r} is not a figure the validation gave (it gave {', '.join(given)}); "
            f"log it in validation_step with self.log({metric!r}, value), or monitor one of those"
        )


def monitor_mode(metric: str) -> str:
    """min for losses, errors and perplexity; max for everything else (accuracy, F1, IoU, ...)."""
    words = metric.lower().replace("-", "_").split("_")
    return "min" if "loss" in metric or any(word in LOWER_IS_BETTER for word in words) else "max"


@dataclass
class Monitor:
    """The best value of the monitored validation figure so far, where it was, and the patience spent.

    Every rank keeps one and updates it with the same reduced figures, so every rank takes the same
    decisions (best.pt, early stopping) without talking to the others."""

    metric: str = "val_loss"
    mode: Optional[str] = None  # min or max; None: min for names containing "loss", max otherwise
    patience: int = 0  # stop after this many validations in a row without improvement (0: never)
    best: Optional[float] = None
    epoch: int = 0  # the epoch (from 1) of the best validation
    within: int = 0  # its step within that epoch (0: at the epoch's end)
    step: int = 0  # optimizer steps done in all at the best validation
    bad: int = 0  # validations since the best, none better
    stopped: bool = False  # training stopped early here (kept, so a resume says so)

    def __post_init__(self):
        self.mode = self.mode or monitor_mode(self.metric)

    def update(self, value: float, *, epoch: int, within: int, step: int) -> bool:
        """Count one validation's value; True when it is the best so far (NaN never is)."""
        better = math.isfinite(value) and (
            self.best is None or (value < self.best if self.mode == "min" else value > self.best)
        )
        if better:
            self.best, self.epoch, self.within, self.step, self.bad = float(value), epoch, within, step, 0
        else:
            self.bad += 1
        return better

    @property
    def exhausted(self) -> bool:
        return self.patience > 0 and self.bad >= self.patience

    def where(self) -> str:
        return f"epoch {self.epoch}" + (f", step {self.within}" if self.within else "")

    def early_stop_line(self) -> str:
        return (
            f"early stop: {self.metric} has not improved for {self.bad} validation{'s' * (self.bad != 1)} "
            f"(best {self.best:.4g} at {self.where()})"
        )

    def summary(self) -> dict:
        """What the history says of the best: the metric, whether lower or higher is better, value and place."""
        if self.best is None:
            return {}
        return dict(
            metric=self.metric,
            mode=self.mode,
            value=self.best,
            epoch=self.epoch,
            step=self.within or None,
            global_step=self.step,
        )

    def state(self) -> dict:
        """What a checkpoint keeps, so that a resume goes on with the same best and patience."""
        return dict(
            best=self.best,
            epoch=self.epoch,
            within=self.within,
            step=self.step,
            bad=self.bad,
            stopped=self.stopped,
        )

    def restore(self, state) -> None:
        if isinstance(state, dict):
            for key, value in state.items():
                if key in self.state():
                    setattr(self, key, value)


def metric_names(record: dict) -> list:
    """The metrics an epoch record holds besides the loss (acc for classification, the user's own, what a
    LightningModule logged), each once, whether the record has it for training, validation or both."""
    names = [key.split("_", 1)[1] for key in record if key.startswith(("train_", "val_"))]
    return [name for name in dict.fromkeys(names) if name != "loss"]


def figures(record: dict, split: str, names) -> str:
    """ " loss 0.1234 acc 0.9000" of one split, for the figures the record has (none: no validation ran)."""
    return "".join(
        f" {name} {record[f'{split}_{name}']:.4f}" for name in ("loss", *names) if f"{split}_{name}" in record
    )


def summary_line(record: dict, epochs: float) -> str:
    names = metric_names(record)
    sides = "".join(
        f"  {split}{figures(record, split, names)}" for split in ("train", "val") if f"{split}_loss" in record
    )
    if "tokens_per_second" in record:  # a language model: loss in nats per token
        perplexity = f" perplexity {record['perplexity']:.2f}" if "perplexity" in record else ""
        return (
            f"epoch {record['epoch']}/{epochs:g}{sides}{perplexity}  {record['epoch_seconds']:.2f}s  "
            f"{record['tokens_per_second']:,.0f} tokens/s"
            + (f"  {record['note']}" if record.get("note") else "")
        )
    return (
        f"epoch {record['epoch']}/{epochs:g}{sides}  "
        f"{record['epoch_seconds']:.2f}s  {record['samples_per_second']:,.0f} samples/s"
        + (f"  {record['note']}" if record.get("note") else "")
    )


def steps_this_epoch(trainer, epoch: int) -> int:
    """Up to which step of epoch `epoch` (from 0) the run trains: all of them, but fewer in an epoch where
    fractional --epochs or --max-steps ends it."""
    steps = trainer.steps_per_epoch
    end = getattr(trainer, "total_steps", None) or (epoch + 1) * steps
    if getattr(trainer, "max_steps", 0):
        end = min(end, trainer.max_steps)
    return max(1, min(steps, end - epoch * steps))


class ProgressBar(Callback):
    """A tqdm bar while an epoch runs on a terminal; one plain summary line per epoch either way.

    The bar reads the running loss from the device only every `refresh_steps` steps, so it does not add
    a host synchronisation to every step.
    """

    def __init__(self, stream=None, refresh_steps: int = 20, bar: bool = None, every_seconds: float = 10.0):
        self.stream = stream or sys.stdout
        self.refresh_steps = refresh_steps
        self.use_bar = self.stream.isatty() if bar is None else bar
        self.bar = None
        # off a terminal (a log file, a notebook), a line every `every_seconds` within an epoch: a long epoch
        # (the GPT's single default one) is not silent for minutes
        self.every_seconds = every_seconds
        self.next_line = math.inf

    def on_epoch_start(self, trainer, epoch):
        self.next_line = time.monotonic() + self.every_seconds
        self.start_step = trainer.position.step  # a resumed epoch's earlier steps are not this pass's
        self.end = steps_this_epoch(trainer, epoch)
        if self.use_bar:
            from tqdm import tqdm

            self.bar = tqdm(
                total=self.end,
                initial=trainer.position.step,
                file=self.stream,
                desc=f"epoch {epoch + 1}/{trainer.epochs:g}",
                leave=False,
                dynamic_ncols=True,
            )

    def on_step_end(self, trainer, step):
        if self.bar is None and time.monotonic() >= self.next_line and step + 1 < self.end:
            self.next_line = time.monotonic() + self.every_seconds
            loss_sum, loss_count, _, _, seconds = trainer.running_totals()
            done = step + 1 - self.start_step
            left = seconds / max(done, 1) * (self.end - step - 1)
            until = (
                "in the epoch"
                if self.end == trainer.steps_per_epoch
                else f"until step {self.end}, where the run stops"
            )
            print(
                f"epoch {trainer.epoch}/{trainer.epochs:g} step {step + 1}/{trainer.steps_per_epoch}  train loss "
                f"{loss_sum / max(loss_count, 1):.4f}  {seconds:.0f}s, about {left:.0f}s left {until}",
                file=self.stream,
                flush=True,
            )
        if self.bar is not None and ((step + 1) % self.refresh_steps == 0 or step + 1 == self.end):
            loss_sum, loss_count, metric_sums, count, _ = trainer.running_totals()
            values = dict(
                loss=loss_sum / max(loss_count, 1),
                **{name: value / max(count, 1) for name, value in zip(trainer.metric_names, metric_sums)},
            )
            self.bar.set_postfix({name: f"{value:.4f}" for name, value in values.items()})
            self.bar.update(step + 1 - self.bar.n)

    def on_validation_end(self, trainer, record):
        if "step" not in record:  # the epoch's own: its summary line follows
            return
        line = (
            f"epoch {record['epoch']}/{trainer.epochs:g} step {record['step']}/{trainer.steps_per_epoch}  "
            f"val{figures(record, 'val', metric_names(record))}"
        )
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def on_epoch_end(self, trainer, record):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        print(summary_line(record, trainer.epochs), file=self.stream, flush=True)


class MetricsLog(Callback):
    """`metrics.jsonl`: one JSON object per epoch, rewritten whole (atomically) from the history, so a
    resumed run never repeats or loses a line. With --val-every, the validations within epochs come in order
    between them, told apart by their `step` (within the epoch) and `global_step`; the record of the best
    validation of --monitor carries `"best": true`."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def on_validation_end(self, trainer, record):
        self.write(trainer)

    def on_epoch_end(self, trainer, record):
        self.write(trainer)

    def on_partial_record(self, trainer, record):  # a run ended by --max-steps within an epoch
        self.write(trainer)

    def write(self, trainer) -> None:
        lines = "".join(json.dumps(r) + "\n" for r in metrics_lines(trainer.history))
        atomic_write_bytes(self.path, lines.encode())


def metrics_lines(history) -> list:
    """The records of `metrics.jsonl`: epoch records and validations within epochs in the order they ran."""
    within = {(r["epoch"], r["step"]): r for r in history.validations}
    best = history.best or {}
    place = (best.get("epoch"), best.get("step") or None)
    ordered = []
    for record in history.epochs:
        ordered += [r for key, r in sorted(within.items()) if key[0] == record["epoch"]]
        ordered.append(record)
    done = history.epochs[-1]["epoch"] if history.epochs else 0
    ordered += [r for key, r in sorted(within.items()) if key[0] > done]
    return [dict(r, best=True) if (r["epoch"], r.get("step")) == place else r for r in ordered]


class Curves(Callback):
    """Redraws `curves.png` (loss and each metric, train and validation) after every epoch and every validation
    within one (--val-every), those placed at the fraction of the epoch they came after: a one-epoch run is a
    curve, not two dots."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def on_epoch_end(self, trainer, record):
        plot_curves(
            trainer.history.epochs,
            self.path,
            within=trainer.history.validations,
            steps_per_epoch=trainer.steps_per_epoch,
        )

    def on_validation_end(self, trainer, record):
        if "step" in record:  # within an epoch (the epoch's own is drawn at its end)
            self.on_epoch_end(trainer, record)

    on_partial_record = on_validation_end  # a run ended by --max-steps within an epoch


def plot_curves(records, path: Path, *, within=(), steps_per_epoch: int = 1) -> dict:
    """Draw `curves.png`; returns what it drew: (figure, split) -> [(epoch, value), ...]."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not records and not within:
        return {}
    drawn = {}
    # every record at the epoch (a fraction within one) it came after
    points = sorted(
        [(r["epoch"] - 1 + r["step"] / steps_per_epoch, r) for r in within]
        + [(r["epoch"], r) for r in records],
        key=lambda point: point[0],
    )
    keys = ["loss", *metric_names((records or within)[-1])]
    figure, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for axis, key in zip(axes[0], keys):
        title = {"acc": "accuracy"}.get(key, key)
        for split, label in (("train", "train"), ("val", "validation")):
            shown = [(x, r[f"{split}_{key}"]) for x, r in points if f"{split}_{key}" in r]
            if shown:
                axis.plot(*zip(*shown), "o-", label=label, markersize=3 if len(shown) > 20 else 6)
                drawn[key, split] = shown
        axis.set_xlabel("epoch")
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.legend()
    save_figure(figure, path)
    return drawn


class StepRecorder(Callback):
    """Each step's loss over the whole global batch and the parameters after it (used by `verify`).

    Runs on every rank, because reducing the loss across ranks is a collective operation.
    """

    def __init__(self):
        self.steps = []
        self.previous = (0.0, 0.0)

    def on_step_end(self, trainer, step):
        totals, count, _ = trainer.running
        loss_sum, count, _, _ = trainer.reduce_sums(totals, count)
        loss = (loss_sum - self.previous[0]) / (count - self.previous[1])
        self.previous = (loss_sum, count)
        self.steps.append((loss, trainer.strategy.flat_parameters()))
