"""Writers for test data in the real on-disk formats (IDX, CIFAR-10 binary), written from the format
specifications rather than from polytrain's readers, so tests compare against an independent encoding."""

from __future__ import annotations

import gzip
import io
import struct
import tarfile
from pathlib import Path

import numpy as np

CIFAR_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6)) + ("test_batch.bin",)
IDX_NAMES = {
    ("train", "images"): "train-images-idx3-ubyte",
    ("train", "labels"): "train-labels-idx1-ubyte",
    ("t10k", "images"): "t10k-images-idx3-ubyte",
    ("t10k", "labels"): "t10k-labels-idx1-ubyte",
}


def idx_bytes(array: np.ndarray) -> bytes:
    """IDX encoding of a uint8 array: 00 00 08 ndim, big-endian uint32 sizes, raw bytes."""
    array = np.asarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.tobytes(order="C")


def write_bytes(path: str | Path, data: bytes, *, gz: bool = False) -> Path:
    """Write data to path, gzip-compressed when gz is true (appending .gz if path lacks it)."""
    path = Path(path)
    if gz:
        path = path if path.suffix == ".gz" else path.with_name(path.name + ".gz")
        data = gzip.compress(data, mtime=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def write_idx(path: str | Path, array: np.ndarray, gz: bool = False) -> Path:
    """Write a uint8 array as an IDX file; returns the path written (with .gz when gz)."""
    return write_bytes(path, idx_bytes(array), gz=gz)


def random_mnist_split(n: int, *, seed: int, height: int = 28, width: int = 28):
    """(images uint8 [n,H,W], labels uint8 [n]) drawn from a seeded generator."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, height, width), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n, dtype=np.uint8)
    return images, labels


def write_mnist_folder(
    folder: str | Path,
    *,
    n_train: int = 12,
    n_val: int = 5,
    gz: bool = False,
    seed: int = 0,
    height: int = 28,
    width: int = 28,
) -> dict:
    """Write the four IDX files of a small MNIST-like dataset; returns the arrays written by split."""
    folder = Path(folder)
    splits = {
        "train": random_mnist_split(n_train, seed=seed, height=height, width=width),
        "t10k": random_mnist_split(n_val, seed=seed + 1, height=height, width=width),
    }
    for prefix, (images, labels) in splits.items():
        write_idx(folder / IDX_NAMES[prefix, "images"], images, gz=gz)
        write_idx(folder / IDX_NAMES[prefix, "labels"], labels, gz=gz)
    return splits


def cifar_batch_bytes(images: np.ndarray, labels) -> bytes:
    """CIFAR-10 binary records: per image one label byte, then 1024 R, 1024 G, 1024 B bytes."""
    images = np.asarray(images, dtype=np.uint8)
    assert images.shape[1:] == (3, 32, 32) and len(images) == len(labels)
    return b"".join(bytes([int(label)]) + image.tobytes(order="C") for image, label in zip(images, labels))


def write_cifar_batch(path: str | Path, images: np.ndarray, labels) -> Path:
    """Write one CIFAR-10 binary batch file."""
    return write_bytes(path, cifar_batch_bytes(images, labels))


def random_cifar_batches(n_per_file: int = 7, *, seed: int = 0) -> dict:
    """{file name: (images uint8 [n,3,32,32], labels uint8 [n])} for all six batch files."""
    rng = np.random.default_rng(seed)
    return {
        name: (
            rng.integers(0, 256, size=(n_per_file, 3, 32, 32), dtype=np.uint8),
            rng.integers(0, 10, size=n_per_file, dtype=np.uint8),
        )
        for name in CIFAR_FILES
    }


def cifar_tar_gz_bytes(members: dict[str, bytes]) -> bytes:
    """A .tar.gz holding each {member path: bytes} as a regular file, built in memory."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for member_path, data in members.items():
            info = tarfile.TarInfo(member_path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def write_cifar_folder(
    folder: str | Path, *, n_per_file: int = 7, seed: int = 0, layout: str = "flat"
) -> dict:
    """Write a small CIFAR-10 binary dataset; layout is 'flat', 'subdir' or 'tar'. Returns the arrays."""
    folder = Path(folder)
    batches = random_cifar_batches(n_per_file, seed=seed)
    encoded = {name: cifar_batch_bytes(*arrays) for name, arrays in batches.items()}
    if layout == "tar":
        members = {f"cifar-10-batches-bin/{name}": data for name, data in encoded.items()}
        write_bytes(folder / "cifar-10-binary.tar.gz", cifar_tar_gz_bytes(members))
    else:
        target = folder / "cifar-10-batches-bin" if layout == "subdir" else folder
        for name, data in encoded.items():
            write_bytes(target / name, data)
    return batches
