"""What the user hands `fit`: a dataset name, an `ArrayDataset`, four tensors, or `torch.utils.data.Dataset`s,
with a loss and metrics; turned into what the workers load, and checked on a sample before any process
starts, so that a mistake is one line here rather than an error deep inside a training step.
"""

from __future__ import annotations

import math
import pickle
import sys
from typing import Optional

import torch
import torch.nn as nn
from torch.utils.data import Dataset

from .config import TrainConfig
from .data import ArrayDataset, dataset_settings, load_dataset
from .data.order import rows
from .data.stream import DatasetPair, check_class_targets, default_workers, spec_of
from .errors import DataError, UserError, first_line
from .models import first_output, run_on_sample
from .models.lightning import LightningStep
from .models.own_loss import label_shift
from .objective import Objective, carried_loss, describe_value
from .strategy_registry import STRATEGIES


def is_torch_dataset(value) -> bool:
    return isinstance(value, Dataset) or (
        hasattr(value, "__getitem__")
        and hasattr(value, "__len__")
        and not isinstance(value, (str, bytes, tuple, list, torch.Tensor))
    )


def split_data(data, train, val, *, validates: bool = True):
    """(data, train, val) with `data=(train_ds, val_ds)` read as train= and val=; one form at a time. A run
    that never validates (`validates=False`: a LightningModule without validation_step) needs no val=."""
    if train is None and val is None:
        if isinstance(data, (tuple, list)) and len(data) == 2 and all(map(is_torch_dataset, data)):
            return None, data[0], data[1]
        if is_torch_dataset(data):
            raise UserError(
                "a single Dataset was given as data; pass train=DATASET and val=DATASET (a validation "
                "set is needed, e.g. from torch.utils.data.random_split)"
            )
        return data, None, None
    if data is not None:
        raise UserError(
            "give data either as data= (a name, an ArrayDataset or 4 tensors) or as train= and val=, not both"
        )
    if train is None or (val is None and validates):
        raise UserError(
            f"{'val' if val is None else 'train'}= is missing; pass both train= and val= Datasets"
        )
    for name, value in (("train", train), ("val", val)):
        if value is not None and not is_torch_dataset(value):
            raise UserError(
                f"{name}= must be a torch.utils.data.Dataset (with __getitem__ and __len__), "
                f"got {type(value).__name__}"
            )
    return None, train, val


def as_dataset(data, config: TrainConfig, *, verbose: bool = True) -> ArrayDataset:
    """A name, an `ArrayDataset` (or the token windows `load_dataset("shakespeare")` gives) or four tensors as
    the in-memory dataset the device-resident path loads."""
    if isinstance(data, ArrayDataset) or getattr(data, "kind", None) == "language":
        return data
    if isinstance(data, str):
        return load_dataset(data, **dataset_settings(config), verbose=verbose)
    if isinstance(data, (tuple, list)) and len(data) == 4:
        train_x, train_y, val_x, val_y = (torch.as_tensor(part) for part in data)
        classes = int(max(train_y.max(), val_y.max())) + 1 if len(train_y) and len(val_y) else 10
        return ArrayDataset("custom", train_x, train_y, val_x, val_y, num_classes=max(10, classes))
    raise UserError(
        "data must be a dataset name, what polytrain.load_dataset returns, (train_x, train_y, val_x, "
        "val_y) with uint8 images of shape (N, C, H, W), or train= and val= Datasets"
    )


def dataset_pair(
    train: Dataset, val: Dataset, *, model, objective: Objective, config: TrainConfig, names=("train", "val")
) -> DatasetPair:
    """Two `Dataset`s as a `DatasetPair`; the classes come from `train.classes`, else from the model.
    `names` are the caller's words for them in errors (`evaluate` has one `data`)."""
    spec = spec_of(train, num_classes=None, what=names[0])
    spec_of(val, num_classes=None, what=names[1])
    classes = getattr(train, "classes", None)
    if isinstance(classes, int) and not isinstance(classes, bool):
        if classes < 1:
            raise UserError(
                f"train.classes is {classes}; give the number of classes (1 or more) or a list of names"
            )
        classes = [str(label) for label in range(classes)]  # a count, as some datasets give it
    elif classes is not None and not hasattr(classes, "__len__"):
        raise UserError(
            f"train.classes is a {type(classes).__name__}; give a list of class names or their count"
        )
    width = (
        output_width(model, DatasetPair(train, val, spec))
        if isinstance(model, nn.Module)
        and classes is None
        and objective.classification
        and spec.form == "pair"
        else None
    )
    kind = "classification"
    if isinstance(width, tuple):  # scores over a vocabulary at each position of token targets
        kind, width = "language", None
    if (
        kind == "classification"
        and objective.classification
        and spec.form == "pair"
        and (width or classes is not None or not isinstance(model, nn.Module))
    ):
        check_class_targets(spec, names[0])
        if classes is not None:
            spec.num_classes = len(classes)
        elif isinstance(model, nn.Module):
            spec.num_classes = width
        else:
            raise UserError(
                f"model {model!r} needs the number of classes: give train= a .classes list (as "
                f"torchvision's datasets have), or pass your own nn.Module"
            )
    workers = config.num_workers if config.num_workers is not None else default_workers(config.devices)
    return DatasetPair(
        train,
        val,
        spec,
        num_workers=workers,
        classes=[str(c) for c in classes] if classes is not None else None,
        kind=kind,
    )


def output_width(model: nn.Module, pair: DatasetPair):
    """How many class scores the user's module gives per sample (its output's last dimension); None when its
    output carries its own loss; the output's shape (N, T, vocab) where it scores every position of targets
    that are T token ids (a language model: next-token cross-entropy, labels of -100 masked)."""
    x = pair.sample_batch(2)[0]
    output = run_on_sample(model, x, f"samples of shape {tuple(pair.input_shape)}")
    if carried_loss(output) is not None:
        return None
    output = run_model(model, x, pair.input_shape, first_output(output))
    if scores_per_token(output, pair.spec):
        return tuple(output.shape)
    if output.dim() != 2:
        raise UserError(
            f"the model must return one row of class scores per sample, shape (N, classes); it "
            f"returned shape {tuple(output.shape)} (pass loss= for another objective)"
        )
    return output.shape[1]


def scores_per_token(output: torch.Tensor, spec) -> bool:
    """Whether `output` holds scores over a vocabulary at every position of integer targets: (N, T, vocab)
    against (N, T)."""
    y_shape, y_dtype = tuple(spec.y_shape), spec.y_dtype
    return (
        output.dim() == 3
        and len(y_shape) == 1
        and output.shape[1] == y_shape[0]
        and y_dtype is not None
        and not y_dtype.is_floating_point
        and y_dtype != torch.bool
    )


def run_model(model: nn.Module, x, input_shape, output=None) -> torch.Tensor:
    output = run_on_sample(model, x, f"samples of shape {tuple(input_shape)}") if output is None else output
    if not isinstance(output, torch.Tensor) or output.shape[:1] != (rows(x),):
        got = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        if hasattr(output, "logits") and not isinstance(x, dict):  # a Hugging Face model's output
            raise UserError(
                f"the model returned a {got} without a loss: a Hugging Face model computes its own loss from "
                f"labels, so give items as dicts {{'input_ids': ids, 'labels': ids}} (labels are shifted "
                f"inside the model; -100 marks tokens not trained on), not (inputs, targets) pairs; or pass "
                f"step=fn(model, batch) returning the loss"
            )
        raise UserError(
            f"the model must return one output row per sample; for {len(x)} samples it returned {got}"
        )
    return output


def check_scores_not_probabilities(output: torch.Tensor) -> None:
    """Refuse outputs whose rows are probabilities (non-negative, summing to 1: a final Softmax, as in every
    Keras translation) for the built-in cross-entropy, which applies softmax itself: trained so, the loss stalls
    near ln(classes) with no word."""
    if not output.is_floating_point() or output.dim() < 2 or output.shape[-1] < 2 or output.is_meta:
        return  # (a model built on the meta device gives shapes, no values)
    scores = output.detach().float()
    if bool((scores >= 0).all()) and bool(((scores.sum(-1) - 1).abs() < 1e-4).all()):
        raise UserError(
            f"the model's outputs are probabilities (each row of {scores.shape[-1]} sums to 1: a final "
            f"Softmax?), and the default cross-entropy applies softmax itself, so training would stall "
            f"near loss {math.log(scores.shape[-1]):.2f}; drop the final Softmax (return scores), or pass "
            f"loss=lambda p, y: torch.nn.functional.nll_loss(torch.log(p), y)"
        )


def check_objective(model: nn.Module, objective: Objective, data) -> Objective:
    """Run the step, or the model and its loss and metrics, on two training samples; return the objective the
    run trains with: the model's own loss when its output carries one and no loss= or step= is given, and
    whether the loss gives (sum, count) pairs."""
    if isinstance(data, DatasetPair) or hasattr(data, "sample_batch"):
        x, y = data.sample_batch(2)
    else:
        x, y = data.sample_inputs(2), data.train_y[:2]
    if isinstance(objective.step, LightningStep):
        # as in Lightning, training_step first runs in training (after on_fit_start); its loss is a mean or a
        # {"loss": ...} dict, or a (sum, count) pair, learnt from its first step
        objective.counted = None
        return objective
    if objective.step is not None:
        return checked_step(model, objective, x if y is None else (x, y))
    output = run_on_sample(model, x, f"samples of shape {tuple(data.input_shape)}")
    if objective.loss is None and carried_loss(output) is not None:  # e.g. a Hugging Face model
        objective = Objective(kind="model", metrics=objective.metrics)
        objective.learn(carried_loss(output), rows(x), "the model's loss")
        if (
            not objective.counted
        ):  # a mean: summed where the model takes num_items_in_batch (models/own_loss.py)
            objective.label_shift, objective.note = label_shift(
                model,
                x,
                carried_loss(output),
                lambda batch: carried_loss(
                    run_on_sample(model, batch, "the sample batch with num_items_in_batch")
                ),
            )
            objective.counted = objective.label_shift is not None
        return objective
    if y is None:
        raise UserError(
            f"the Dataset's items are {item_form(data)}s with no separate target, and the model returned "
            f"{describe_value(output)} without a loss; return an output with .loss (or a dict with "
            f"'loss'), or pass step=fn(model, batch) that returns the loss"
        )
    output = run_model(model, x, data.input_shape, first_output(output))
    y = y.to(output.device)
    if objective.loss is None and (objective.classification or objective.language):
        check_scores_not_probabilities(output)
    if (
        objective.language
        and data.num_classes is not None
        and (output.dim() != 3 or output.shape[1] != y.shape[1] or output.shape[2] < data.num_classes)
    ):
        raise UserError(
            f"--dataset {data.name} is text for a language model: the model must return scores over "
            f"the {data.num_classes} characters for every position, shape (N, {y.shape[1]}, "
            f"{data.num_classes}); it returned {tuple(output.shape)}; use --model gpt"
        )

    def loss():
        if objective.loss is None:
            return objective.outputs_loss(output, y)
        return objective.learn(objective.loss(output, y), len(y), "loss=")

    objective.watch_balance(model)
    for what, call in (("loss=", loss), ("metrics=", lambda: objective.metric_sums(output, y))):
        try:
            call()
        except UserError:
            raise
        except Exception as error:
            raise UserError(
                f"{what} failed on the model's outputs {tuple(output.shape)} and targets "
                f"{tuple(y.shape)}: {type(error).__name__}: {first_line(error)}"
            ) from None
    return objective


@torch.no_grad()
def checked_step(model: nn.Module, objective: Objective, batch) -> Objective:
    """The user's step on a sample batch, in eval mode, on the model's device; one line if it fails."""
    from .data.order import map_tree

    first = next(model.parameters(), None)
    if first is not None:
        batch = map_tree(lambda t: t.to(first.device), batch)
    was_training = model.training
    model.eval()
    try:
        objective.learn(objective.step(model, batch), rows(batch), "step=")
    except UserError:
        raise
    except Exception as error:
        raise UserError(
            f"step= failed on two training samples: {type(error).__name__}: {first_line(error)}"
        ) from None
    finally:
        model.train(was_training)
    return objective


def item_form(data) -> str:
    """What the data's items are: "pair" ((input, target)), or "dict" or "tuple" (no separate target)."""
    return getattr(getattr(data, "spec", None), "form", "pair")


def check_sizes(data, config: TrainConfig) -> None:
    """Refuse data too small for the run: empty splits, or fewer validation samples than devices."""
    if data.num_train == 0:
        raise DataError("the training set is empty (0 samples)")
    shares = config.data_parallel_size  # a pipeline's or tensor group's ranks evaluate one share
    if data.num_val < shares:
        who = f"--devices {config.devices}" if shares == config.devices else f"the {shares} replicas"
        raise DataError(
            f"the validation set has {data.num_val} sample{'s' * (data.num_val != 1)}, fewer than "
            f"{who}: each evaluates a share; give at least {shares} validation samples"
        )


def oversized_batch_note(data, config: TrainConfig) -> Optional[str]:
    """The line that says a global batch is larger than the training set (each epoch is then one smaller step)."""
    if config.batch_size <= data.num_train:
        return None
    return (
        f"note: --batch-size {config.batch_size} is larger than the {data.num_train:,} training samples, so each "
        f"epoch is one step of {data.num_train:,}; give --batch-size {data.num_train} or less to train as asked"
    )


def make_objective(
    config: TrainConfig,
    loss=None,
    metrics=None,
    *,
    kind: str = "classification",
    step=None,
    eval_step=None,
    masks_labels: bool = True,
) -> Optional[Objective]:
    """The objective: the user's step or loss, else the built-in one of the data's `kind` (a dataset's
    `.kind`; `masks_labels`: whether its labels may be -100); check_objective may find that the model returns
    its own loss."""
    if (loss is not None or step is not None) and config.label_smoothing:
        raise UserError(
            f"label_smoothing= applies to the built-in cross-entropy; drop it or build it into "
            f"{'loss=' if loss is not None else 'step='}"
        )
    return Objective(
        loss,
        metrics,
        label_smoothing=config.label_smoothing,
        kind=kind,
        step=step,
        eval_step=eval_step,
        masks_labels=masks_labels,
    )


def refuse_for_strategy(strategy: str, config: TrainConfig, objective: Objective, data) -> None:
    """One line for what a strategy cannot do with this objective or these batches."""
    form, kind = item_form(data), STRATEGIES[strategy]
    if kind.loss_from_outputs_only and (
        objective.step is not None or objective.kind == "model" or form != "pair"
    ):
        what = (
            "step="
            if objective.step is not None
            else "a model that returns its own loss"
            if objective.kind == "model"
            else f"batches of {form}s"
        )
        raise UserError(
            f"the pipeline strategy computes the loss on its last stage from the model's outputs and "
            f"the targets, which {what} does not give; use the data or sharded strategy"
        )
    splits = not kind.keeps_model_whole or config.layout.tensor > 1
    if splits and isinstance(objective.step, LightningStep):
        raise UserError(
            f"the {strategy} strategy splits the model or moves its optimizer, which a LightningModule's "
            f"training_step and configure_optimizers are written for whole; use the data or sharded "
            f"strategy"
        )
    if config.staleness and objective.counted:
        raise UserError(
            "the loss gives (sum, count) pairs, which need each step's global count: asynchronous "
            "servers (--staleness) have no global step; drop --staleness"
        )


def check_picklable(**parts) -> None:
    """Refuse, in one line, a user object that spawned worker processes could not receive: one that does not
    pickle, or one whose class or function lives in a `__main__` they cannot import (a notebook cell, `python
    -c`, standard input), which they would fail to unpickle with "worker rank 0 failed"."""
    interactive = interactive_main()
    for name, value in parts.items():
        if value is None:
            continue
        if name == "model":
            check_hugging_face_checkpointing(value)
        try:
            pickle.dumps(value)
        except Exception as error:  # PicklingError, AttributeError or TypeError, depending on the object
            raise UserError(
                f"{name}= cannot be sent to the worker processes ({first_line(error, 160)}); define it with def/class "
                f"at the top level of an importable module (not a lambda or a notebook cell), or use "
                f"devices=1"
            ) from None
        defined = main_definitions(value) if interactive else []
        if defined:
            raise UserError(
                f"{name}= uses {defined[0]}, defined in {interactive}, which the worker processes cannot "
                f"import; put it in a module file (e.g. mymodel.py) and import it from "
                f"there, or use devices=1"
            )


def check_hugging_face_checkpointing(model) -> None:
    """Refuse, in one line, a Hugging Face model with its own activation checkpointing on, or the input hooks
    that `gradient_checkpointing_enable()` adds (which its `..._disable()` leaves): local functions that worker
    processes cannot receive. polytrain's activation_checkpointing= does the same on every layout."""
    # transformers 5 renamed gradient_checkpointing to activation_checkpointing (the old names warn)
    new = hasattr(type(model), "is_activation_checkpointing")
    on = getattr(model, "is_activation_checkpointing" if new else "is_gradient_checkpointing", False) is True
    hooks = bool(getattr(model, "_require_grads_hooks", None)) or hasattr(model, "_require_grads_hook")
    if not (on or hooks):
        return
    disable = "activation_checkpointing_disable" if new else "gradient_checkpointing_disable"
    raise UserError(
        f"model= holds the hooks of Hugging Face's gradient_checkpointing_enable(), which cannot be sent to the "
        f"worker processes; call {f'model.{disable}() and ' if on else ''}model.disable_input_require_grads(), "
        f'and pass activation_checkpointing="full" to checkpoint each block on any number of devices'
    )


def interactive_main() -> Optional[str]:
    """Where the running `__main__` came from when spawned processes cannot import it (a notebook or an
    interactive session, `python -c`, standard input); None for a script or `python -m`."""
    main = sys.modules.get("__main__")
    if (
        main is None
        or getattr(main, "__file__", None)
        or getattr(getattr(main, "__spec__", None), "name", None)
    ):
        return None
    return (
        "a notebook cell or an interactive session"
        if "IPython" in sys.modules or hasattr(sys, "ps1")
        else "the code given to python -c or on standard input"
    )


def main_definitions(value) -> list:
    """Names of the classes and functions defined in `__main__` that pickling `value` refers to."""
    import pickletools

    try:
        data = pickle.dumps(value, protocol=2)  # protocol 2 names every global in one GLOBAL opcode
    except Exception:
        return []
    return [
        arg.split(" ", 1)[1]
        for op, arg, _ in pickletools.genops(data)
        if op.name == "GLOBAL" and str(arg).startswith("__main__ ")
    ]
