"""A run's tokenizer: a Hugging Face `tokenizers` file (tokenizer.json), read, trained or named by its hash.

`polytrain tokenize` either trains a byte-level BPE tokenizer on the corpus (`train_byte_bpe`: GPT-2's scheme,
every byte a token of its own before any merge, so any text encodes, and `<|endoftext|>` as the one special
token) or takes a tokenizer.json the user gives (or the one inside a Hugging Face checkpoint folder). The file
is copied byte for byte beside the token shards and into the run folder, and named by its SHA-256: shards
written by one tokenizer are never read by a run of another. A checkpoint's other tokenizer files
(`COMPANIONS`: its tokenizer_config.json with the special tokens, its chat template) travel with it, so that
`polytrain export --format hf` writes a folder AutoTokenizer loads.

Documents are separated by the tokenizer's end-of-text token, found by name among its special tokens
(`END_OF_TEXT`: GPT-2's and Qwen2's `<|endoftext|>`, Llama 3's `<|end_of_text|>`, SentencePiece's `</s>`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Optional

from ..errors import DataError, UserError

FILE = "tokenizer.json"
# what transformers writes beside tokenizer.json (save_pretrained): the tokenizer's class, its special tokens
# and chat template; kept with the tokenizer from a checkpoint, so that an export loads with AutoTokenizer
COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json")
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
TRAINED_END_OF_TEXT = "<|endoftext|>"


def tokenizers_library():
    """The `tokenizers` package, or one line that says how to install it."""
    try:
        import tokenizers
    except ImportError:
        raise UserError(
            "token data needs Hugging Face's tokenizers package; run: pip install 'polytrain[text]' "
            "(or pip install tokenizers)"
        ) from None
    return tokenizers


def file_sha256(path: Path, block: int = 1 << 24) -> str:
    """The SHA-256 of a file, read in blocks (memory stays flat whatever its size)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def find_tokenizer(path: str) -> Path:
    """`--tokenizer FILE`, or a folder that holds tokenizer.json (a Hugging Face checkpoint's)."""
    where = Path(path).expanduser()
    if where.is_dir():
        if not (where / FILE).is_file():
            raise UserError(
                f"{where} holds no {FILE}; give the tokenizer file itself, or a checkpoint folder "
                f"save_pretrained wrote with its tokenizer"
            )
        where = where / FILE
    if not where.is_file():
        raise UserError(f"tokenizer {where} does not exist; give a tokenizer.json written by Hugging Face")
    return where


def companions(tokenizer_file: Path) -> list:
    """The files of `COMPANIONS` that lie beside `tokenizer_file` (in a checkpoint folder, or copied with it)."""
    folder = Path(tokenizer_file).parent
    return [folder / name for name in COMPANIONS if (folder / name).is_file()]


def checkpoint_folder(path: str) -> Optional[Path]:
    """The model folder whose tokenizer `--tokenizer path` names: the folder given, or the one holding the file
    given, where it also holds a config.json (as a Hugging Face checkpoint and a polytrain run do, both of
    which --init-from loads); None for a tokenizer on its own."""
    where = Path(path).expanduser()
    folder = where if where.is_dir() else where.parent
    return folder if (folder / "config.json").is_file() else None


def load(path: Path):
    """The tokenizer in `path`, or one line naming the file and what is wrong with it."""
    library = tokenizers_library()
    try:
        return library.Tokenizer.from_file(str(path))
    except Exception as error:  # the library raises its own Exception subclass for any unreadable file
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise DataError(
            f"{path} is not a tokenizer the tokenizers library reads ({message}); give a tokenizer.json "
            f"written by Hugging Face (tokenizer.save or save_pretrained)"
        ) from None


def end_of_text(tokenizer, path: Path, name: Optional[str] = None) -> tuple:
    """(the end-of-text token, its id): `name` if given, else the first of `END_OF_TEXT` the tokenizer has."""
    for token in (name,) if name else END_OF_TEXT:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token, int(token_id)
    if name:
        raise UserError(f"--end-of-text {name!r} is not a token of {path}; give one of its special tokens")
    raise UserError(
        f"{path} has none of the end-of-text tokens {', '.join(END_OF_TEXT)}; name the token that "
        f"separates its documents with --end-of-text TOKEN"
    )


def train_byte_bpe(texts: Iterable[str], *, vocab_size: int, length: Optional[int] = None):
    """A byte-level BPE tokenizer of `vocab_size` tokens (GPT-2's pre-tokenizer and byte alphabet, then
    merges learnt from `texts`, an iterator read once), with `<|endoftext|>` as its special token."""
    library = tokenizers_library()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise UserError(
            f"--vocab-size {vocab_size} is below the {len(alphabet) + 1} tokens a byte-level BPE needs (256 "
            f"bytes and the end-of-text token); give more"
        )
    tokenizer = library.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[TRAINED_END_OF_TEXT],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    return tokenizer


def check_tokenizer_fits(path: Path, vocabulary: int, model_vocabulary: Optional[int], init_from) -> None:
    """One line where the tokenizer has more tokens than the model's embedding has rows."""
    if model_vocabulary is None or vocabulary <= model_vocabulary:
        return
    whose = f"--init-from {init_from}'s vocab_size" if init_from is not None else "--vocab-size"
    raise DataError(
        f"the tokenizer {path} has {vocabulary:,} tokens, more than the {model_vocabulary:,} rows of the model's "
        f"embedding ({whose}); its ids beyond would index nothing: use the model's own tokenizer"
    )
