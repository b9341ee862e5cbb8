"""The Python API: `fit`, `evaluate` and `predict`, the same code the command line runs.

    import polytrain
    history = polytrain.fit("lenet", "mnist-sample", epochs=3)            # names from the registries
    history = polytrain.fit(my_module, my_dataset, devices=2, strategy="data")   # or objects
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn as nn

from .checkpoint import Checkpointer, load_weights
from .config import TrainConfig
from .data import ArrayDataset, load_dataset
from .data.loader import make_loaders
from .errors import UserError
from .launch import check_devices, run_job, under_torchrun
from .models import build_model
from .run_dir import new_run_dir, read_config, write_config
from .strategies import SingleDevice, resolve_strategy_name
from .trainer import History, Trainer
from .worker import Job, choose_device


def _dataset(data, config: TrainConfig) -> ArrayDataset:
    if isinstance(data, ArrayDataset):
        return data
    if isinstance(data, str):
        return load_dataset(data, data_dir=config.data_dir, download=config.download,
                            synthetic_size=config.synthetic_size, synthetic_shape=config.synthetic_shape,
                            seed=config.seed)
    if isinstance(data, (tuple, list)) and len(data) == 4:
        return ArrayDataset("custom", *(torch.as_tensor(part) for part in data))
    raise UserError("data must be a dataset name, an ArrayDataset, or (train_x, train_y, val_x, val_y) "
                    "with uint8 images of shape (N, C, H, W)")


def train_run(config: TrainConfig, *, model: Union[str, nn.Module, None] = None, data=None,
              resume_dir: Optional[str] = None, keep_files: bool = True, verbose: bool = True):
    """Validate everything, prepare the run folder, then train on `config.devices` devices.

    Returns (history, model with the trained weights, run folder or None).
    """
    if under_torchrun():
        config.devices = int(os.environ["WORLD_SIZE"])
    strategy = resolve_strategy_name(config.strategy, config.devices)
    check_devices(config.devices if not under_torchrun() else int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                  config.device)
    dataset = _dataset(data if data is not None else config.dataset, config)
    torch.manual_seed(config.seed)
    module = build_model(model or config.model, dataset.input_shape, dataset.num_classes) \
        if model is None or isinstance(model, str) else model
    is_main = int(os.environ.get("RANK", "0")) == 0
    run_dir = None
    if resume_dir is not None:
        run_dir = Path(resume_dir)
    elif keep_files and is_main:
        run_dir = new_run_dir(config.out)
        model_name = config.model if model is None else model if isinstance(model, str) else type(model).__name__
        settings = dict(config.to_dict(), strategy=strategy, dataset=dataset.name, model=model_name)
        write_config(run_dir, settings)
    job = Job(config, strategy, dataset, module, str(run_dir) if run_dir else None,
              resume=resume_dir is not None, verbose=verbose)
    result = run_job(job)
    if result is not None:
        module.load_state_dict(result.weights)
        return result.history, module, run_dir
    return None, module, run_dir


def fit(model: Union[str, nn.Module], data: Union[str, ArrayDataset, tuple] = "mnist-sample", *,
        epochs: int = 5, devices: int = 1, strategy: str = "auto", out: Optional[str] = None,
        verbose: bool = True, **settings) -> History:
    """Train `model` (a registry name or any `nn.Module`) on `data`; return the per-epoch history.

    Every `polytrain train` flag is a keyword (`batch_size=`, `lr=`, `optimizer=`, ...). The module is
    trained in place. With `devices > 1` the module and data are pickled to the worker processes: define
    model classes in an importable module (not a notebook cell) so the workers can unpickle them.
    Files (config, metrics, checkpoints, curves) are written only when `out` is given.
    """
    config = TrainConfig(epochs=epochs, devices=devices, strategy=strategy, out=out, **settings)
    history, _, _ = train_run(config, model=model, data=data, keep_files=out is not None, verbose=verbose)
    return history


def load_run(run_dir) -> tuple:
    """(config, dataset, model with the run's trained weights) of a finished run folder."""
    settings = read_config(run_dir)
    config = TrainConfig.from_dict({k: v for k, v in settings.items() if k != "strategy"})
    dataset = load_dataset(config.dataset, data_dir=config.data_dir, download=False,
                           synthetic_size=config.synthetic_size, synthetic_shape=config.synthetic_shape,
                           seed=config.seed)
    model = build_model(config.model, dataset.input_shape, dataset.num_classes)
    load_weights(Path(run_dir) / "model.pt", model)
    return config, dataset, model


def evaluate(run_or_model, data=None, *, batch_size: int = 1024, device: str = "auto") -> dict:
    """Validation loss and accuracy of a run folder's model (or of a module on `data`)."""
    if isinstance(run_or_model, nn.Module):
        model, dataset = run_or_model, _dataset(data, TrainConfig())
    else:
        _, dataset, model = load_run(run_or_model)
        dataset = _dataset(data, TrainConfig()) if data is not None else dataset
    strategy = SingleDevice(device=choose_device(device, 0))
    strategy.model = model.to(strategy.device)
    _, val = make_loaders(dataset, batch_size=batch_size, device=strategy.device)
    return Trainer(strategy, val, val, epochs=0).evaluate()


@torch.no_grad()
def predict(run_dir, *, count: Optional[int] = None, device: str = "auto") -> dict:
    """Predicted and true labels (and uint8 images) of `count` validation samples of a run, spread evenly
    over the validation set (all of them when `count` is None)."""
    _, dataset, model = load_run(run_dir)
    dev = choose_device(device, 0)
    model = model.to(dev).eval()
    _, val = make_loaders(dataset, batch_size=1024, device=dev)
    predicted = torch.cat([model(batch.x).argmax(1).cpu() for batch in val.eval_batches()])
    total = len(predicted)
    count = total if count is None else max(0, min(count, total))
    # evenly spaced over the split, so a class-sorted validation set still shows every class
    index = torch.linspace(0, total - 1, count).round().long() if count < total else torch.arange(total)
    return {"index": index, "images": dataset.val_x[index], "predicted": predicted[index],
            "true": dataset.val_y[index]}
