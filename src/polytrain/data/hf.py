"""`--dataset hf --data-dir DIR`: a dataset of the Hugging Face `datasets` library on disk, read offline.

DIR is a folder `Dataset.save_to_disk` or `DatasetDict.save_to_disk` wrote, or parquet, jsonl or arrow files
(one file, or a folder of them; files whose name or folder is `validation`, `valid`, `val` or `test`, alone or
before `-`, `_` or `.`, are the validation split). Of a DatasetDict, `train` is trained on and the first of
`validation`, `valid`, `val`, `test` validates; without such a split the last `--val-fraction` of the rows
(default 0.1, the built-in text's share) is held out. Nothing is downloaded: the library runs offline, and
files are converted to Arrow once (as the library does) into the cache folder below.

What the rows hold decides how they are read:
- `input_ids` (with `labels` and `attention_mask` where present): each row is one sample, as it is
  (token_rows.py).
- a text column (`--text-key`, default `text`): tokenized with the run's tokenizer (`--tokenizer`, else the
  tokenizer.json of the `--init-from` folder), written ONCE as token shards by the writer of `polytrain
  tokenize` (corpus.py `TokenShards`), each row a document followed by the end-of-text id, and read as
  `--dataset tokens` reads them (token_shards.py): packed windows of `--context` + 1 tokens. The shards lie in
  `polytrain-cache/` beside the data (inside DIR, or beside the file), in a folder named by the tokenizer's
  SHA-256 and the dataset's fingerprint, so a second run reads them without tokenizing and another tokenizer
  (or other rows) writes another folder; where DIR is not writable, under ~/.cache/polytrain/datasets/hf.
  Runs that start together (ranks under torchrun) take a file lock: one tokenizes, the others wait and read.
- a text column with a `label` (or `labels`) column: a sequence classifier's data, each row's text tokenized
  with the run's tokenizer and its class (text_classes.py); rows of `input_ids` with a `label` are refused in one
  line for now.
- instruction rows, `messages` or `prompt` and `completion`: formatted with the tokenizer's chat template, the
  answers' tokens trained (chat.py), then read as rows of `input_ids` and `labels`.

Every refusal is one line, before any worker starts: no such folder, no text column (naming the columns
present), a tokenizer larger than the model's embedding, a file that cannot be read.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from ..errors import DataError, UserError, first_line
from . import tokenizer as tokenizers_file
from .chat import is_instruction, load_instructions

VAL_FRACTION = 0.1  # held out where the data has no validation split: the built-in text's share (text.py)
VAL_SPLITS = ("validation", "valid", "val", "test")  # the first present validates
BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow"}
CACHE = "polytrain-cache"
ROWS = 1000  # rows read and encoded at a time


def datasets_library():
    """The `datasets` package, or one line that says how to install it."""
    try:
        import datasets
    except ImportError:
        raise UserError(
            "--dataset hf needs Hugging Face's datasets package; run: pip install 'polytrain[hf]' (or pip "
            "install datasets)"
        ) from None
    return datasets


@contextlib.contextmanager
def offline():
    """The `datasets` library (and the hub client under it) offline, quiet, within: everything is local, and
    polytrain says what it does in its own lines."""
    datasets = datasets_library()
    import huggingface_hub.constants as hub

    saved = (
        datasets.config.HF_HUB_OFFLINE,
        datasets.config.HF_DATASETS_OFFLINE,
        hub.HF_HUB_OFFLINE,
        datasets.utils.logging.get_verbosity(),
        datasets.utils.is_progress_bar_enabled(),
    )
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = hub.HF_HUB_OFFLINE = True
    datasets.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    try:
        yield datasets
    finally:
        datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, hub.HF_HUB_OFFLINE = saved[:3]
        datasets.utils.logging.set_verbosity(saved[3])
        if saved[4]:
            datasets.enable_progress_bars()


@dataclass
class Source:
    """What --data-dir names: a folder save_to_disk wrote (`files` empty), or data files of one `builder`."""

    path: Path
    builder: Optional[str] = None
    files: Dict[str, List[Path]] = field(
        default_factory=dict
    )  # split ("train", or a VAL_SPLITS name) -> files

    @property
    def home(self) -> Path:
        """The folder the cache lies in."""
        return self.path if self.path.is_dir() else self.path.parent


def _split_of(path: Path, root: Path) -> str:
    """The split a data file belongs to, by its name or a folder between it and `root`."""
    parts = [*path.relative_to(root).parent.parts, path.name] if path != root else [path.name]
    for part in parts:
        word = re.split(r"[-_.]", part.lower(), maxsplit=1)[0]
        if word in VAL_SPLITS:
            return word
    return "train"


def find_source(data_dir: Optional[str]) -> Source:
    if data_dir is None:
        raise DataError(
            "--dataset hf needs --data-dir DIR: a folder save_to_disk wrote, or parquet, jsonl or arrow files"
        )
    path = Path(data_dir).expanduser()
    if not path.exists():
        raise DataError(
            f"--data-dir {path} does not exist; give a folder save_to_disk wrote, or parquet, jsonl or arrow "
            f"files (a file or their folder)"
        )
    if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        return Source(path)
    if path.is_file():
        if path.suffix not in BUILDERS:
            raise DataError(
                f"--data-dir {path}: --dataset hf reads {', '.join(BUILDERS)} files or a folder save_to_disk "
                f"wrote; convert it, or give its folder"
            )
        files = [path]
    else:
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and p.suffix in BUILDERS
            and CACHE not in p.relative_to(path).parts
            and not p.name.startswith(("cache-", "."))  # the library's own caches of .map()
        )
        if not files:
            held = sorted(p.name for p in path.iterdir())[:6]
            raise DataError(
                f"--data-dir {path} holds no dataset: neither the dataset_dict.json or state.json of save_to_disk "
                f"nor {', '.join(BUILDERS)} files (it holds {', '.join(held) or 'nothing'})"
            )
    builders = sorted({BUILDERS[p.suffix] for p in files})
    if len(builders) > 1:
        raise DataError(
            f"--data-dir {path} mixes {' and '.join(builders)} files; give files of one kind (a folder of "
            f"their own)"
        )
    splits: Dict[str, List[Path]] = {}
    for file in files:
        splits.setdefault(_split_of(file, path), []).append(file)
    if "train" not in splits:
        raise DataError(
            f"--data-dir {path} holds only {', '.join(sorted(splits))} files; give the training files too (any "
            f"name but {', '.join(VAL_SPLITS)})"
        )
    return Source(path, builders[0], splits)


def cache_root(source: Source) -> Path:
    """polytrain-cache beside the data where that folder is writable, else one under ~/.cache/polytrain."""
    root = source.home / CACHE
    try:
        root.mkdir(exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root):
            pass
        return root
    except OSError:
        from .download import default_cache_dir

        key = hashlib.sha256(str(source.path.resolve()).encode()).hexdigest()[:16]
        fallback = default_cache_dir() / "hf" / f"{source.path.name}-{key}"
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


def _unreadable(what, error: BaseException) -> DataError:
    cause = error.__cause__ or error.__context__ if type(error).__name__ == "DatasetGenerationError" else None
    return DataError(
        f"{what} cannot be read ({type(cause or error).__name__}: {first_line(cause or error)}); it is damaged "
        f"or not in its format: copy or write it again"
    )


def _load_files(library, source: Source, split: str, cache: Path):
    files = source.files[split]
    try:
        return library.load_dataset(
            source.builder, data_files=[str(f) for f in files], split="train", cache_dir=str(cache / "arrow")
        )
    except Exception as error:  # pyarrow's and the library's own errors: find the file that fails alone
        if len(files) == 1:
            raise _unreadable(files[0], error) from None
        for file in files:
            try:
                for _ in library.load_dataset(
                    source.builder, data_files=[str(file)], split="train", streaming=True
                ).iter(batch_size=ROWS):
                    pass
            except Exception as alone:
                raise _unreadable(file, alone) from None
        raise _unreadable(f"--data-dir {source.path}", error) from None


def open_splits(source: Source, cache: Optional[Path]) -> Tuple[object, Optional[object]]:
    """(training rows, validation rows or None) as `datasets.Dataset`s."""
    with offline() as library:
        if not source.files:
            try:
                loaded = library.load_from_disk(str(source.path))
            except Exception as error:
                raise _unreadable(f"--data-dir {source.path}", error) from None
            if not isinstance(loaded, library.DatasetDict):
                return loaded, None
            if "train" not in loaded:
                raise DataError(
                    f"--data-dir {source.path} holds the splits {', '.join(loaded)}, none named train; save "
                    f"the training rows as DatasetDict(train=...)"
                )
            val = next((name for name in VAL_SPLITS if name in loaded), None)
            return loaded["train"], loaded[val] if val else None
        train = _load_files(library, source, "train", cache)
        val = next((name for name in VAL_SPLITS if name in source.files), None)
        rows = _load_files(library, source, val, cache) if val else None
        return train, rows


def held_out(train, val, val_fraction: Optional[float], source: Source):
    """(training rows, validation rows): `val` as it is, or the last `val_fraction` of `train`'s rows
    (at least one, at most all but one)."""
    if val is not None:
        return train, val
    rows = len(train)
    if rows < 2:
        raise DataError(
            f"--data-dir {source.path} holds {rows} row{'s' * (rows != 1)} and no validation split; give at "
            f"least 2 rows (the last --val-fraction are held out), or a validation split"
        )
    held = min(rows - 1, max(1, math.ceil((val_fraction or VAL_FRACTION) * rows)))
    return train.select(range(rows - held)), train.select(range(rows - held, rows))


def find_run_tokenizer(tokenizer: Optional[str], init_from: Optional[str]) -> Optional[Path]:
    """--tokenizer, else the --init-from folder's tokenizer.json, else None; both given and different: one
    line (the ids of one would stand for other text in the other's model)."""
    given = tokenizers_file.find_tokenizer(tokenizer) if tokenizer is not None else None
    kept = Path(init_from).expanduser() / tokenizers_file.FILE if init_from is not None else None
    if kept is None or not kept.is_file():
        return given
    if given is not None and tokenizers_file.file_sha256(given) != tokenizers_file.file_sha256(kept):
        raise DataError(
            f"--tokenizer {given} is not the tokenizer of --init-from {init_from} ({kept}: its SHA-256 differs), "
            f"so its ids would stand for other text in that model; drop --tokenizer to use the checkpoint's"
        )
    return given or kept


def load_hf(
    data_dir: Optional[str],
    *,
    context: Optional[int],
    tokenizer: Optional[str] = None,
    text_key: str = "text",
    val_fraction: Optional[float] = None,
    init_from: Optional[str] = None,
    model_vocabulary: Optional[int] = None,
    show: bool = True,
    train_on_prompt: bool = False,
    pack: bool = False,
):
    """The dataset in `data_dir`: a `TokenRows` pair of its `input_ids` rows, its text column as cached token
    shards (`ShardedTokens`), or its texts and their classes (`ClassesPair`, with a label column)."""
    source = find_source(data_dir)
    datasets_library()
    cache = cache_root(source) if source.files else None  # files: their Arrow copies; text: its shards
    train, val = open_splits(source, cache)
    columns = list(train.column_names)
    run_tokenizer = find_run_tokenizer(tokenizer, init_from)
    # a class per row beside its text or ids (`labels` beside input_ids are a language model's, per token)
    label = "label" if "label" in columns else "labels" if "input_ids" not in columns else None
    inputs = "input_ids" if "input_ids" in columns else text_key
    if label in columns and inputs == "input_ids":
        raise DataError(
            f"--data-dir {source.path} has the columns {inputs!r} and {label!r}: rows of ids for a sequence "
            f"classifier, which --dataset hf does not train yet; give the rows' text instead (a text column "
            f"and {label!r}), or drop the {label!r} column to train a language model on its ids"
        )
    if train_on_prompt and not is_instruction(columns):
        raise DataError(
            f"--train-on-prompt trains instruction rows (messages, or prompt and completion) on every token, and "
            f"--data-dir {source.path} has none (its columns: {', '.join(columns)}); drop --train-on-prompt"
        )
    if pack and not (is_instruction(columns) or "input_ids" in columns):
        raise DataError(
            f"--pack packs rows of ids or instruction rows into windows, and --data-dir {source.path} holds text, "
            f"which is read as one stream of full windows already; drop --pack"
        )
    if is_instruction(columns) or "input_ids" in columns:  # rows of ids; instructions become them (chat.py)
        from .token_rows import load_token_rows

        held = val is None
        train, val = held_out(train, val, val_fraction, source)
        rows = dict(held=held, source=str(source.path), context=context, tokenizer=run_tokenizer)
        rows.update(model_vocabulary=model_vocabulary, init_from=init_from, pack=pack, show=show)
        if not is_instruction(columns):
            return load_token_rows(train, val, **rows)
        with offline():  # (quiet: the rows are mapped without the library's progress bars)
            return load_instructions(train, val, train_on_prompt=train_on_prompt, **rows)
    if text_key not in columns:
        raise DataError(
            f"--data-dir {source.path} has no text column {text_key!r} (its columns: {', '.join(columns)}); name "
            f"the text column with --text-key, or give rows of input_ids"
        )
    kind = train.features[text_key]
    if getattr(kind, "dtype", None) not in ("string", "large_string"):
        raise DataError(
            f"--data-dir {source.path}: the column {text_key!r} holds {kind}, not text; name the text column "
            f"with --text-key"
        )
    if run_tokenizer is None:
        raise DataError(
            f"--data-dir {source.path} holds text, which needs a tokenizer: give --tokenizer FILE (a tokenizer.json, "
            f"or a folder holding one), --init-from a checkpoint folder that holds one, or write token shards "
            f"with polytrain tokenize and train on --dataset tokens"
        )
    if label in columns:  # a class per text: a sequence classifier's data
        from .text_classes import load_text_classes

        held = val is None
        train, val = held_out(train, val, val_fraction, source)
        return load_text_classes(
            source,
            functools.partial(written_once, cache or cache_root(source), last="rows.json"),
            train,
            val,
            held=held,
            label=label,
            text_key=text_key,
            context=context,
            tokenizer=run_tokenizer,
            model_vocabulary=model_vocabulary,
            init_from=init_from,
            val_fraction=val_fraction,
            show=show,
        )
    from .text import DEFAULT_CONTEXT
    from .token_shards import check_shards, load_token_shards, read_manifest

    settings = dict(
        tokenizer=run_tokenizer,
        text_key=text_key,
        val_fraction=val_fraction,
        model_vocabulary=model_vocabulary,
        init_from=init_from,
        show=show,
    )
    read = dict(context=context or DEFAULT_CONTEXT, name="hf", source=str(source.path))
    cache = cache or cache_root(source)
    folder = tokenized(source, cache, train, val, **settings)
    try:
        check_shards(folder, read_manifest(folder))
    except DataError as error:  # the cache damaged since it was written: it is ours to write again
        if show:
            print(f"{error}; tokenizing again", flush=True)
        shutil.rmtree(folder, ignore_errors=True)
        cache = cache or cache_root(source)
    folder = tokenized(source, cache, train, val, **settings)
    return load_token_shards(str(folder), **read)


def documents(rows, text_key: str, split: str) -> Iterator:
    """The pieces of each row's text (corpus.py's cut, so that the pieces' ids are the whole text's), the last
    of a row ending its document."""
    from .corpus import Piece, _cut

    for batch in rows.select_columns([text_key]).iter(batch_size=ROWS):
        for text in batch[text_key]:
            pieces, _ = _cut(text or "", final=True)
            for index, piece in enumerate(pieces):
                yield Piece(piece, len(piece.encode("utf-8")), 0, index == len(pieces) - 1, split)


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock on `path` (created) within: processes that start together tokenize once."""
    try:
        import fcntl
    except ImportError:  # no POSIX locks: each writes its own folder and the first rename wins
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cache_key(train, val, *, sha256: str, text_key: str, val_fraction: Optional[float], held: bool) -> str:
    """The cache folder's name: the tokenizer's SHA-256 and the rows' fingerprints (the library's: from the
    saved state, or from the files' names, sizes and times), with what decides which ids are written."""
    from .corpus import FORMAT

    what = dict(
        format=FORMAT,
        train=train._fingerprint,
        val=val._fingerprint,
        text_key=text_key,
        held_out=val_fraction or VAL_FRACTION if held else None,
    )
    data = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()
    return f"tokens-{sha256[:16]}-{data[:16]}"


def tokenized(
    source: Source,
    cache: Path,
    train,
    val,
    *,
    tokenizer: Path,
    text_key: str,
    val_fraction: Optional[float],
    model_vocabulary: Optional[int],
    init_from: Optional[str],
    show: bool,
) -> Path:
    """The folder of token shards of the text column: written here once (under a lock), then reused."""
    from .corpus import MANIFEST, Progress, TokenShards, batches_of

    model = tokenizers_file.load(tokenizer)
    tokenizers_file.check_tokenizer_fits(
        tokenizer, model.get_vocab_size(with_added_tokens=True), model_vocabulary, init_from
    )
    sha256 = tokenizers_file.file_sha256(tokenizer)
    held = val is None
    train, val = held_out(train, val, val_fraction, source)
    name = cache_key(train, val, sha256=sha256, text_key=text_key, val_fraction=val_fraction, held=held)

    def write(partial: Path) -> None:
        shutil.copyfile(tokenizer, partial / tokenizers_file.FILE)
        shards = TokenShards(partial, model, named=tokenizer, end_of_text=None, shard_tokens=100_000_000)
        total = sum(rows.data.column(text_key).nbytes for rows in (train, val))
        progress = Progress(f"tokenizing {source.path} into {cache / name}", total, show=show)
        try:
            for split, rows in (("train", train), ("val", val)):
                for batch in batches_of(documents(rows, text_key, split)):
                    shards.add(batch)
                    progress.update(sum(piece.nbytes for piece in batch))
        except UserError:
            raise
        except Exception as error:  # a row group or batch that cannot be decoded
            raise _unreadable(f"--data-dir {source.path}", error) from None
        shards.finish(
            source=str(tokenizer.resolve()),
            corpus=dict(data=str(source.path.resolve()), rows=len(train) + len(val), text_key=text_key),
            seconds=progress.close(),
        )

    return written_once(cache, name, write, last=MANIFEST)


def written_once(cache: Path, name: str, write: Callable[[Path], None], *, last: str) -> Path:
    """The folder `cache / name`: where it holds `last` (the file written last), as it is; else `write(partial)`
    fills a folder of its own that then takes the name, under a lock, so that processes starting together
    write it once and an interrupted write leaves nothing a reader takes."""
    folder = cache / name
    with locked(cache / f".{name}.lock"):
        if (folder / last).is_file():
            return folder
        for leftover in cache.glob(f".{name}.partial-*"):  # an interrupted run's (we hold the lock)
            shutil.rmtree(leftover, ignore_errors=True)
        partial = cache / f".{name}.partial-{os.getpid()}"
        partial.mkdir()
        write(partial)
        os.replace(partial, folder)
    return folder
