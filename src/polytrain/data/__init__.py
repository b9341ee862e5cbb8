"""Datasets by name. Each loader returns an `ArrayDataset` of uint8 images held in memory, or for text a
`TokenDataset` of token ids (text.py; token shards on disk: token_shards.py), or for rows of token ids a
`DatasetPair` of padded samples (a Hugging Face dataset on disk: hf.py, token_rows.py).

The names, and the dataset settings each one reads, are declared in config/registry_names.py, where the
command line reads them without importing torch; this registry maps them to loaders and checks at import that
both name the same datasets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, Optional

from ..config.registry_names import (
    DATASET_NAMES,
    check_registry,
    datasets_using,
    unused_dataset_options,
)
from ..errors import DataError, UserError
from .arrays import ArrayDataset

DATASETS: Dict[str, Callable[..., ArrayDataset]] = {}


def register(name: str):
    def add(loader):
        DATASETS[name] = loader
        return loader

    return add


def load_dataset(
    name: str,
    *,
    data_dir: Optional[str] = None,
    download: bool = False,
    synthetic_size: int = 2048,
    synthetic_shape=(1, 28, 28),
    seed: int = 0,
    image_size: Optional[int] = None,
    val_fraction: Optional[float] = None,
    skip_bad: bool = False,
    context: Optional[int] = None,
    tokenizer: Optional[str] = None,
    text_key: str = "text",
    train_on_prompt: bool = False,
    pack: bool = False,
    init_from: Optional[str] = None,
    vocab_size: Optional[int] = None,
    verbose: bool = True,
) -> ArrayDataset:
    """Load a registered dataset; raise `UserError` with the fix for unknown names or missing files.
    `init_from` and `vocab_size` are the model's (its checkpoint folder and embedding rows), which a dataset
    that tokenizes text checks its tokenizer against; `verbose`: a dataset that works for a while (tokenizing)
    says so."""
    if name not in DATASETS:
        raise UserError(f"unknown --dataset {name!r}; choose one of {', '.join(sorted(DATASETS))}")
    return DATASETS[name](
        data_dir=data_dir,
        download=download,
        size=synthetic_size,
        shape=tuple(synthetic_shape),
        seed=seed,
        image_size=image_size,
        val_fraction=val_fraction,
        skip_bad=skip_bad,
        context=context,
        tokenizer=tokenizer,
        text_key=text_key,
        train_on_prompt=train_on_prompt,
        pack=pack,
        init_from=init_from,
        vocab_size=vocab_size,
        verbose=verbose,
    )


def dataset_settings(config) -> dict:
    """The keywords of `load_dataset` from a TrainConfig."""
    return dict(
        data_dir=config.data_dir,
        download=config.download,
        synthetic_size=config.synthetic_size,
        synthetic_shape=config.synthetic_shape,
        seed=config.seed,
        image_size=config.image_size,
        val_fraction=config.val_fraction,
        skip_bad=config.skip_bad,
        context=config.context,
        tokenizer=config.tokenizer,
        text_key=config.text_key,
        train_on_prompt=config.train_on_prompt,
        pack=config.pack,
        init_from=config.init_from,
        vocab_size=config.vocab_size,
    )


def _load_files(name: str, data_dir: Optional[str], download: bool, read: Callable):
    """Read a file-based dataset from --data-dir (or the cache); with --download, fetch what is missing
    (checksum-verified) and read again. Files already there are used as they are."""
    from .download import default_cache_dir, ensure_dataset_files

    folder = Path(data_dir).expanduser() if data_dir is not None else default_cache_dir() / name
    if not download:
        if data_dir is None:
            raise DataError(
                f"dataset {name!r} needs its files: pass --data-dir DIR, or add --download to fetch "
                f"them into {folder}"
            )
        if not folder.is_dir():
            raise DataError(
                f"--data-dir {folder} does not exist; point it at the folder holding the "
                f"{name} files, or add --download"
            )
        return read(folder)
    if folder.is_dir():
        try:
            return read(folder)
        except DataError:
            pass
    folder.mkdir(parents=True, exist_ok=True)
    ensure_dataset_files(name, folder)
    return read(folder)


@register("mnist-sample")
def _mnist_sample(**_) -> ArrayDataset:
    from .sample import load_mnist_sample

    return load_mnist_sample()


def _idx(name: str, data_dir, download) -> ArrayDataset:
    from .idx import load_idx_dataset

    train_x, train_y, val_x, val_y = _load_files(name, data_dir, download, load_idx_dataset)
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

    train_x, train_y, val_x, val_y = _load_files("cifar10", data_dir, download, load_cifar10)
    return ArrayDataset.from_numpy("cifar10", train_x, train_y, val_x, val_y, augment=True, flip=True)


@register("folder")
def _folder(*, data_dir=None, image_size=None, val_fraction=None, skip_bad=False, **_) -> ArrayDataset:
    from .folder import load_image_folder

    if data_dir is None:
        raise DataError(
            "--dataset folder needs --data-dir DIR: a folder with train/<class>/ and val/<class>/ "
            "image folders, or <class>/ folders and --val-fraction 0.1"
        )
    return load_image_folder(data_dir, image_size=image_size, val_fraction=val_fraction, skip_bad=skip_bad)


@register("synthetic")
def _synthetic(*, size=2048, shape=(1, 28, 28), seed=0, **_) -> ArrayDataset:
    from .arrays import synthetic_dataset

    return synthetic_dataset(size=size, shape=shape, seed=seed)


@register("shakespeare")
def _shakespeare(*, context=None, **_):
    from .text import DEFAULT_CONTEXT, load_shakespeare

    return load_shakespeare(context=context or DEFAULT_CONTEXT)


@register("text")
def _text(*, data_dir=None, context=None, **_):
    from .text import DEFAULT_CONTEXT, load_text

    return load_text(data_dir, context=context or DEFAULT_CONTEXT)


@register("tokens")
def _tokens(*, data_dir=None, context=None, **_):
    from .text import DEFAULT_CONTEXT
    from .token_shards import load_token_shards

    return load_token_shards(data_dir, context=context or DEFAULT_CONTEXT)


@register("hf")
def _hf(
    *,
    data_dir=None,
    context=None,
    tokenizer=None,
    text_key="text",
    train_on_prompt=False,
    pack=False,
    val_fraction=None,
    verbose=True,
    **model,
):
    from .hf import load_hf

    return load_hf(
        data_dir,
        context=context,
        tokenizer=tokenizer,
        text_key=text_key,
        train_on_prompt=train_on_prompt,
        pack=pack,
        val_fraction=val_fraction,
        init_from=model.get("init_from"),
        model_vocabulary=model.get("vocab_size"),
        show=verbose,
    )


check_registry("dataset", DATASETS, DATASET_NAMES)

__all__ = [
    "ArrayDataset",
    "DATASETS",
    "dataset_settings",
    "datasets_using",
    "load_dataset",
    "register",
    "unused_dataset_options",
]
