"""Reader for the IDX files of MNIST-style datasets (plain or gzip), with strict validation.

Every malformed input raises `DataError` with one line naming the file, the problem and the fix.
A header is checked against the file before any payload buffer is allocated.
"""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from pathlib import Path
from typing import BinaryIO

import numpy as np

from polytrain.errors import DataError

UNSIGNED_BYTE = 0x08
MAX_PAYLOAD_BYTES = 2 * 1024**3  # far above any IDX dataset; stops a lying header early
CHUNK_BYTES = 1 << 20
REDOWNLOAD = "download it again or pass --download"
MISSING_FIX = "put the four official IDX files there or add --download"
NUM_CLASSES = 10


def read_idx(path: str | Path, *, expected_ndim: int | None = None) -> np.ndarray:
    """Read an unsigned-byte IDX file (optionally gzip-compressed) into a uint8 array."""
    path = Path(path)
    is_gzip = path.suffix == ".gz"
    try:
        with gzip.open(path, "rb") if is_gzip else open(path, "rb") as stream:
            shape, header_bytes = _read_header(stream, path, expected_ndim)
            claimed = math.prod(shape)
            if claimed > MAX_PAYLOAD_BYTES:
                _fail(
                    path,
                    f"header claims {claimed} bytes of data, over the "
                    f"{MAX_PAYLOAD_BYTES // 1024**3} GiB limit, so the header is corrupt",
                )
            if not is_gzip:
                _check_plain_size(path, header_bytes, claimed)
            payload = _read_bounded(stream, claimed + 1)
    except FileNotFoundError:
        raise DataError(f"{path}: file not found; {REDOWNLOAD}") from None
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise DataError(f"{path}: cannot read the file ({_one_line(exc)}); {REDOWNLOAD}") from None
    _check_payload_length(path, claimed, len(payload))
    return np.frombuffer(payload, dtype=np.uint8, count=claimed).reshape(shape)


def load_idx_split(data_dir: str | Path, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """Load `{prefix}-images/labels` as (uint8 [N,1,H,W], int64 [N]); prefix is train or t10k."""
    if prefix not in ("train", "t10k"):
        raise ValueError(f"prefix must be 'train' or 't10k', not {prefix!r}")
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"{data_dir}: folder not found; {MISSING_FIX}")
    images_path = _find_idx_file(data_dir, prefix, "images", 3)
    labels_path = _find_idx_file(data_dir, prefix, "labels", 1)
    images = read_idx(images_path, expected_ndim=3)
    labels = read_idx(labels_path, expected_ndim=1)
    if len(images) != len(labels):
        raise DataError(
            f"{images_path} and {labels_path}: {len(images)} images but {len(labels)} "
            f"labels, so the files do not belong together; {REDOWNLOAD}"
        )
    _check_labels(labels_path, labels)
    return images[:, np.newaxis], labels.astype(np.int64)


def load_idx_dataset(data_dir: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Load (train_x, train_y, val_x, val_y) from the four IDX files in data_dir (val = t10k)."""
    train_x, train_y = load_idx_split(data_dir, "train")
    val_x, val_y = load_idx_split(data_dir, "t10k")
    return train_x, train_y, val_x, val_y


def _read_header(stream: BinaryIO, path: Path, expected_ndim: int | None) -> tuple[tuple[int, ...], int]:
    magic = stream.read(4)
    if len(magic) < 4:
        _fail(path, f"file is truncated (an IDX header needs 4 bytes, found {len(magic)})")
    if magic[:2] == b"\x1f\x8b":
        raise DataError(
            f"{path}: file is gzip-compressed but its name lacks .gz; rename it to "
            f"{path.name}.gz or decompress it"
        )
    if magic[0] != 0 or magic[1] != 0:
        _fail(path, f"not an IDX file (magic bytes {magic.hex()} should start with 0000)")
    if magic[2] != UNSIGNED_BYTE:
        _fail(path, f"IDX data type 0x{magic[2]:02x} is not supported (only unsigned bytes, 0x08)")
    ndim = magic[3]
    if not 1 <= ndim <= 4:
        _fail(path, f"IDX header claims {ndim} dimensions (expected 1 to 4)")
    if expected_ndim is not None and ndim != expected_ndim:
        _fail(
            path,
            f"file has {ndim} dimensions but {expected_ndim} are expected here "
            "(are the images and labels files swapped?)",
        )
    raw_dims = stream.read(4 * ndim)
    if len(raw_dims) < 4 * ndim:
        _fail(path, f"file is truncated (the header needs {4 * ndim} bytes of sizes, found {len(raw_dims)})")
    shape = struct.unpack(f">{ndim}I", raw_dims)
    if 0 in shape:
        _fail(path, f"IDX header has a zero size in shape {shape}")
    return shape, 4 + 4 * ndim


def _check_plain_size(path: Path, header_bytes: int, claimed: int) -> None:
    _check_payload_length(path, claimed, path.stat().st_size - header_bytes)


def _read_bounded(stream: BinaryIO, limit: int) -> bytearray:
    """Read at most `limit` bytes in chunks, so memory grows only with data actually present."""
    data = bytearray()
    while len(data) < limit:
        chunk = stream.read(min(CHUNK_BYTES, limit - len(data)))
        if not chunk:
            break
        data += chunk
    return data


def _check_payload_length(path: Path, claimed: int, found: int) -> None:
    if found < claimed:
        _fail(path, f"file is truncated (expected {claimed} bytes of data, found {found})")
    if found > claimed:
        extra = "at least 1" if found == claimed + 1 and path.suffix == ".gz" else str(found - claimed)
        _fail(path, f"file has trailing garbage ({extra} bytes after the {claimed} bytes of data)")


def _find_idx_file(data_dir: Path, prefix: str, kind: str, ndim: int) -> Path:
    names = (f"{prefix}-{kind}-idx{ndim}-ubyte", f"{prefix}-{kind}.idx{ndim}-ubyte")
    for name in names:
        for candidate in (data_dir / name, data_dir / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    raise DataError(f"{data_dir}: missing {names[0]} (or {names[0]}.gz); {MISSING_FIX}")


def _check_labels(path: Path, labels: np.ndarray) -> None:
    bad = np.flatnonzero(labels >= NUM_CLASSES)
    if bad.size:
        _fail(
            path,
            f"label {labels[bad[0]]} at index {bad[0]} is outside 0..{NUM_CLASSES - 1} "
            f"({bad.size} such labels)",
        )


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _fail(path: Path, problem: str) -> None:
    raise DataError(f"{path}: {problem}; {REDOWNLOAD}")
