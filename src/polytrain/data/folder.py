"""Reader for a folder of images in the torchvision ImageFolder layout.

Two layouts are accepted:

* ``root/train/<class>/...`` and ``root/val/<class>/...`` (``valid`` or ``validation`` also name the
  validation folder). The classes are the sorted folder names under ``train``; a validation class
  folder without a training folder of the same name is an error, a class missing from validation
  is fine.
* ``root/<class>/...`` with ``val_fraction``: within each class the file paths are sorted and the last
  ``ceil(val_fraction * n)`` files (at least 1, at most n - 1) are held out, so the split is the same
  on every run and every machine.

Image files are found recursively by extension (.png .jpg .jpeg .bmp .gif .webp .tif .tiff, any case);
other files and anything whose name starts with '.' are ignored. Labels follow the sorted class
names, and samples are ordered by (class, sorted path). If every image is grayscale the dataset has
1 channel, otherwise every image is converted to RGB. Without ``image_size`` all images must share
one size; with it each image is resized to image_size x image_size (bilinear).

A header pass (size and mode only) runs before any pixels are decoded, so a mismatched size fails
fast and the output array is allocated once. Every problem raises one line naming the path and the fix.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageFile

from ..errors import ConfigError, DataError
from .arrays import ArrayDataset

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
# Only these decoders may run: a file named .png that is really EPS must not reach Ghostscript.
PIL_FORMATS = ("PNG", "JPEG", "BMP", "GIF", "WEBP", "TIFF")  # JPEG also opens MPO (multi-picture) files
VAL_FOLDER_NAMES = ("val", "valid", "validation")
GRAY_MODES = {"1", "L", "LA", "I", "F", "I;16", "I;16L", "I;16B", "I;16N"}
PARALLEL_MIN_FILES = 2000  # below this, starting worker processes costs more than it saves
MAX_WORKERS = 8
CHUNK_MAX = 256  # files per task: big enough to amortise pickling, small enough to bound memory
SKIP_FIX = "remove or replace the file, or pass --skip-bad to skip unreadable files"
EXTENSION_LIST = ", ".join(IMAGE_EXTENSIONS)


@dataclass
class FolderDataset(ArrayDataset):
    classes: list[str] = field(default_factory=list)  # index = label
    skipped: list[str] = field(
        default_factory=list
    )  # unreadable files skipped under skip_bad, relative to root


def scan_image_folder(root, *, val_fraction: float | None = None):
    """Find the classes and image files: (classes, train_files, val_files), each file a (Path, label)."""
    root = Path(root)
    _check_val_fraction(val_fraction)
    if not root.exists():
        raise DataError(f"{root}: folder not found; check the path to the image folder")
    if not root.is_dir():
        raise DataError(
            f"{root}: not a folder; pass the folder that holds the class folders (or train/ and val/ folders)"
        )
    train_dir, val_dir = _split_dirs(root)
    if train_dir is None:
        return _scan_single_tree(root, val_fraction)
    if val_fraction is not None:
        raise ConfigError(
            f"{root} has train/ and val/ folders, and --val-fraction applies to a folder "
            "without train/ and val/ sub-folders; drop it"
        )
    classes = _class_names(train_dir)
    unknown = [name for name in _class_names(val_dir) if name not in classes]
    if unknown:
        raise DataError(
            f"{val_dir / unknown[0]} has no matching folder in {train_dir}; add "
            f"{train_dir / unknown[0]} or remove it (the classes come from {train_dir})"
        )
    train_files = [
        (path, label) for label, name in enumerate(classes) for path in _image_files(train_dir / name)
    ]
    val_files = [
        (path, classes.index(name)) for name in _class_names(val_dir) for path in _image_files(val_dir / name)
    ]
    return classes, train_files, val_files


def load_image_folder(
    root,
    *,
    image_size: int | None = None,
    val_fraction: float | None = None,
    skip_bad: bool = False,
    workers: int | None = None,
    seed: int = 0,
) -> FolderDataset:
    """Decode an image folder into a FolderDataset (uint8 N x C x H x W).

    `seed` is accepted for symmetry with the other readers: the split never depends on it.
    """
    _check_image_size(image_size)
    workers = _worker_count(workers)
    root = Path(root)
    classes, train_files, val_files = scan_image_folder(root, val_fraction=val_fraction)
    files, n_train = train_files + val_files, len(train_files)
    paths = [str(path) for path, _ in files]
    parallel = workers > 1 and len(files) > PARALLEL_MIN_FILES
    chunk = max(1, min(CHUNK_MAX, math.ceil(len(files) / (workers * 4)))) if parallel else CHUNK_MAX
    with _pool(workers if parallel else None) as pool:
        headers = [info for part in _map(pool, _read_headers, paths, chunk) for info in part]
        bad = {i: info for i, info in enumerate(headers) if isinstance(info, str)}
        if bad and not skip_bad:
            raise _cannot_decode(paths[min(bad)], bad[min(bad)])
        _check_survivors(root, classes, files, n_train, bad)
        good = [i for i in range(len(files)) if i not in bad]
        size = (image_size, image_size) if image_size else _common_size(paths, headers, good)
        mode = "L" if all(headers[i][1] in GRAY_MODES for i in good) else "RGB"
        decoded = _map(
            pool, _decode_chunk, [(i, paths[i]) for i in good], chunk, mode, size, image_size is not None
        )
        arrays, labels = _collect(
            decoded, files, n_train, (1 if mode == "L" else 3, size[1], size[0]), skip_bad, bad
        )
    _check_survivors(root, classes, files, n_train, bad)
    return FolderDataset(
        "folder",
        arrays[0],
        labels[0],
        arrays[1],
        labels[1],
        num_classes=len(classes),
        augment=False,
        flip=False,
        classes=classes,
        skipped=[Path(paths[i]).relative_to(root).as_posix() for i in sorted(bad)],
    )


def _collect(decoded, files: list, n_train: int, shape: tuple, skip_bad: bool, bad: dict):
    """Copy decoded images, in order, into one preallocated array per split; record failures in `bad`."""
    out = (np.empty((n_train, *shape), np.uint8), np.empty((len(files) - n_train, *shape), np.uint8))
    kept = ([], [])
    for results in decoded:
        for i, pixels in results:
            if isinstance(pixels, str):
                if not skip_bad:
                    raise _cannot_decode(files[i][0], pixels)
                bad[i] = pixels
                continue
            side = 0 if i < n_train else 1
            out[side][len(kept[side])] = pixels
            kept[side].append(files[i][1])
    # A prefix slice stays contiguous, so skipping costs no copy.
    arrays = [torch.from_numpy(out[side][: len(kept[side])]) for side in (0, 1)]
    return arrays, [torch.tensor(kept[side], dtype=torch.int64) for side in (0, 1)]


def _check_image_size(image_size) -> None:
    if image_size is not None and (
        isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1
    ):
        raise ConfigError(
            f"--image-size must be a positive whole number of pixels, not {image_size!r}; "
            "pass e.g. --image-size 32"
        )


def _check_val_fraction(val_fraction) -> None:
    if val_fraction is None:
        return
    if (
        isinstance(val_fraction, bool)
        or not isinstance(val_fraction, numbers.Real)
        or not 0 < val_fraction < 1
    ):
        raise ConfigError(
            f"--val-fraction must lie strictly between 0 and 1, not {val_fraction!r}; "
            "pass e.g. --val-fraction 0.1"
        )


def _split_dirs(root: Path):
    """(train_dir, val_dir) for the train/val layout, (None, None) for a single tree."""
    val_dirs = [root / name for name in VAL_FOLDER_NAMES if (root / name).is_dir()]
    train_dir = root / "train" if (root / "train").is_dir() else None
    if len(val_dirs) > 1:
        raise DataError(
            f"{root} has both {val_dirs[0].name}/ and {val_dirs[1].name}/ folders; keep one validation folder"
        )
    if train_dir is not None and not val_dirs:
        raise DataError(
            f"{train_dir} has no sibling val/ folder; add {root / 'val'} with one folder per "
            f"class, or move the class folders up into {root} and pass --val-fraction 0.1"
        )
    if train_dir is None and val_dirs:
        raise DataError(
            f"{val_dirs[0]} has no sibling train/ folder; add {root / 'train'} with one folder per class"
        )
    return train_dir, (val_dirs[0] if val_dirs else None)


def _scan_single_tree(root: Path, val_fraction):
    classes = _class_names(root)
    if val_fraction is None:
        raise ConfigError(
            f"{root} has no train/ and val/ folders; pass --val-fraction 0.1 to hold out "
            "a tenth of each class for validation, or add train/ and val/ folders"
        )
    train_files, val_files = [], []
    for label, name in enumerate(classes):
        paths = _image_files(root / name)
        if len(paths) < 2:
            raise DataError(
                f"{root / name} has only 1 image, and splitting with --val-fraction needs "
                "at least 2 per class; add images or use train/ and val/ folders"
            )
        # round() first: 0.1 * 30 is 3.0000000000000004 in floating point, which must not become 4
        held_out = min(len(paths) - 1, max(1, math.ceil(round(val_fraction * len(paths), 9))))
        train_files += [(path, label) for path in paths[:-held_out]]
        val_files += [(path, label) for path in paths[-held_out:]]
    return classes, train_files, val_files


def _class_names(folder: Path) -> list[str]:
    names = sorted(
        entry.name for entry in folder.iterdir() if entry.is_dir() and not entry.name.startswith(".")
    )
    if not names:
        raise DataError(
            f"{folder} has no class folders; put the images in one folder per class, "
            f"e.g. {folder / 'cat' / '1.png'}"
        )
    return names


def _image_files(class_dir: Path) -> list[Path]:
    found, seen = [], set()
    for dirpath, dirnames, filenames in os.walk(class_dir, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:  # a symlink loop: walk each real folder once
            dirnames.clear()
            continue
        seen.add(real)
        dirnames[:] = [name for name in dirnames if not name.startswith(".")]
        found += [
            Path(dirpath, name)
            for name in filenames
            if not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)
        ]
    if not found:
        raise DataError(f"{class_dir} has no images ({EXTENSION_LIST}); remove the folder or add images")
    return sorted(found)


def _worker_count(workers) -> int:
    if workers is None:
        available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return max(1, min(MAX_WORKERS, available or 1))
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers must be a whole number of at least 1, not {workers!r}; pass e.g. 4")
    return workers


def _map(pool, function, items, chunk, *args):
    """Yield function(chunk_of_items, *args) in order, in the pool or (pool None) in this process."""
    chunks = [items[start : start + chunk] for start in range(0, len(items), chunk)]
    if pool is None:
        return (function(part, *args) for part in chunks)
    return pool.map(function, chunks, *([arg] * len(chunks) for arg in args))


@contextmanager
def _pool(workers: int | None):
    """A process pool (None: decode in this process) that drops queued work if an error stops the load."""
    if workers is None:
        yield None
        return
    pool = ProcessPoolExecutor(max_workers=workers)
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@functools.cache
def _formats() -> tuple:
    # A Pillow built without one of the codecs (say WebP) must still open the others.
    Image.init()
    return tuple(name for name in PIL_FORMATS if name in Image.OPEN)


@contextmanager
def _strict_loading():
    # Another library may have set LOAD_TRUNCATED_IMAGES; a cut file must fail, not pad with grey.
    saved, ImageFile.LOAD_TRUNCATED_IMAGES = ImageFile.LOAD_TRUNCATED_IMAGES, False
    try:
        yield
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = saved


def _read_headers(paths: list[str]) -> list:
    """(width, height), mode per path, or the reason it cannot be opened."""
    results = []
    for path in paths:
        try:
            with Image.open(path, formats=_formats()) as image:
                results.append((image.size, image.mode))
        except Exception as exc:  # Pillow raises many types on garbage input; all mean "unreadable"
            results.append(_reason(exc, path))
    return results


def _decode_chunk(jobs: list, mode: str, size: tuple, resize: bool) -> list:
    """(index, uint8 C x H x W array or failure reason) for each (index, path)."""
    results = []
    with _strict_loading():
        for index, path in jobs:
            try:
                results.append((index, _decode(path, mode, size, resize)))
            except Exception as exc:  # as in _read_headers: any failure means the file is unreadable
                results.append((index, _reason(exc, path)))
    return results


def _decode(path: str, mode: str, size: tuple, resize: bool) -> np.ndarray:
    with Image.open(path, formats=_formats()) as image:
        image.load()
        if image.mode.startswith("I;16"):  # Pillow would clip 16-bit values at 255; scale them instead
            image = Image.fromarray((np.asarray(image) >> 8).astype(np.uint8))
        image = image.convert(mode)
        if resize and image.size != size:
            image = image.resize(size, Image.BILINEAR)
        if image.size != size:
            raise ValueError(f"decoded size {image.size[0]}x{image.size[1]} differs from its header")
        pixels = np.asarray(image, dtype=np.uint8)
    return pixels[np.newaxis] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)


def _reason(exc: BaseException, path: str) -> str:
    text = str(exc).split("\n")[0].replace(f"'{path}'", "").replace(path, "the file")
    return " ".join(text.split()).strip(" :")[:160] or type(exc).__name__


def _cannot_decode(path, reason: str) -> DataError:
    return DataError(f"{path}: cannot decode the image ({reason}); {SKIP_FIX}")


def _common_size(paths: list[str], headers: list, good: list[int]) -> tuple:
    reference = good[0]
    width, height = headers[reference][0]
    for i in good:
        if headers[i][0] != (width, height):
            w, h = headers[i][0]
            side = min(width, height)
            raise DataError(
                f"{paths[i]} is {w}x{h} but {paths[reference]} is {width}x{height}; "
                f"pass --image-size {side} to resize every image to {side}x{side}"
            )
    return width, height


def _check_survivors(root: Path, classes: list[str], files: list, n_train: int, bad: dict) -> None:
    """Skipping must not leave a class without training images or the validation split empty."""
    train_left = {label for i, (_, label) in enumerate(files[:n_train]) if i not in bad}
    for label, name in enumerate(classes):
        if label not in train_left:
            example = next(i for i, (_, lab) in enumerate(files[:n_train]) if lab == label)
            raise DataError(
                f"{root}: no training image of class {name!r} can be decoded "
                f"(e.g. {files[example][0]}: {bad[example]}); replace the files"
            )
    if all(i in bad for i in range(n_train, len(files))):
        raise DataError(
            f"{root}: no validation image can be decoded (e.g. {files[n_train][0]}: "
            f"{bad[n_train]}); replace the files"
        )
