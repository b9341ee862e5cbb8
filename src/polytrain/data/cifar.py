"""Reader for the CIFAR-10 *binary* version (never the pickled python version).

Each record is 1 label byte followed by 3072 pixel bytes (1024 red, 1024 green, 1024 blue, row-major).
The six batch files are read from data_dir, data_dir/cifar-10-batches-bin/, or straight out of
data_dir/cifar-10-binary.tar.gz in memory (nothing is extracted to disk).
"""

from __future__ import annotations

import tarfile
import zlib
from pathlib import Path, PurePosixPath

import numpy as np

from polytrain.errors import DataError

TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
TEST_FILE = "test_batch.bin"
ALL_FILES = (*TRAIN_FILES, TEST_FILE)
ARCHIVE_NAME = "cifar-10-binary.tar.gz"
SUBFOLDER = "cifar-10-batches-bin"
IMAGE_SHAPE = (3, 32, 32)
RECORD_BYTES = 1 + 3 * 32 * 32
MAX_FILE_BYTES = 256 * 1024**2  # an official batch is 30 MB; a bigger member means a corrupt header
NUM_CLASSES = 10
CHUNK_BYTES = 1 << 20
REDOWNLOAD = "download it again or pass --download"


def load_cifar10(data_dir: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Load (train_x uint8 [N,3,32,32], train_y int64, val_x, val_y) from the binary batches."""
    batches = _read_batch_files(Path(data_dir))
    decoded = {name: decode_cifar_batch(blob, name=source) for name, (blob, source) in batches.items()}
    train_x = np.concatenate([decoded[name][0] for name in TRAIN_FILES])
    train_y = np.concatenate([decoded[name][1] for name in TRAIN_FILES])
    val_x, val_y = decoded[TEST_FILE]
    return train_x, train_y, np.ascontiguousarray(val_x), val_y


def decode_cifar_batch(blob: bytes, *, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Decode one batch file's bytes into (images uint8 [N,3,32,32], labels int64 [N]).

    The images are a read-only view into blob (no copy); copy them if you need to write.
    """
    count, extra = divmod(len(blob), RECORD_BYTES)
    if count == 0 and extra == 0:
        _fail(name, "file is empty")
    if extra:
        _fail(
            name,
            f"length {len(blob)} is not a multiple of the {RECORD_BYTES}-byte record "
            f"({extra} bytes extra, or {RECORD_BYTES - extra} missing from the last record)",
        )
    records = np.frombuffer(blob, dtype=np.uint8).reshape(count, RECORD_BYTES)
    labels = records[:, 0].astype(np.int64)
    bad = np.flatnonzero(labels >= NUM_CLASSES)
    if bad.size:
        _fail(
            name,
            f"label {labels[bad[0]]} of record {bad[0]} is outside 0..{NUM_CLASSES - 1} "
            f"({bad.size} such records)",
        )
    return records[:, 1:].reshape(count, *IMAGE_SHAPE), labels


def _read_batch_files(data_dir: Path) -> dict[str, tuple[bytes, str]]:
    """Map each expected file name to (its bytes, a name for messages)."""
    for folder in (data_dir, data_dir / SUBFOLDER):
        if any((folder / name).is_file() for name in ALL_FILES):
            return _read_folder(folder)
    archive = data_dir / ARCHIVE_NAME
    if archive.is_file():
        return _read_archive(archive)
    raise DataError(
        f"{data_dir}: no CIFAR-10 binary files found (expected data_batch_1.bin.."
        f"data_batch_5.bin and test_batch.bin, or {ARCHIVE_NAME}); put them there "
        "or add --download"
    )


def _read_folder(folder: Path) -> dict[str, tuple[bytes, str]]:
    _require_all(
        folder,
        [name for name in ALL_FILES if (folder / name).is_file()],
        fix="put all six CIFAR-10 binary batch files there or add --download",
    )
    blobs = {}
    for name in ALL_FILES:
        path = folder / name
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            _fail(str(path), f"file is {size} bytes, far larger than a CIFAR-10 batch")
        try:
            blobs[name] = (path.read_bytes(), str(path))
        except OSError as exc:
            _fail(str(path), f"cannot read the file ({exc})")
    return blobs


def _read_archive(archive: Path) -> dict[str, tuple[bytes, str]]:
    """Read the six batch members in one pass over the archive; other members are ignored."""
    blobs: dict[str, tuple[bytes, str]] = {}
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                name = PurePosixPath(member.name).name
                if name not in ALL_FILES or not member.isfile():
                    continue
                source = f"{archive} member {member.name}"
                if name in blobs:
                    _fail(source, f"the archive holds {name} twice")
                if member.size > MAX_FILE_BYTES:
                    _fail(source, f"member claims {member.size} bytes, far larger than a CIFAR-10 batch")
                blobs[name] = (_read_member(tar, member, source), source)
            _drain(tar.fileobj)
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        _fail(str(archive), f"cannot read the archive ({_one_line(exc)})")
    _require_all(archive, list(blobs), fix=REDOWNLOAD)
    return blobs


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo, source: str) -> bytes:
    stream = tar.extractfile(member)
    data = stream.read() if stream is not None else b""
    if len(data) != member.size:
        _fail(source, f"member is truncated (expected {member.size} bytes, found {len(data)})")
    return data


def _drain(stream) -> None:
    """Read the archive to its end (bounded), so gzip verifies its CRC: tarfile stops at the end marker."""
    for _ in range(MAX_FILE_BYTES // CHUNK_BYTES):
        if not stream.read(CHUNK_BYTES):
            return


def _require_all(location: Path, present: list[str], *, fix: str) -> None:
    missing = [name for name in ALL_FILES if name not in present]
    if missing:
        raise DataError(f"{location}: missing {', '.join(missing)}; {fix}")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _fail(name: str, problem: str) -> None:
    raise DataError(f"{name}: {problem}; {REDOWNLOAD}")
