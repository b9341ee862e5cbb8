"""Download dataset files with MD5 verification and atomic placement.

A file is streamed into a temporary file beside its destination, hashed on the way, fsynced, checked,
and only then renamed into place, so an interrupted or corrupt download never leaves a file that looks
complete.

Checksums: the MNIST and Fashion-MNIST MD5s are the ones in torchvision/datasets/mnist.py
(`MNIST.resources`, `FashionMNIST.resources`). torchvision reads the pickled CIFAR-10 archive, so the
MD5 of the *binary* archive is the one published beside it on https://www.cs.toronto.edu/~kriz/cifar.html.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from polytrain.errors import ConfigError, DataError

CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class DatasetSource:
    """Where a dataset's files live and the MD5 each must have."""

    mirror: str
    md5_by_file: dict[str, str]


SOURCES: dict[str, DatasetSource] = {
    "mnist": DatasetSource(
        mirror="https://ossci-datasets.s3.amazonaws.com/mnist/",
        md5_by_file={
            "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
            "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
            "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
            "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
        },
    ),
    "fashion-mnist": DatasetSource(
        mirror="http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        md5_by_file={
            "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
            "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
            "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
        },
    ),
    "cifar10": DatasetSource(
        mirror="https://www.cs.toronto.edu/~kriz/",
        md5_by_file={"cifar-10-binary.tar.gz": "c32a1d4ab5d03f1284b67883e8d87530"},
    ),
}


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/polytrain/datasets, or ~/.cache/polytrain/datasets when that is unset."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "polytrain" / "datasets"


def file_md5(path: str | Path) -> str:
    """MD5 hex digest of a file, read in chunks."""
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as stream:
        while chunk := stream.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def download_file(url: str, dest: str | Path, *, md5: str, timeout: float = 60) -> Path:
    """Download url to dest unless dest already has the right MD5; raise DataError on any failure."""
    dest = Path(dest)
    if dest.is_file() and file_md5(dest) == md5:
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, temp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    except OSError as exc:
        raise DataError(f"{dest.parent}: cannot write there ({exc}); choose a writable --data-dir") from None
    try:
        with os.fdopen(fd, "wb") as out:
            actual = _stream_to(url, out, timeout=timeout)
            out.flush()
            os.fsync(out.fileno())
        if actual != md5:
            raise DataError(
                f"{dest.name}: checksum mismatch (expected md5 {md5}, got {actual}) for "
                f"{url}; try again later, or fetch the file yourself into {dest.parent}"
            )
        os.replace(temp_name, dest)
    except (OSError, http.client.HTTPException, ValueError) as exc:  # URLError is an OSError
        raise DataError(
            f"{url}: download failed ({_one_line(exc)}); check the network or put "
            f"{dest.name} into {dest.parent} yourself"
        ) from None
    finally:
        Path(temp_name).unlink(missing_ok=True)
    return dest


def ensure_dataset_files(name: str, folder: str | Path, *, base_url: str | None = None) -> Path:
    """Download each file of dataset `name` that is missing (or damaged) in folder; return folder."""
    source = SOURCES.get(name)
    if source is None:
        raise ConfigError(f"no download source for dataset {name!r}; choose one of {', '.join(SOURCES)}")
    folder = Path(folder)
    mirror = (base_url or source.mirror).rstrip("/") + "/"
    for filename, md5 in source.md5_by_file.items():
        download_file(mirror + filename, folder / filename, md5=md5)
    return folder


def _stream_to(url: str, out, *, timeout: float) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with urllib.request.urlopen(url, timeout=timeout) as response:
        while chunk := response.read(CHUNK_BYTES):
            digest.update(chunk)
            out.write(chunk)
    return digest.hexdigest()


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
