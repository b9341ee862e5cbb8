"""Instruction data (`--dataset hf` rows of `messages`, or of `prompt` and `completion`: data/chat.py): the tokens
trained are exactly the answers' (each assistant turn with its end-of-turn token; a completion with the
end-of-text token), checked by decoding them; --train-on-prompt trains all; rows longer than --context are cut
and counted; a LoRA fine-tune of a Hugging Face Llama on conversations verifies in float64 on 2 devices; bad
rows are one line. The tokenizer, its ChatML template and the checkpoint are written here.
"""

from pathlib import Path

import pytest
import torch
from conftest import polytrain_here

from polytrain.cli import main
from polytrain.data.chat import IGNORE_INDEX, chat_tokenizer, encode_completion, encode_conversation
from polytrain.errors import DataError

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = ["the cat sat on the mat", "what is two plus two", "four", "hello there how are you", "fine thanks"]


def conversation(i: int) -> list:
    return [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is two plus two" if i % 2 else "hello there"},
        {"role": "assistant", "content": "four" if i % 2 else "fine thanks"},
        {"role": "user", "content": "the cat"},
        {"role": "assistant", "content": "sat on the mat"},
    ]


def write_checkpoint(folder: Path, *, template: bool = True) -> None:
    """A byte-level BPE tokenizer of 300 tokens (ChatML's special tokens among them, its template where asked)
    and a Llama of its vocabulary, as save_pretrained writes them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        WORDS * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=specials, initial_alphabet=alphabet)
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    if template:
        fast.chat_template = CHATML
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(fast),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("base")
    write_checkpoint(folder)
    return folder


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("chats") / "data"
    rows = [{"messages": conversation(i)} for i in range(24)]
    train, val = datasets.Dataset.from_list(rows[:20]), datasets.Dataset.from_list(rows[20:])
    datasets.DatasetDict(train=train, validation=val).save_to_disk(str(folder))
    return folder


def trained_text(tok, labels) -> str:
    return tok.decode([label for label in labels if label != IGNORE_INDEX])


def test_the_answers_are_trained_and_nothing_else(base):
    tok = chat_tokenizer(base / "tokenizer.json")
    ids, labels = encode_conversation(tok, conversation(0))
    assert len(ids) == len(labels) and tok.decode(ids) == tok.apply_chat_template(
        conversation(0), tokenize=False
    )
    assert trained_text(tok, labels) == "fine thanks<|im_end|>\nsat on the mat<|im_end|>\n"
    assert encode_conversation(tok, conversation(0), train_on_prompt=True) == (ids, ids)
    # prompt and completion as text: the completion and the end-of-text token
    ids, labels = encode_completion(tok, "what is two plus two? ", "four")
    assert tok.decode(ids) == "what is two plus two? four<|im_end|>"
    assert trained_text(tok, labels) == "four<|im_end|>"
    # as messages: the completion's turn only, though the prompt holds an assistant turn too
    prompt, completion = conversation(1)[:4], conversation(1)[4:]
    ids, labels = encode_completion(tok, prompt, completion)
    assert trained_text(tok, labels) == "sat on the mat<|im_end|>\n"


def test_bad_rows_are_one_line_each(base, tmp_path):
    tok = chat_tokenizer(base / "tokenizer.json")
    with pytest.raises(
        DataError, match="a message has the role 'robot'; the roles are system, user, assistant"
    ):
        encode_conversation(tok, [{"role": "robot", "content": "beep"}])
    with pytest.raises(DataError, match="must both be text or both lists of messages"):
        encode_completion(tok, "a prompt", ["not", "text"])
    bare = tmp_path / "bare"
    write_checkpoint(bare, template=False)
    with pytest.raises(DataError, match="the tokenizer has no chat template"):
        encode_conversation(chat_tokenizer(bare / "tokenizer.json"), conversation(0))


@pytest.mark.parametrize(
    "rows, argv, words",
    [
        (
            [{"messages": [{"role": "robot", "content": "beep"}]}] * 4,
            [],
            ["row 0: a message has the role 'robot'"],
        ),
        ([{"text": "the cat sat"}] * 4, ["--train-on-prompt"], ["--train-on-prompt trains instruction rows"]),
    ],
    ids=["unknown-role", "train-on-prompt-without-instructions"],
)
def test_refused_in_one_line_before_any_run_folder(base, tmp_path, capsys, rows, argv, words):
    data = tmp_path / "data"
    datasets.Dataset.from_list(rows).save_to_disk(str(data))
    capsys.readouterr()
    out = tmp_path / "out"
    code = main(
        [
            "train",
            "--init-from",
            str(base),
            "--dataset",
            "hf",
            "--data-dir",
            str(data),
            *argv,
            "--out",
            str(out),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("polytrain: error:") and err.count("\n") == 1, err
    assert all(word in err for word in words), err
    assert not out.exists()


def test_a_run_on_conversations_says_what_it_trains_and_cuts_long_rows(base, chats, tmp_path, capfd):
    done = polytrain_here(
        capfd, "train", "--init-from", base, "--dataset", "hf", "--data-dir", chats, "--context", "48",
        "--max-steps", "2", "--lora", "4", "--out", tmp_path / "run",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert (
        "instruction data: 24 conversations formatted with the tokenizer's chat template, the loss on the answers' "
        "tokens only (--train-on-prompt trains on every token); 24 rows longer than --context 48 cut to it"
    ) in done.stdout, done.stdout


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "strategy, packing",
    [("data", []), ("sharded", []), ("sharded", ["--pack"])],
    ids=["data", "sharded", "sharded-packed"],
)
def test_a_lora_fine_tune_on_conversations_verifies_in_float64(base, chats, capfd, strategy, packing):
    """Also with the conversations packed two to a window of 160 tokens (tests/test_pack.py)."""
    context = "160" if packing else "80"
    done = polytrain_here(
        capfd, "verify", "--init-from", base, "--dataset", "hf", "--data-dir", chats, "--context", context,
        "--lora", "4", "--strategy", strategy, "--devices", "2", "--steps", "3", "--batch-size", "4", *packing,
    )  # fmt: skip
    assert done.returncode == 0 and "PASS" in done.stdout, done.stdout + done.stderr
    assert ("packed: 20 rows in 10 windows of 160 tokens" in done.stdout) == bool(packing), done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 3 and all(float(row[3]) < 1e-12 for row in rows), done.stdout
