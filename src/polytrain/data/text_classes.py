"""Texts with a class each (`--dataset hf` on rows of a text column and a `label` column): the data of a
sequence classifier, as Hugging Face's `LlamaForSequenceClassification` and `GPT2ForSequenceClassification`
train on it (models/classifier.py).

    polytrain train --model gpt --dataset hf --data-dir ./sentiment --tokenizer ./tokenizer.json

Each row's text is encoded with the run's tokenizer (its own special tokens included, as a Hugging Face
tokenizer called on the text adds them), cut to its first `--context` tokens (a line says how many rows were
cut) and right-padded with `PAD` (-1, never a token id): the model reads each row's length off its ids and pools
the hidden state of its last token. The ids are written once, ragged (a flat array and each row's offset), into
`polytrain-cache/classes-<tokenizer SHA-256>-<rows' fingerprint>/` beside the data (hf.py's cache and lock), so
a second run, or one with another `--context`, reads them without tokenizing.

The label is a class index 0..K-1. A `ClassLabel` feature gives the classes' names (K of them); string labels
are mapped to ids in the sorted order of their distinct values (as `Dataset.class_encode_column` does), the
names kept; integer labels give K = the largest + 1, named by their numbers. The names go to the run's
config.json, so `predict` and reports name them. A missing label (None, or a ClassLabel's -1, "no label"), a
label outside 0..K-1 where names are given, a negative one, a float column, or fewer than 2 classes are one line
naming the split and the row, before any worker starts.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import DataError, first_line
from .stream import DatasetPair, spec_of

PAD = -1  # after a row's tokens: not an id, so the model tells a row's length from its ids alone
FORMAT = 1  # of the cached ids: another format writes another folder
ROWS = 1000  # rows encoded at a time


class ClassRows(Dataset):
    """One split's rows as (ids, class): `context` int64 ids (the row's first `context` tokens, then PAD) and an
    int64 class index. The ids are read from the cache's arrays, mapped from the disk on first use."""

    def __init__(self, folder: Path, split: str, labels: np.ndarray, *, context: int, rows=None):
        self.folder, self.split, self.context = Path(folder), split, int(context)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.rows = np.arange(len(self.labels)) if rows is None else rows  # (head: the first rows)
        self._ids = self._offsets = None

    def __getstate__(self):
        return dict(self.__dict__, _ids=None, _offsets=None)  # (workers map the files themselves)

    def __len__(self) -> int:
        return len(self.rows)

    def head(self, count: int) -> "ClassRows":
        shorter = copy.copy(self)
        shorter.rows = self.rows[:count]
        return shorter

    def __getitem__(self, index):
        if self._ids is None:
            self._ids = np.load(self.folder / f"{self.split}-ids.npy", mmap_mode="r")
            self._offsets = np.load(self.folder / f"{self.split}-offsets.npy")
        row = int(self.rows[int(index)])
        start, end = int(self._offsets[row]), int(self._offsets[row + 1])
        x = np.full(self.context, PAD, dtype=np.int64)
        end = min(end, start + self.context)
        x[: end - start] = self._ids[start:end]
        return torch.from_numpy(x), torch.tensor(int(self.labels[row]))


@dataclass
class ClassesPair(DatasetPair):
    """A `DatasetPair` of `ClassRows`: `num_classes` the classes, `sequence_vocabulary` the tokens the model
    embeds (which tells the model registry to build a sequence classifier), and the run's tokenizer."""

    sequence_vocabulary: int = 0
    folder: Optional[Path] = None
    tokenizer_file: Optional[Path] = None
    tokenizer_sha256: Optional[str] = None
    end_of_text_id: Optional[int] = None
    cut: Tuple[int, int] = (0, 0)  # rows longer than the context (training, validation)

    def head(self, samples: int) -> "ClassesPair":
        """The first `samples` training rows and as many validation rows (verify compares the steps)."""
        shorter = copy.copy(self)
        shorter.train, shorter.val = self.train.head(samples), self.val.head(samples)
        return shorter


def _row_of(column, flags) -> int:
    return int(np.flatnonzero(np.asarray(flags))[0])


def class_labels(train, val, label: str, *, where) -> Tuple[np.ndarray, np.ndarray, List[str]]:
    """(training class ids, validation class ids, class names) of the `label` column of two splits; `where(split)`
    names a split in errors. One line for a label that is missing, outside the classes, or not a class."""
    import pyarrow as pa
    import pyarrow.compute as pc

    feature = train.features[label]
    names = list(feature.names) if hasattr(feature, "names") else None
    other = val.features.get(label)
    if names is not None and list(getattr(other, "names", names)) != names:
        raise DataError(
            f"{where('validation')}: the {label!r} column's class names {list(other.names)} differ from the "
            f"training split's {names}; save both splits with one ClassLabel"
        )
    columns = []
    for split, rows in (("training", train), ("validation", val)):
        column = rows.data.column(label).combine_chunks()
        if column.null_count:
            raise DataError(
                f"{where(split)}, row {_row_of(column, column.is_null())}: {label} is missing (None); every row "
                f"needs a class: drop the row or fill it"
            )
        columns.append(column)
    kind = columns[0].type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        names = sorted(set(pc.unique(columns[0]).to_pylist()) | set(pc.unique(columns[1]).to_pylist()))
        ids = [np.asarray(pc.index_in(column, pa.array(names)), dtype=np.int64) for column in columns]
        _two_or_more(names, label, where)
        return ids[0], ids[1], names
    if not (pa.types.is_integer(kind) or pa.types.is_boolean(kind)):
        raise DataError(
            f"{where('training')}: the column {label!r} holds {kind}, not classes; a class label is a whole "
            f"number 0..K-1, a string or a ClassLabel (a number to predict is regression, which --dataset hf does "
            f"not train)"
        )
    ids = [np.asarray(column.cast(pa.int64()), dtype=np.int64) for column in columns]
    count = len(names) if names is not None else int(max(ids[0].max(initial=-1), ids[1].max(initial=-1))) + 1
    for split, values in zip(("training", "validation"), ids):
        if names is not None and (values == -1).any():
            raise DataError(
                f"{where(split)}, row {_row_of(values, values == -1)}: {label} is -1 (the ClassLabel's \"no "
                f'label", as a test split without labels has); train and validate on labelled rows'
            )
        bad = (values < 0) | (values >= count)
        if bad.any():
            row, value = _row_of(values, bad), int(values[bad][0])
            within = f"its {count} classes {names}" if names is not None else "classes 0 and up"
            raise DataError(
                f"{where(split)}, row {row}: {label} is {value}, outside {within}; give a class 0..{count - 1}"
                if names is not None
                else f"{where(split)}, row {row}: {label} is {value}, outside {within}; a class is 0 or more"
            )
    names = names if names is not None else [str(i) for i in range(count)]
    _two_or_more(names, label, where)
    return ids[0], ids[1], names


def _two_or_more(names: list, label: str, where) -> None:
    if len(names) < 2:
        raise DataError(
            f"{where('training')}: every {label} is {names[0] if names else 0}, one class; a classifier needs 2 "
            f"classes or more"
        )


def _cache_key(train, val, *, sha256: str, text_key: str, held: Optional[float]) -> str:
    what = dict(format=FORMAT, train=train._fingerprint, val=val._fingerprint, text_key=text_key, held=held)
    data = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()
    return f"classes-{sha256[:16]}-{data[:16]}"


def _encode(folder: Path, split: str, rows, text_key: str, tokenizer, progress) -> None:
    """Each row's ids, flat, and where each row starts (`offsets`, one more than the rows)."""
    pieces, lengths = [], [0]
    for batch in rows.select_columns([text_key]).iter(batch_size=ROWS):
        texts = [text or "" for text in batch[text_key]]
        for encoding in tokenizer.encode_batch(texts):
            pieces.append(np.asarray(encoding.ids, dtype=np.int32))
            lengths.append(len(encoding.ids))
        progress.update(sum(len(text.encode("utf-8")) for text in texts))
    ids = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    np.save(folder / f"{split}-ids.npy", ids)
    np.save(folder / f"{split}-offsets.npy", np.cumsum(np.asarray(lengths, dtype=np.int64)))


def tokenized_rows(source, cached, train, val, *, tokenizer: Path, text_key: str, held, show: bool) -> Path:
    """The folder of each row's ids: `cached(name, write)` (hf.py `written_once`) gives it, written once."""
    from . import tokenizer as tokenizers_file
    from .corpus import Progress

    sha256 = tokenizers_file.file_sha256(tokenizer)
    name = _cache_key(train, val, sha256=sha256, text_key=text_key, held=held)

    def write(partial: Path) -> None:
        model = tokenizers_file.load(tokenizer)
        total = sum(rows.data.column(text_key).nbytes for rows in (train, val))
        progress = Progress(f"tokenizing {source.path} into {partial.parent / name}", total, show=show)
        try:
            for split, rows in (("train", train), ("val", val)):
                _encode(partial, split, rows, text_key, model, progress)
        except Exception as error:  # a row group or batch that cannot be decoded
            raise DataError(
                f"--data-dir {source.path} cannot be read ({type(error).__name__}: {first_line(error)}); it is "
                f"damaged or not in its format: copy or write it again"
            ) from None
        progress.close()
        record = dict(tokenizer=str(tokenizer), sha256=sha256, rows=[len(train), len(val)], text_key=text_key)
        (partial / "rows.json").write_text(json.dumps(record))  # written last: the folder is whole

    return cached(name, write)


def load_text_classes(
    source,
    cached,
    train,
    val,
    *,
    held: bool,
    label: str,
    text_key: str,
    context: Optional[int],
    tokenizer: Path,
    model_vocabulary: Optional[int],
    init_from: Optional[str],
    val_fraction: Optional[float],
    show: bool,
) -> ClassesPair:
    """The rows of `train` and `val` (`datasets.Dataset`s with a text and a label column; `held`: `val` is the
    last rows of one split) as a pair of padded ids and classes; `cached(name, write)` gives the cache's folder
    `name`, written by `write(folder)` where it is not there yet."""
    from . import tokenizer as tokenizers_file

    def where(split: str) -> str:
        return f"--data-dir {source.path}" + ("" if held else f", {split} split")

    train_y, val_y, names = class_labels(train, val, label, where=where)
    model = tokenizers_file.load(tokenizer)
    vocabulary = model.get_vocab_size(with_added_tokens=True)
    tokenizers_file.check_tokenizer_fits(tokenizer, vocabulary, model_vocabulary, init_from)
    held_fraction = (val_fraction or 0.0) if held else None  # (the rows' fingerprints tell the split too)
    folder = tokenized_rows(
        source, cached, train, val, tokenizer=tokenizer, text_key=text_key, held=held_fraction, show=show
    )
    lengths = [np.diff(np.load(folder / f"{split}-offsets.npy")) for split in ("train", "val")]
    longest = int(max(length.max(initial=0) for length in lengths))
    if longest < 1:
        raise DataError(f"--data-dir {source.path}: every row's {text_key!r} is empty; give rows with text")
    context = context or longest
    cut = tuple(int((length > context).sum()) for length in lengths)
    try:
        eot = tokenizers_file.end_of_text(model, tokenizer)[1]
    except Exception:  # a classifier's tokenizer needs no end-of-text token
        eot = None
    pair = ClassesPair(
        ClassRows(folder, "train", train_y, context=context),
        ClassRows(folder, "val", val_y, context=context),
        spec=None,
        name="hf",
        classes=names,
        kind="classification",
        sequence_vocabulary=vocabulary,
        folder=folder,
        tokenizer_file=Path(tokenizer),
        tokenizer_sha256=tokenizers_file.file_sha256(tokenizer),
        end_of_text_id=eot,
        cut=cut,
    )
    pair.spec = spec_of(pair.train, num_classes=len(names))
    if show:
        rows = len(train_y) + len(val_y)
        print(
            f"--dataset hf: {len(names)} classes ({', '.join(names[:8])}{', ...' * (len(names) > 8)}) of "
            f"{rows:,} texts in {label!r}; {sum(cut):,} of the {rows:,} rows were longer than --context {context} "
            f"tokens and cut to their first {context} (the longest has {longest:,})",
            flush=True,
        )
    return pair
