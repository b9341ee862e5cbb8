"""Text for language models: a character vocabulary, the corpus as int64 token ids on the device, and
training samples that are windows of `context + 1` tokens (the input is the first `context`, the target the
last `context`: every position predicts the next character).

An epoch cuts the training split into windows that start every `context` tokens, so each character is a
target exactly once per epoch, from an offset drawn per epoch (seeded), so that the windows' boundaries move
between epochs; each epoch has the same number of windows, whatever its offset. The windows' order is the
seeded permutation every loader cuts (order.py), and each rank takes its slice of each global batch, exactly
as for images: one device and N devices see the same samples in the same steps, and a resume is exact.
Validation reads the validation split in windows from its start, every `context` tokens, so the whole split
is predicted once (but for a tail shorter than one window).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import numpy as np
import torch

from ..errors import DataError
from .order import Batch, eval_parts, global_batch_order, rank_slice

DEFAULT_CONTEXT = 64
TRAIN_FRACTION = 0.9
SHAKESPEARE = Path(__file__).with_name("shakespeare") / "input.txt"


def windows_in(length: int, context: int, *, shifted: bool) -> int:
    """Windows of `context + 1` tokens starting every `context` tokens in `length` tokens; `shifted`: for
    every start offset 0..context-1 (the training split), so the count does not depend on the offset."""
    return (length - context) // context if shifted else (length - 1) // context


class TokenDataset:
    """A tokenised text split into training and validation tokens (int64), with its vocabulary."""

    kind = "language"
    masks_labels = False  # every label is a token of the text, none IGNORE_INDEX (-100)
    unit = "characters"  # what one token of the text is

    def __init__(
        self,
        name: str,
        train_tokens: torch.Tensor,
        val_tokens: torch.Tensor,
        vocab: List[str],
        *,
        context: int = DEFAULT_CONTEXT,
        source: str = "",
    ):
        self.name, self.vocab, self.context = name, list(vocab), int(context)
        # int64 tensors in memory, or shards on disk read window by window (token_shards.MappedTokens)
        self.train_tokens, self.val_tokens = (
            tokens.long() if isinstance(tokens, torch.Tensor) else tokens
            for tokens in (train_tokens, val_tokens)
        )
        where = f" of {source}" if source else ""
        for split, tokens, shifted in (
            ("training", self.train_tokens, True),
            ("validation", self.val_tokens, False),
        ):
            if windows_in(len(tokens), self.context, shifted=shifted) < 1:
                need = 2 * self.context if shifted else self.context + 1
                raise DataError(
                    f"--context {self.context} is too long for the {len(tokens):,} {self.unit} of the "
                    f"{split} split{where} (it needs at least {need:,}); give a smaller --context "
                    f"or more text"
                )

    @property
    def num_classes(self) -> int:
        return len(self.vocab)

    @property
    def input_shape(self) -> Tuple[int]:
        return (self.context,)

    @property
    def num_train(self) -> int:
        return windows_in(len(self.train_tokens), self.context, shifted=True)

    @property
    def num_val(self) -> int:
        return windows_in(len(self.val_tokens), self.context, shifted=False)

    def sample_batch(self, count: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The first `count` training windows as (inputs, targets), int64 (N, context) each."""
        starts = torch.arange(min(count, self.num_train)) * self.context
        return pairs(self.train_tokens, starts, self.context)

    def sample_inputs(self, count: int) -> torch.Tensor:
        """The first `count` training windows' input ids (to probe a model's shapes and speed)."""
        return self.sample_batch(count)[0]

    def head(self, windows: int) -> "TokenDataset":
        """The same text with only the tokens of the first `windows` training windows and of as many validation
        windows (for `verify`, which compares the steps: the whole validation split, read at the epoch's end,
        would cost more than the steps themselves)."""
        shorter = copy.copy(self)
        shorter.train_tokens = self.train_tokens[: (max(1, windows) + 1) * self.context]
        shorter.val_tokens = self.val_tokens[: max(1, windows) * self.context + 1]
        return shorter


def pairs(
    tokens, starts: torch.Tensor, context: int, span: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), int64 (n, context) each, of the windows of `context + 1` tokens at `starts`: gathered
    apart from a tensor, so each is contiguous (nanoGPT's loss calls targets.view(-1)), or copied from the
    shards on disk (token_shards.MappedTokens) on the host. `span`: arange(context) on `starts`' device, made
    once by a loader that cuts many batches."""
    if isinstance(tokens, torch.Tensor):
        span = torch.arange(context, device=starts.device) if span is None else span
        positions = starts[:, None] + span
        return tokens[positions], tokens[positions + 1]
    rows = tokens.windows(starts.cpu().numpy(), context + 1)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def tokenise(text: str, *, name: str, context: int, source: str = "") -> TokenDataset:
    """Characters as ids into the sorted distinct characters; the first 90% train, the last 10% validate."""
    if not text:
        raise DataError(f"{source or name} holds no text; give a UTF-8 text file with some characters in it")
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    # the distinct code points, sorted, and each character's place among them, by a table over the code points
    # (one pass over the text, where sorting it, as np.unique does, took 0.24 s for Tiny Shakespeare's 1.1M)
    present = np.zeros(int(codes.max()) + 1, dtype=bool)
    present[codes] = True
    distinct = np.flatnonzero(present)
    place = np.cumsum(present, dtype=np.int64) - 1
    tokens = torch.from_numpy(place[codes])
    cut = int(len(tokens) * TRAIN_FRACTION)
    return TokenDataset(
        name, tokens[:cut], tokens[cut:], [chr(int(c)) for c in distinct], context=context, source=source
    )


def read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(
            f"{path} is not UTF-8 text (byte {error.start} is {error.object[error.start]:#04x}); "
            f"convert it, e.g. iconv -f latin1 -t utf-8 {path.name}"
        ) from None


def load_text(data_dir: Optional[str], *, context: int) -> TokenDataset:
    """`--dataset text --data-dir FILE_OR_FOLDER`: one UTF-8 file, or a folder's *.txt files joined in name
    order."""
    if data_dir is None:
        raise DataError(
            "--dataset text needs --data-dir FILE_OR_FOLDER: a UTF-8 text file, or a folder of .txt files"
        )
    path = Path(data_dir).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix == ".txt")
        if not files:
            raise DataError(
                f"--data-dir {path} holds no .txt files; give a UTF-8 text file or a folder of .txt files"
            )
        text = "".join(read_text(p) for p in files)
    elif path.is_file():
        text = read_text(path)
    else:
        raise DataError(f"--data-dir {path} does not exist; give a UTF-8 text file or a folder of .txt files")
    return tokenise(text, name="text", context=context, source=str(path))


def load_shakespeare(*, context: int) -> TokenDataset:
    return tokenise(read_text(SHAKESPEARE), name="shakespeare", context=context)


class TokenLoader:
    """Batches of (input ids, target ids), int64 (n, context) each, for one rank, from the split's tokens
    moved once to `device`, or from shards on disk, each batch's windows copied on the host and moved (pinned,
    without waiting, to a GPU). The same interface as the image loader (loader.DeviceLoader)."""

    def __init__(
        self,
        tokens: torch.Tensor,
        *,
        context: int,
        batch_size: int,
        device,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        training: bool = True,
    ):
        self.mapped = not isinstance(tokens, torch.Tensor)
        self.tokens = tokens if self.mapped else tokens.to(device)
        self.context, self.batch_size, self.training = context, batch_size, training
        self.device = torch.device(device)
        self.index_device = torch.device("cpu") if self.mapped else self.device  # where windows are cut
        self.span = torch.arange(context, device=self.index_device)
        self.rank, self.world_size, self.seed = rank, world_size, seed

    @property
    def num_samples(self) -> int:
        return windows_in(len(self.tokens), self.context, shifted=self.training)

    @property
    def tokens_per_sample(self) -> int:
        return self.context

    def __len__(self) -> int:
        return -(-self.num_samples // self.batch_size)

    def offset(self, epoch: int) -> int:
        """Where the epoch's first window starts: 0..context-1, drawn from the seed and the epoch."""
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 2 + 1)
        return int(torch.randint(0, self.context, (1,), generator=generator))

    def _batch(self, starts: torch.Tensor, global_count: int, step: int) -> Batch:
        x, y = pairs(self.tokens, starts, self.context, self.span)
        if self.mapped and self.device.type != "cpu":
            pin = self.device.type == "cuda"
            x, y = (
                t.pin_memory().to(self.device, non_blocking=True) if pin else t.to(self.device)
                for t in (x, y)
            )
        return Batch(x, y, global_count, step)

    def train_batches(self, epoch: int, *, start_step: int = 0) -> Iterator[Batch]:
        order = global_batch_order(self.num_samples, epoch=epoch, seed=self.seed).to(self.index_device)
        offset = self.offset(epoch)
        for step in range(start_step, len(self)):
            global_batch = order[step * self.batch_size : (step + 1) * self.batch_size]
            index = rank_slice(global_batch, rank=self.rank, world_size=self.world_size)
            yield self._batch(offset + index * self.context, len(global_batch), step)

    def eval_batches(self) -> Iterator[Batch]:
        parts = eval_parts(
            self.num_samples, rank=self.rank, world_size=self.world_size, batch_size=self.batch_size
        )
        for step, part in enumerate(parts):
            index = part.to(self.index_device)
            yield self._batch(index * self.context, len(index), step)


def make_token_loaders(
    dataset: TokenDataset,
    *,
    batch_size: int,
    device,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    eval_batch_size: Optional[int] = None,
):
    common = dict(context=dataset.context, device=device, rank=rank, world_size=world_size, seed=seed)
    train = TokenLoader(dataset.train_tokens, batch_size=batch_size, **common)
    val = TokenLoader(
        dataset.val_tokens, batch_size=eval_batch_size or max(batch_size, 256), training=False, **common
    )
    return train, val
