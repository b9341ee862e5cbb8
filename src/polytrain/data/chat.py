"""Instruction data (`--dataset hf` rows of `messages`, or of `prompt` and `completion`): each row tokenized into
one sample of `input_ids` and `labels`, the loss on the answers only, then read as rows of ids are
(token_rows.py).

- `messages`: a list of `{"role", "content"}` (system, user, assistant, tool), formatted with the tokenizer's chat
  template (transformers' `apply_chat_template`, the template of the run's tokenizer folder: `--tokenizer`, else
  the `--init-from` checkpoint). The tokens of each assistant turn (its end-of-turn token included, so that the
  model learns to stop) are trained; every other token has the label -100. A turn's tokens are found by the
  characters the template renders for it: the conversation up to the turn with the generation prompt, then up to
  its end (the template must render a conversation's start as the start of the whole, as chat templates do; one
  line where it does not), each token labelled by where its first character lies in the whole (the tokenizer's
  offsets, so that a token spanning two parts is counted once).
- `prompt` and `completion`: text (the prompt tokenized as the tokenizer does, with its special tokens, then the
  completion and the end-of-text token, as TRL's prompt-completion rows), or lists of messages (a conversation
  and its answer, through the chat template); the completion's tokens are trained.

`--train-on-prompt` trains every token instead (the prompt masking is said in a start line either way). A row
longer than `--context` is cut to it, with a count in a start line; short rows are padded (token_rows.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Tuple

from ..errors import DataError, UserError

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant", "tool")


def is_instruction(columns) -> bool:
    """Whether rows with `columns` are instruction data: `messages`, or `prompt` and `completion`."""
    return "input_ids" not in columns and ("messages" in columns or {"prompt", "completion"} <= set(columns))


def chat_tokenizer(tokenizer_file: Path):
    """transformers' fast tokenizer of a tokenizer folder (`tokenizer.json` with the checkpoint's
    `tokenizer_config.json`: its special tokens and chat template)."""
    try:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
    except ImportError:
        raise UserError(
            "instruction data (messages or prompt/completion rows) needs transformers: pip install transformers"
        ) from None
    folder = Path(tokenizer_file).parent
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (
        Exception
    ):  # a tokenizer.json alone (no tokenizer_config.json): no template, no special tokens known
        return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))


def _check_messages(messages, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise DataError(
            f"{where}: messages must be a non-empty list of {{role, content}}, got {messages!r:.80}"
        )
    for message in messages:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DataError(f"{where}: each message must have a role and a content, got {message!r:.80}")
        if message["role"] not in ROLES:
            raise DataError(
                f"{where}: a message has the role {message['role']!r}; the roles are {', '.join(ROLES)}"
            )


def encode_conversation(
    tok, messages: list, *, trained_from: int = 0, train_on_prompt: bool = False, where: str = "a row"
) -> Tuple[List[int], List[int]]:
    """(input_ids, labels) of `messages` through `tok`'s chat template: the assistant turns from message
    `trained_from` on trained, every other token -100 (all trained with `train_on_prompt`)."""
    _check_messages(messages, where)
    if not getattr(tok, "chat_template", None):
        raise DataError(
            f"{where} holds messages, and the tokenizer has no chat template to format them; give --tokenizer (or "
            f"--init-from) a checkpoint folder whose tokenizer_config.json has a chat_template, or give rows of "
            f"prompt and completion text"
        )
    whole = tok.apply_chat_template(messages, tokenize=False)
    encoded = tok(whole, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    if train_on_prompt:
        return ids, list(ids)
    spans = []
    for k in range(trained_from, len(messages)):
        if messages[k]["role"] != "assistant":
            continue
        before = (
            tok.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True) if k else ""
        )
        through = tok.apply_chat_template(messages[: k + 1], tokenize=False)
        if not (whole.startswith(through) and through.startswith(before)):
            raise DataError(
                f"{where}: the tokenizer's chat template does not render the start of a conversation as the start "
                f"of the whole, so the answers' tokens cannot be told apart; give --train-on-prompt to train on "
                f"every token, or another template"
            )
        spans.append((len(before), len(through)))
    labels = [
        token if any(start <= first < end for start, end in spans) else IGNORE_INDEX
        for token, (first, _) in zip(ids, encoded["offset_mapping"])
    ]
    return ids, labels


def encode_completion(tok, prompt, completion, *, train_on_prompt: bool = False, where: str = "a row"):
    """(input_ids, labels) of a prompt and its completion: text (the prompt as the tokenizer encodes it, the
    completion and the end-of-text token after it, trained), or lists of messages (through the chat template,
    the completion's turns trained)."""
    if isinstance(prompt, list) and isinstance(completion, list):
        return encode_conversation(
            tok, prompt + completion, trained_from=len(prompt), train_on_prompt=train_on_prompt, where=where
        )
    if not (isinstance(prompt, str) and isinstance(completion, str)):
        raise DataError(
            f"{where}: prompt and completion must both be text or both lists of messages, got "
            f"{type(prompt).__name__} and {type(completion).__name__}"
        )
    asked = list(tok(prompt)["input_ids"])
    answer = list(tok(completion, add_special_tokens=False)["input_ids"])
    answer += [tok.eos_token_id] if tok.eos_token_id is not None else []
    labels = (asked if train_on_prompt else [IGNORE_INDEX] * len(asked)) + answer
    return asked + answer, labels


def tokenized_rows(rows, tok, *, train_on_prompt: bool, context: Optional[int], what: str):
    """`rows` (a datasets.Dataset of instruction data) as rows of input_ids and labels, each cut to `context`
    tokens; (the rows, how many were cut)."""
    conversations = "messages" in rows.column_names

    def encode(row, index):
        where = f"{what}, row {index}"
        if conversations:
            ids, labels = encode_conversation(
                tok, row["messages"], train_on_prompt=train_on_prompt, where=where
            )
        else:
            ids, labels = encode_completion(
                tok, row["prompt"], row["completion"], train_on_prompt=train_on_prompt, where=where
            )
        cut = context is not None and len(ids) > context
        if cut:
            ids, labels = ids[:context], labels[:context]
        return {"input_ids": ids, "labels": labels, "cut": cut}

    done = rows.map(encode, with_indices=True, remove_columns=rows.column_names, keep_in_memory=True)
    cut = sum(done["cut"])
    return done.remove_columns("cut"), cut


def load_instructions(
    train,
    val,
    *,
    held: bool,
    source: str,
    context: Optional[int],
    tokenizer: Optional[Path],
    model_vocabulary: Optional[int],
    init_from: Optional[str],
    train_on_prompt: bool = False,
    pack: bool = False,
    show: bool = True,
):
    """The instruction rows of `train` and `val` as padded samples of input_ids and labels (token_rows.py)."""
    from .token_rows import load_token_rows

    if tokenizer is None:
        raise DataError(
            f"--data-dir {source} holds instruction rows, which need the model's tokenizer and its chat template: "
            f"give --init-from the checkpoint (or --tokenizer its folder)"
        )
    tok = chat_tokenizer(tokenizer)
    kind = "conversations" if "messages" in train.column_names else "prompt and completion rows"
    cut = 0
    encoded = []
    for split, rows in (("training", train), ("validation", val)):
        what = f"--data-dir {source}" + ("" if held else f", {split} split")
        done, dropped = tokenized_rows(rows, tok, train_on_prompt=train_on_prompt, context=context, what=what)
        encoded.append(done)
        cut += dropped
    if show:
        how = (
            "every token trained (--train-on-prompt)"
            if train_on_prompt
            else "the loss on the answers' tokens only (--train-on-prompt trains on every token)"
        )
        formatted = (
            " formatted with the tokenizer's chat template" if "messages" in train.column_names else ""
        )
        line = f"instruction data: {len(train) + len(val):,} {kind}{formatted}, {how}"
        if cut:
            line += f"; {cut:,} rows longer than --context {context} cut to it"
        print(line, flush=True)
    return load_token_rows(
        encoded[0],
        encoded[1],
        held=held,
        source=source,
        context=context,
        tokenizer=tokenizer,
        model_vocabulary=model_vocabulary,
        init_from=init_from,
        pack=pack,
        show=show,
    )
