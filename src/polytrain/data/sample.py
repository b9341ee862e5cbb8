"""The `mnist-sample` dataset: the real MNIST test set (10,000 digits) that ships inside polytrain.

The two official IDX files (`t10k-images-idx3-ubyte.gz`, `t10k-labels-idx1-ubyte.gz`, unmodified; see
`mnist_sample/README.md` for the source and licence) live in `polytrain/data/mnist_sample/` and are read with
the strict IDX reader, so the dataset needs no download and no other package.

The split is fixed, independent of `--seed`, and stratified: for each digit, the last 20% of its occurrences
in file order (rounded to the nearest whole digit, `(count + 2) // 5`) are the validation set, the rest the
training set. With the shipped files that is exactly 8,000 training and 2,000 validation digits:

    digit        0     1     2     3     4     5     6     7     8     9    total
    in file    980  1135  1032  1010   982   892   958  1028   974  1009   10,000
    validation 196   227   206   202   196   178   192   206   195   202    2,000
    training   784   908   826   808   786   714   766   822   779   807    8,000

Both splits keep file order (training first-to-last, validation first-to-last).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple, Union

import numpy as np

from ..errors import DataError
from .arrays import ArrayDataset
from .idx import NUM_CLASSES, REDOWNLOAD, read_idx

IMAGES_FILE = "t10k-images-idx3-ubyte.gz"
LABELS_FILE = "t10k-labels-idx1-ubyte.gz"
DIGITS = 10_000
IMAGE_SIZE = (28, 28)
REINSTALL = "reinstall polytrain"


def sample_dir() -> Path:
    """The folder inside the installed package that holds the two IDX files (editable or wheel install)."""
    return Path(__file__).resolve().parent / "mnist_sample"


def validation_mask(labels: np.ndarray) -> np.ndarray:
    """True for the last 20% (rounded to nearest) of each digit's occurrences in file order."""
    validation = np.zeros(len(labels), dtype=bool)
    for digit in range(NUM_CLASSES):
        where = np.flatnonzero(labels == digit)
        held_out = (len(where) + 2) // 5
        if held_out:
            validation[where[-held_out:]] = True
    return validation


def read_sample(folder: Optional[Union[str, Path]] = None) -> Tuple[np.ndarray, np.ndarray]:
    """(images uint8 [10000, 1, 28, 28], labels int64 [10000]) in file order, with every count checked."""
    folder = Path(folder) if folder is not None else sample_dir()
    images_path, labels_path = folder / IMAGES_FILE, folder / LABELS_FILE
    images = _read(images_path, 3)
    labels = _read(labels_path, 1)
    if images.shape != (DIGITS, *IMAGE_SIZE):
        raise DataError(
            f"{images_path}: expected {DIGITS} images of 28x28, found "
            f"{images.shape[0]} of {images.shape[1]}x{images.shape[2]}; {REINSTALL}"
        )
    if labels.shape != (DIGITS,):
        raise DataError(f"{labels_path}: expected {DIGITS} labels, found {labels.shape[0]}; {REINSTALL}")
    bad = np.flatnonzero(labels >= NUM_CLASSES)
    if bad.size:
        raise DataError(
            f"{labels_path}: label {labels[bad[0]]} at index {bad[0]} is outside 0..{NUM_CLASSES - 1} "
            f"({bad.size} such labels); {REINSTALL}"
        )
    # reshape, not images[:, np.newaxis]: the channel axis gets the stride of a whole image, so torch sees
    # plain NCHW tensors (stride 1 there reads as channels-last, and conv layers then return channels-last)
    return images.reshape(DIGITS, 1, *IMAGE_SIZE), labels.astype(np.int64)


def load_mnist_sample(path: Optional[Union[str, Path]] = None) -> ArrayDataset:
    """The `mnist-sample` dataset; `path` is the folder holding the two IDX files (default: the shipped copy)."""
    images, labels = read_sample(path)
    validation = validation_mask(labels)
    return ArrayDataset.from_numpy(
        "mnist-sample", images[~validation], labels[~validation], images[validation], labels[validation]
    )


def _read(path: Path, ndim: int) -> np.ndarray:
    """`read_idx`, with the fix in its one-line error changed from downloading to reinstalling polytrain."""
    try:
        return read_idx(path, expected_ndim=ndim)
    except DataError as error:
        message = str(error)
        if message.endswith(f"; {REDOWNLOAD}"):
            message = message[: -len(REDOWNLOAD)] + REINSTALL
        else:
            message = f"{message}; {REINSTALL}"
        raise DataError(message) from None
