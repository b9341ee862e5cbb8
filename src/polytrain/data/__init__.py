"""Datasets by name. Each loader returns an `ArrayDataset` of uint8 images held in memory.

The registry is the single source of the names the command line offers (`polytrain train --dataset`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, Optional

from ..errors import DataError, UserError
from .arrays import ArrayDataset

DATASETS: Dict[str, Callable[..., ArrayDataset]] = {}


def register(name: str):
    def add(loader):
        DATASETS[name] = loader
        return loader
    return add


def load_dataset(name: str, *, data_dir: Optional[str] = None, download: bool = False,
                 synthetic_size: int = 2048, synthetic_shape=(1, 28, 28), seed: int = 0) -> ArrayDataset:
    """Load a registered dataset; raise `UserError` with the fix for unknown names or missing files."""
    if name not in DATASETS:
        raise UserError(f"unknown --dataset {name!r}; choose one of {', '.join(sorted(DATASETS))}")
    return DATASETS[name](data_dir=data_dir, download=download, size=synthetic_size,
                          shape=tuple(synthetic_shape), seed=seed)


def _folder_with_files(name: str, data_dir: Optional[str], download: bool) -> Path:
    """The folder holding a file-based dataset: --data-dir as given, or the cache when downloading."""
    from .download import default_cache_dir, ensure_dataset_files

    if data_dir is not None:
        folder = Path(data_dir).expanduser()
        if not folder.is_dir() and not download:
            raise DataError(f"--data-dir {folder} does not exist; point it at the folder holding the "
                            f"{name} files, or add --download")
    else:
        folder = default_cache_dir() / name
    if download:
        folder.mkdir(parents=True, exist_ok=True)
        ensure_dataset_files(name, folder)
    elif data_dir is None:
        raise DataError(f"dataset {name!r} needs its files: pass --data-dir DIR, or add --download to fetch "
                        f"them into {folder}")
    return folder


@register("mnist-sample")
def _mnist_sample(**_) -> ArrayDataset:
    from .sample import load_mnist_sample
    return load_mnist_sample()


def _idx(name: str, data_dir, download) -> ArrayDataset:
    from .idx import load_idx_dataset
    train_x, train_y, val_x, val_y = load_idx_dataset(_folder_with_files(name, data_dir, download))
    return ArrayDataset.from_numpy(name, train_x, train_y, val_x, val_y, augment=False)


@register("mnist")
def _mnist(*, data_dir=None, download=False, **_) -> ArrayDataset:
    return _idx("mnist", data_dir, download)


@register("fashion-mnist")
def _fashion(*, data_dir=None, download=False, **_) -> ArrayDataset:
    return _idx("fashion-mnist", data_dir, download)


@register("cifar10")
def _cifar10(*, data_dir=None, download=False, **_) -> ArrayDataset:
    from .cifar import load_cifar10
    train_x, train_y, val_x, val_y = load_cifar10(_folder_with_files("cifar10", data_dir, download))
    return ArrayDataset.from_numpy("cifar10", train_x, train_y, val_x, val_y, augment=True)


@register("synthetic")
def _synthetic(*, size=2048, shape=(1, 28, 28), seed=0, **_) -> ArrayDataset:
    from .arrays import synthetic_dataset
    return synthetic_dataset(size=size, shape=shape, seed=seed)


__all__ = ["ArrayDataset", "DATASETS", "load_dataset", "register"]
