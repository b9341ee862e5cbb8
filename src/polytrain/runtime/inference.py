"""Using a finished run: `evaluate` and `predict` (the Python API's and the command line's), and the weights
a run folder keeps."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from ..config import STRATEGY_FLAGS, TrainConfig
from ..data import ArrayDataset, dataset_settings, load_dataset
from ..data.loader import make_loaders
from ..errors import UserError
from ..models import build_model, text_vocabulary
from ..run_dir import read_config
from ..sources import as_dataset, check_objective, dataset_pair, is_torch_dataset, make_objective
from ..strategies import Strategy
from ..trainer import Trainer
from .checkpoint import load_weights
from .launch import check_devices
from .worker import choose_device

# The weights a run folder keeps: --weights NAME reads the file.
WEIGHTS = {"final": "model.pt", "best": "best.pt"}


def weights_file(run_dir, weights: str = "final") -> Path:
    """The file of the run's `weights`: final (model.pt, the last weights) or best (best.pt)."""
    if weights not in WEIGHTS:
        raise UserError(f"unknown weights {weights!r}; choose final (model.pt) or best (best.pt)")
    path = Path(run_dir) / WEIGHTS[weights]
    if weights == "best" and not path.is_file() and (Path(run_dir) / "model.pt").is_file():
        raise UserError(
            f"{run_dir} has no best.pt (a run writes it at its first validation; runs of earlier "
            f"versions have none); use --weights final"
        )
    return path


def load_run(run_dir, *, weights: str = "final") -> tuple:
    """(config, dataset, model with the run's trained weights) of a finished run folder; `weights="best"`
    loads best.pt, the weights of the best validation of the run's --monitor."""
    settings = read_config(run_dir)
    path = weights_file(run_dir, weights)
    if settings.get("custom_model"):
        raise UserError(
            f"{run_dir} was trained on a custom model ({settings.get('model')}); evaluate it from "
            f"Python: polytrain.evaluate(model, data) after loading {path} into it"
        )
    if settings.get("custom_data"):
        raise UserError(
            f"{run_dir} was trained on an in-memory dataset; evaluate it from Python with "
            f"polytrain.evaluate(model, data)"
        )
    how = ("strategy", *STRATEGY_FLAGS, "logger")  # how it trained does not matter to the weights
    config = TrainConfig.from_dict({k: v for k, v in settings.items() if k not in how})
    dataset = load_dataset(config.dataset, **dict(dataset_settings(config), download=False))
    model = build_model(
        config.model, dataset.input_shape, dataset.num_classes, config, vocabulary=text_vocabulary(dataset)
    )
    load_weights(path, model)
    return config, dataset, model


def evaluate(
    run_or_model,
    data=None,
    *,
    loss=None,
    metrics=None,
    batch_size: int = 1024,
    device: str = "auto",
    num_workers: int = 0,
    weights: str = "final",
) -> dict:
    """Validation loss and metrics (accuracy for classification) of a run folder's model (`weights="best"`:
    its best.pt), or of a module on `data`: a dataset name, an ArrayDataset, 4 tensors, or a
    `torch.utils.data.Dataset` to evaluate on."""
    objective = make_objective(TrainConfig(), loss, metrics)
    if isinstance(run_or_model, nn.Module):
        model, dataset = run_or_model, None
    else:
        _, dataset, model = load_run(run_or_model, weights=weights)
        if getattr(dataset, "kind", "classification") != "classification" and loss is None:
            objective = make_objective(TrainConfig(), loss, metrics, kind=dataset.kind)
    if is_torch_dataset(data):
        config = TrainConfig(num_workers=num_workers)
        dataset = dataset_pair(
            data, data, model=model, objective=objective, config=config, names=("data", "data")
        )
        if dataset.kind == "language" and objective.classification:  # token targets: next-token loss
            objective = make_objective(config, loss, metrics, kind=dataset.kind)
    elif data is not None or dataset is None:
        dataset = as_dataset(data, TrainConfig())
    check_devices(1, device)
    strategy = Strategy(device=choose_device(device, 0), objective=objective)
    objective = check_objective(model, objective, dataset)
    strategy.objective = objective
    first = next(model.parameters(), None)
    home, was_training = (first.device if first is not None else strategy.device), model.training
    strategy.model = model.to(strategy.device)
    _, val = make_loaders(dataset, batch_size=batch_size, device=strategy.device)
    try:
        return Trainer(strategy, val, val, epochs=0).evaluate()
    finally:
        model.to(home).train(was_training)  # leave the caller's module where and as it was


def spread_indices(total: int, count: Optional[int]) -> torch.Tensor:
    """`count` indices evenly spaced over 0..total-1 (all when None), so a class-sorted validation set
    still shows every class."""
    count = total if count is None else max(0, min(count, total))
    return torch.linspace(0, total - 1, count).round().long() if count < total else torch.arange(total)


@torch.no_grad()
def predict(run_dir, *, count: Optional[int] = None, device: str = "auto", weights: str = "final") -> dict:
    """Predicted and true labels (and uint8 images; None for a text classifier's texts) of `count` validation
    samples of a run, spread evenly over the validation set (all of them when `count` is None);
    `weights="best"` uses its best.pt."""
    check_devices(1, device)
    config, dataset, model = load_run(run_dir, weights=weights)
    if getattr(dataset, "kind", "classification") != "classification":
        raise UserError(
            f"predict shows the labels an image classifier gives; {run_dir} is a language model (--model "
            f"{config.model} on --dataset {config.dataset}): sample its text with polytrain generate "
            f"{run_dir}"
        )
    dev = choose_device(device, 0)
    model = model.to(dev).eval()
    _, val = make_loaders(dataset, batch_size=1024, device=dev)
    predicted, true = [], []
    for batch in val.eval_batches():
        predicted.append(model(batch.x).argmax(1).cpu())
        true.append(batch.y.cpu())
    predicted = torch.cat(predicted)
    index = spread_indices(len(predicted), count)
    images = dataset.val_x[index] if isinstance(dataset, ArrayDataset) else None  # (texts: a classifier's)
    return {
        "index": index,
        "images": images,
        "predicted": predicted[index],
        "true": torch.cat(true)[index],
        "classes": getattr(dataset, "classes", None),
    }
