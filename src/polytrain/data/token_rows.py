"""Rows of token ids (`input_ids`, with `labels` and `attention_mask` where present) as samples: `--dataset hf`
on a dataset tokenized already (data/hf.py).

Each row is one sample, used as it is. Its labels are read as Hugging Face's causal language models read them:
aligned with `input_ids` and shifted inside, so the target at position t is `labels[t + 1]` (without a
`labels` column, the next token: `input_ids[t + 1]`), -100 (`IGNORE_INDEX`) trains nothing, and the last
position predicts nothing. An `attention_mask` marks padding stored in the rows; polytrain's models attend to
every earlier token, so the mask must be ones up to the row's last trained label (padding on the right only,
where the labels are -100): a row with a 0 before a 1 (left padding) or a label of padding is refused in one
line, since trained so it would compute other values than the model it was padded for. The padding is cut off.

Every sample is padded to `--context` tokens (default: the longest row), input 0 and target -100, or, with
`--pack`, is a window of `--context` tokens holding as many rows as fit (`PackedRows`), so every batch has one
shape: the loss counts only the real tokens (objective.py `token_loss`), pipelines and tensor
sequence splits need one shape, and one device and N devices compute the same sums. All rows are checked
before any worker starts, a batch of rows at a time: ids in the vocabulary (the tokenizer's where the run has
one, else the largest id + 1), labels and mask of the ids' lengths, and the mask's rule above.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import DataError
from .stream import DatasetPair, spec_of

IGNORE_INDEX = -100  # a label that trains nothing (Hugging Face's and torch's cross-entropy default)
COLUMNS = ("input_ids", "labels", "attention_mask")
SCAN_ROWS = 4096


class TokenRows(Dataset):
    """One split's rows as (inputs, targets) of `context` int64 ids each, padded."""

    def __init__(self, rows, *, context: int):
        self.columns = [name for name in COLUMNS if name in rows.column_names]
        self.rows = rows.select_columns(self.columns).with_format("numpy")
        self.context = int(context)

    def __len__(self) -> int:
        return len(self.rows)

    def head(self, count: int) -> "TokenRows":
        """The first `count` rows."""
        shorter = copy.copy(self)
        shorter.rows = self.rows.select(range(min(count, len(self.rows))))
        return shorter

    def row(self, index) -> Tuple[np.ndarray, np.ndarray]:
        """(ids, targets) of row `index`, its padding cut off: the target of position t is its label t + 1, the
        last position's -100."""
        row = self.rows[int(index)]
        ids = np.asarray(row["input_ids"], dtype=np.int64)
        mask = row.get("attention_mask")
        ones = np.flatnonzero(np.asarray(mask)) if mask is not None else None
        length = len(ids) if ones is None else int(ones[-1]) + 1 if len(ones) else 0  # the padding cut off
        labels = np.asarray(row["labels"], dtype=np.int64) if "labels" in row else ids
        targets = np.full(length, IGNORE_INDEX, dtype=np.int64)
        targets[: max(0, length - 1)] = labels[1:length]
        return ids[:length], targets

    def __getitem__(self, index):
        ids, targets = self.row(index)
        x = np.zeros(self.context, dtype=np.int64)
        y = np.full(self.context, IGNORE_INDEX, dtype=np.int64)
        x[: len(ids)], y[: len(ids)] = ids, targets
        return torch.from_numpy(x), torch.from_numpy(y)


class PackedRows(TokenRows):
    """One split's rows packed into windows of `context` tokens (`--pack`): as many whole rows in each as fit
    (best fit, the longest rows first), each sample `((ids, positions), targets)` of `context` each, the positions
    of each row from 0 (the model keeps each row's attention to itself: models/packing.py), the rest of a window
    padding (input 0, target -100, a row of its own). `lengths`: each row's tokens, its padding cut off."""

    def __init__(self, rows, *, context: int, lengths: np.ndarray):
        super().__init__(rows, context=context)
        windows = best_fit(lengths, self.context)
        self.rows_in = np.concatenate([np.sort(w) for w in windows]) if windows else np.zeros(0, np.int64)
        self.starts = np.cumsum([0] + [len(w) for w in windows])
        self.tokens = int(lengths.sum())

    def __len__(self) -> int:
        return len(self.starts) - 1

    def head(self, count: int) -> "PackedRows":
        shorter = copy.copy(self)
        shorter.starts = self.starts[: min(count, len(self)) + 1]
        return shorter

    def __getitem__(self, index):
        x = np.zeros(self.context, dtype=np.int64)
        positions = np.zeros(self.context, dtype=np.int64)
        y = np.full(self.context, IGNORE_INDEX, dtype=np.int64)
        at = 0
        for row in self.rows_in[self.starts[int(index)] : self.starts[int(index) + 1]]:
            ids, targets = self.row(row)
            x[at : at + len(ids)], y[at : at + len(ids)] = ids, targets
            positions[at : at + len(ids)] = np.arange(len(ids))
            at += len(ids)
        return (torch.from_numpy(x), torch.from_numpy(positions)), torch.from_numpy(y)

    def describe(self) -> str:
        rows, windows = int(self.starts[-1]), len(self)
        filled = self.tokens / max(1, windows * self.context)
        return f"{rows:,} rows in {windows:,} windows of {self.context:,} tokens ({100 * filled:.1f}% filled)"


def best_fit(lengths: np.ndarray, context: int) -> list:
    """Rows of `lengths` tokens (each at most `context`) put into as few windows of `context` tokens as best fit
    decreasing finds: the longest row first, each into the fullest window it fits (a new one where none has room).
    Returns each window's row numbers. Deterministic; about a row per microsecond (the free room is kept as a
    sorted list of at most `context` distinct sizes)."""
    from bisect import bisect_left, insort

    windows, free, room = (
        [],
        {},
        [],
    )  # room: the sizes of free room some window has, sorted; free: size -> windows
    for row in np.argsort(-np.asarray(lengths), kind="stable"):
        length = int(lengths[row])
        if length == 0:
            continue
        at = bisect_left(room, length)
        if at == len(room):
            window, left = len(windows), context - length
            windows.append([row])
        else:
            size = room[at]
            window, left = free[size].pop(), size - length
            if not free[size]:
                del free[size], room[at]
            windows[window].append(row)
        if left:
            if left not in free:
                free[left] = []
                insort(room, left)
            free[left].append(window)
    return [np.asarray(window, dtype=np.int64) for window in windows]


@dataclass
class RowsPair(DatasetPair):
    """A `DatasetPair` of `TokenRows` with the vocabulary the model embeds and the run's tokenizer, if any."""

    vocab_size: int = 0
    folder: Optional[Path] = None
    tokenizer_file: Optional[Path] = None
    tokenizer_sha256: Optional[str] = None
    end_of_text_id: Optional[int] = None
    unit: str = "tokens"

    @property
    def num_classes(self) -> int:
        return self.vocab_size

    def head(self, samples: int) -> "RowsPair":
        """The same data with only the first `samples` training rows and as many validation rows (for `verify`,
        which compares the steps, not the validation)."""
        shorter = copy.copy(self)
        shorter.train, shorter.val = self.train.head(samples), self.val.head(samples)
        return shorter


def _column(table, name: str, what: str):
    """(per-row lengths, flat int64 values) of a column of lists of integers."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = table.column(name).combine_chunks()
    kind = column.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)):
        raise DataError(f"{what}: the column {name!r} holds {kind}, not lists of token ids")
    if not pa.types.is_integer(kind.value_type):
        raise DataError(f"{what}: the column {name!r} holds lists of {kind.value_type}, not of whole numbers")
    if column.null_count:
        row = int(np.flatnonzero(np.asarray(column.is_null()))[0])
        raise DataError(f"{what}, row {row}: {name} is empty (null); drop the row or fill it")
    lengths = np.asarray(pc.list_value_length(column), dtype=np.int64)
    return lengths, np.asarray(pc.list_flatten(column), dtype=np.int64)


def scan(rows, what: str, first: int = 0) -> Tuple[np.ndarray, int]:
    """(each row's tokens after its padding is cut off, the largest id or label), every row checked;
    one line naming `what` (the data, or its split) and the row (`first` is the number of the first) of the
    first that breaks a rule."""
    found, largest, base = [], -1, first
    columns = [name for name in COLUMNS if name in rows.column_names]
    for table in rows.select_columns(columns).with_format("arrow").iter(batch_size=SCAN_ROWS):
        lengths, ids = _column(table, "input_ids", what)
        row_of = np.repeat(np.arange(len(lengths)), lengths)
        position = np.arange(len(ids)) - np.repeat(np.cumsum(lengths) - lengths, lengths)

        def at(flags, base=base, row_of=row_of) -> str:
            """The split and row of the first token flagged."""
            return f"{what}, row {base + int(row_of[np.flatnonzero(flags)[0]])}"

        if (ids < 0).any():
            raise DataError(f"{at(ids < 0)}: input_ids holds a negative id; token ids are 0 or more")
        real = lengths
        if "attention_mask" in columns:
            mask_lengths, mask = _column(table, "attention_mask", what)
            if not np.array_equal(mask_lengths, lengths):
                bad = np.repeat(mask_lengths != lengths, lengths)
                raise DataError(f"{at(bad)}: attention_mask is not as long as input_ids")
            if not np.isin(mask, (0, 1)).all():
                raise DataError(
                    f"{at(~np.isin(mask, (0, 1)))}: attention_mask holds values other than 0 and 1"
                )
            real = np.zeros(len(lengths), dtype=np.int64)
            np.maximum.at(real, row_of[mask == 1], position[mask == 1] + 1)
            ones = np.bincount(row_of, weights=mask, minlength=len(lengths)).astype(np.int64)
            if (ones != real).any():
                row = base + int(np.flatnonzero(ones != real)[0])
                raise DataError(
                    f"{what}, row {row}: attention_mask has a 0 before the row's last 1 (padding on the left, or "
                    f"a hole); polytrain's models attend to every earlier token, so pad on the right only"
                )
        padding = position >= np.repeat(real, lengths)
        if "labels" in columns:
            label_lengths, labels = _column(table, "labels", what)
            if not np.array_equal(label_lengths, lengths):
                bad = np.repeat(label_lengths != lengths, lengths)
                raise DataError(
                    f"{at(bad)}: labels is not as long as input_ids (labels are aligned with input_ids; the "
                    f"model shifts them, as Hugging Face's do)"
                )
            bad = (labels < 0) & (labels != IGNORE_INDEX)
            if bad.any():
                raise DataError(
                    f"{at(bad)}: labels holds {int(labels[bad][0])}; a label is a token id or -100"
                )
            if (padding & (labels != IGNORE_INDEX)).any():
                raise DataError(
                    f"{at(padding & (labels != IGNORE_INDEX))}: a label that is not -100 where attention_mask is "
                    f"0; the mask must be 1 wherever a label trains (label the padding -100)"
                )
            largest = max(largest, int(labels.max(initial=-1)))
        largest = max(largest, int(ids[~padding].max(initial=-1)))
        found.append(np.asarray(real, dtype=np.int64))
        base += len(lengths)
    return (np.concatenate(found) if found else np.zeros(0, np.int64)), largest


def load_token_rows(
    train,
    val,
    *,
    held: bool,
    source: str,
    context: Optional[int],
    tokenizer: Optional[Path],
    model_vocabulary: Optional[int],
    init_from: Optional[str],
    pack: bool = False,
    show: bool = True,
) -> RowsPair:
    """The rows of `train` and `val` (`datasets.Dataset`s with `input_ids`; `held`: the last rows of one split)
    as a pair of padded samples, or with `pack` of windows of rows (`PackedRows`, said in a start line)."""
    from . import tokenizer as tokenizers_file

    lengths, largest = [], -1
    for split, rows, first in (("training", train, 0), ("validation", val, len(train))):
        what = f"--data-dir {source}" + ("" if held else f", {split} split")
        split_lengths, split_largest = scan(rows, what, first if held else 0)
        lengths.append(split_lengths)
        largest = max(largest, split_largest)
    longest = max(int(part.max(initial=0)) for part in lengths)
    vocabulary, sha256, eot = largest + 1, None, None
    if tokenizer is not None:
        model = tokenizers_file.load(tokenizer)
        vocabulary = model.get_vocab_size(with_added_tokens=True)
        tokenizers_file.check_tokenizer_fits(tokenizer, vocabulary, model_vocabulary, init_from)
        if largest >= vocabulary:
            raise DataError(
                f"--data-dir {source} holds token id {largest}, beyond the {vocabulary:,} tokens of the tokenizer "
                f"{tokenizer}; give the tokenizer that wrote the rows"
            )
        sha256 = tokenizers_file.file_sha256(tokenizer)
        eot = tokenizers_file.end_of_text(model, tokenizer)[1]
    if longest < 1:
        raise DataError(f"--data-dir {source} holds no tokens (every row is empty or padding)")
    if context is not None and longest > context:
        raise DataError(
            f"--data-dir {source} has rows of up to {longest:,} tokens, longer than --context {context:,}; give "
            f"--context {longest} or more (where the model's positions allow), or shorten the rows"
        )
    context = context or longest
    if pack:
        splits = [
            PackedRows(rows, context=context, lengths=part) for rows, part in zip((train, val), lengths)
        ]
        if show:
            print(f"packed: {splits[0].describe()} (validation: {splits[1].describe()})", flush=True)
    else:
        splits = [TokenRows(rows, context=context) for rows in (train, val)]
    pair = RowsPair(
        *splits,
        spec=None,
        name="hf",
        kind="language",
        vocab_size=max(1, vocabulary),
        folder=Path(source),
        tokenizer_file=tokenizer,
        tokenizer_sha256=sha256,
        end_of_text_id=eot,
    )
    pair.spec = spec_of(pair.train, num_classes=None)
    return pair
