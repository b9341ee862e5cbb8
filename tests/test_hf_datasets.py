"""`--dataset hf`: datasets the Hugging Face `datasets` library wrote (save_to_disk, parquet, jsonl, arrow),
read offline, built here by the tests.

A text column is tokenized once into token shards beside the data, holding exactly each row's ids followed by
the end-of-text id, and read as `--dataset tokens` reads them; a second run reuses them and another tokenizer
writes others. Rows of `input_ids` are samples as they are (labels shifted as Hugging Face's models shift
them, -100 and padding masked): one device and two ranks train the weights of SGD written by hand on the
same rows. Bad input is one line each.
"""

import json
import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hand_sgd import plain_sgd
from masked_tokens import token_model

datasets = pytest.importorskip("datasets")
datasets.disable_progress_bars()

import polytrain  # noqa: E402
from polytrain.cli import main  # noqa: E402
from polytrain.commands import generate_text  # noqa: E402
from polytrain.data import corpus, load_dataset  # noqa: E402
from polytrain.data import tokenizer as tokenizers_file  # noqa: E402
from polytrain.data.hf import VAL_FRACTION  # noqa: E402
from polytrain.data.order import global_batch_order  # noqa: E402
from polytrain.data.token_rows import TokenRows  # noqa: E402
from polytrain.errors import DataError  # noqa: E402

SHAKESPEARE = corpus.Path(polytrain.__file__).with_name("data") / "shakespeare" / "input.txt"


def _paragraphs(count: int):
    text = SHAKESPEARE.read_text()
    return [p for p in text.split("\n\n") if p.strip()][:count]


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """A DatasetDict of 120 training and 20 validation paragraphs saved to disk, and two tokenizers."""
    root = tmp_path_factory.mktemp("hf")
    paragraphs = _paragraphs(140)
    dataset = datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"text": paragraphs[:120], "id": list(range(120))}),
        validation=datasets.Dataset.from_dict({"text": paragraphs[120:], "id": list(range(20))}),
    )
    dataset.save_to_disk(str(root / "saved"))
    for name, size in (("a.json", 300), ("b.json", 320)):
        tokenizers_file.train_byte_bpe(iter(paragraphs), vocab_size=size).save(str(root / name))
    return root, paragraphs


def _ids(tokens):
    return tokens.windows([0], len(tokens))[0].tolist()


def _expected(tokenizer_file, rows):
    tokenizer = tokenizers_file.load(tokenizer_file)
    eot = tokenizer.token_to_id("<|endoftext|>")
    return sum((tokenizer.encode(row, add_special_tokens=False).ids + [eot] for row in rows), [])


def test_a_text_column_is_tokenized_once_per_tokenizer_and_read_as_token_shards(texts, monkeypatch):
    root, paragraphs = texts
    data = load_dataset("hf", data_dir=str(root / "saved"), tokenizer=str(root / "a.json"), context=16)
    assert data.name == "hf" and data.num_classes == 300 and data.input_shape == (16,)
    assert _ids(data.train_tokens) == _expected(root / "a.json", paragraphs[:120])
    assert _ids(data.val_tokens) == _expected(root / "a.json", paragraphs[120:])
    assert data.folder.parent == root / "saved" / "polytrain-cache"
    assert data.tokenizer_sha256 == tokenizers_file.file_sha256(root / "a.json")
    # a second run reads the same shards and encodes nothing
    monkeypatch.setattr(corpus.TokenShards, "add", lambda *_: pytest.fail("tokenized again"))
    again = load_dataset("hf", data_dir=str(root / "saved"), tokenizer=str(root / "a.json"), context=16)
    assert again.folder == data.folder and _ids(again.train_tokens) == _ids(data.train_tokens)
    # (the patch catches a run that tokenizes: another tokenizer has to, into a folder of its own)
    with pytest.raises(pytest.fail.Exception, match="tokenized again"):
        load_dataset("hf", data_dir=str(root / "saved"), tokenizer=str(root / "b.json"), context=16)
    monkeypatch.undo()
    other = load_dataset("hf", data_dir=str(root / "saved"), tokenizer=str(root / "b.json"), context=16)
    assert other.folder != data.folder and other.num_classes == 320
    assert _ids(other.train_tokens) == _expected(root / "b.json", paragraphs[:120])


def test_a_damaged_cache_is_written_again(texts, tmp_path, capsys):
    root, paragraphs = texts
    folder = _saved(tmp_path / "saved", text=paragraphs[:30])
    data = load_dataset("hf", data_dir=folder, tokenizer=str(root / "a.json"), context=8)
    shard = data.folder / data.manifest["train"]["shards"][0]["file"]
    damaged = bytearray(shard.read_bytes())
    damaged[4] ^= 1
    shard.write_bytes(bytes(damaged))
    capsys.readouterr()
    again = load_dataset("hf", data_dir=folder, tokenizer=str(root / "a.json"), context=8)
    assert "does not match its checksum" in capsys.readouterr().out
    assert _ids(again.train_tokens) == _expected(root / "a.json", paragraphs[:27])


@pytest.mark.parametrize("form", ["parquet", "jsonl", "arrow", "save_to_disk"])
def test_files_and_a_single_split_hold_out_their_last_rows(texts, tmp_path, form):
    root, paragraphs = texts
    rows = datasets.Dataset.from_dict({"text": paragraphs[:50]})
    where = tmp_path / "data"
    where.mkdir()
    if form == "parquet":
        rows.to_parquet(str(where / "part-0.parquet"))
    elif form == "jsonl":
        rows.select(range(30)).to_json(str(where / "a.jsonl"))
        rows.select(range(30, 50)).to_json(str(where / "b.jsonl"))
    else:
        rows.save_to_disk(str(where))
        if form == "arrow":  # the Arrow file alone, without the library's state.json
            (where / "state.json").unlink()
            (where / "dataset_info.json").unlink()
    data = load_dataset("hf", data_dir=str(where), tokenizer=str(root / "a.json"), context=8)
    held = math.ceil(VAL_FRACTION * 50)
    assert _ids(data.train_tokens) == _expected(root / "a.json", paragraphs[: 50 - held])
    assert _ids(data.val_tokens) == _expected(root / "a.json", paragraphs[50 - held : 50])
    quarter = load_dataset(
        "hf", data_dir=str(where), tokenizer=str(root / "a.json"), context=8, val_fraction=0.25
    )
    assert quarter.folder != data.folder  # another split, another cache
    assert _ids(quarter.val_tokens) == _expected(root / "a.json", paragraphs[50 - math.ceil(12.5) : 50])


def test_files_named_for_validation_are_the_validation_split(texts, tmp_path):
    root, paragraphs = texts
    (tmp_path / "validation").mkdir()
    datasets.Dataset.from_dict({"text": paragraphs[:40]}).to_parquet(str(tmp_path / "train-0.parquet"))
    datasets.Dataset.from_dict({"text": paragraphs[40:50]}).to_parquet(
        str(tmp_path / "validation" / "0.parquet")
    )
    data = load_dataset("hf", data_dir=str(tmp_path), tokenizer=str(root / "a.json"), context=8)
    assert _ids(data.train_tokens) == _expected(root / "a.json", paragraphs[:40])
    assert _ids(data.val_tokens) == _expected(root / "a.json", paragraphs[40:50])


def test_the_cache_goes_to_the_user_cache_where_the_data_folder_is_not_writable(texts, tmp_path, monkeypatch):
    root, paragraphs = texts
    datasets.Dataset.from_dict({"text": paragraphs[:20]}).to_parquet(str(tmp_path / "rows.parquet"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    real_mkdir = corpus.Path.mkdir

    def read_only(path, *args, **kwargs):
        if path == tmp_path / "polytrain-cache":
            raise PermissionError(13, "Permission denied")
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(corpus.Path, "mkdir", read_only)
    data = load_dataset(
        "hf", data_dir=str(tmp_path / "rows.parquet"), tokenizer=str(root / "a.json"), context=8
    )
    assert (tmp_path / "user-cache" / "polytrain" / "datasets" / "hf") in data.folder.parents
    assert not (tmp_path / "polytrain-cache").exists()


# -- rows of input_ids ------------------------------------------------------------------------------------------

VOCAB = 11


def _rows(count: int, seed: int):
    """Rows of 1 to 12 ids with labels (a prompt of -100 at random) and an attention mask whose right padding
    (some rows) is labelled -100 and holds pad ids."""
    generator = np.random.default_rng(seed)
    ids, labels, masks = [], [], []
    for _ in range(count):
        length, padding = int(generator.integers(1, 13)), int(generator.integers(0, 4))
        row = generator.integers(0, VOCAB, length).tolist()
        label = [-100 if generator.random() < 0.3 else token for token in row]
        ids.append(row + [0] * padding)
        labels.append(label + [-100] * padding)
        masks.append([1] * length + [0] * padding)
    return dict(input_ids=ids, labels=labels, attention_mask=masks)


def _padded(row: dict, context: int, *, shifted: bool = True):
    """A row as written by hand: inputs the real ids, targets labels[t + 1] (Hugging Face's shift), padded."""
    length = sum(row["attention_mask"])
    x = torch.zeros(context, dtype=torch.long)
    y = torch.full((context,), -100, dtype=torch.long)
    x[:length] = torch.tensor(row["input_ids"][:length])
    labels = torch.tensor(row["labels"][:length])
    if shifted:
        y[: length - 1] = labels[1:]
    else:
        y[:length] = labels
    return x, y


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    root = tmp_path_factory.mktemp("rows")
    train, val = _rows(40, seed=1), _rows(8, seed=2)
    datasets.DatasetDict(
        train=datasets.Dataset.from_dict(train), validation=datasets.Dataset.from_dict(val)
    ).save_to_disk(str(root / "saved"))
    return root / "saved", train


def _row(columns: dict, i: int) -> dict:
    return {key: values[i] for key, values in columns.items()}


def test_each_row_is_one_sample_with_labels_shifted_and_padding_masked(rows):
    folder, train = rows
    data = load_dataset("hf", data_dir=str(folder))
    assert (
        data.kind == "language" and data.num_classes == VOCAB and data.num_train == 40 and data.num_val == 8
    )
    context = max(sum(mask) for mask in train["attention_mask"])
    assert data.input_shape == (context,)  # the longest row, its padding cut off
    assert not (folder / "polytrain-cache").exists()  # rows on disk: nothing to cache
    for i in range(40):
        x, y = data.train[i]
        expected = _padded(_row(train, i), context)
        assert torch.equal(x, expected[0]) and torch.equal(y, expected[1])
    shorter = data.head(5)  # (verify trains on the first rows)
    assert (
        shorter.num_train == 5 and torch.equal(shorter.train[4][1], data.train[4][1]) and data.num_train == 40
    )
    # without labels the targets are the next ids; without a mask every id is real
    plain = TokenRows(datasets.Dataset.from_dict({"input_ids": [[3, 1, 4, 1, 5]]}), context=7)
    assert plain[0][0].tolist() == [3, 1, 4, 1, 5, 0, 0] and plain[0][1].tolist() == [1, 4, 1, 5] + [-100] * 3


@pytest.fixture(scope="module")
def hand_trained(rows):
    """SGD by hand on polytrain's global batches of the rows: each step the batch's summed cross-entropy over
    its trained tokens; and the same with the labels read unshifted (what a wrong reading would train)."""
    folder, train = rows
    context = max(sum(mask) for mask in train["attention_mask"])
    order = global_batch_order(40, epoch=0, seed=0)
    trained = {}
    for shifted in (True, False):
        model = token_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(5):
            pairs = [
                _padded(_row(train, int(i)), context, shifted=shifted)
                for i in order[step * 8 : (step + 1) * 8]
            ]
            x, y = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
            optimizer.zero_grad()
            logits = model(x)
            total = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
            (total / (y != -100).sum()).backward()
            optimizer.step()
        trained[shifted] = {name: p.detach().clone() for name, p in model.named_parameters()}
    return trained


SGD = plain_sgd()


def _difference(model, weights) -> float:
    return max((p.detach() - weights[name]).abs().max().item() for name, p in model.named_parameters())


def test_rows_train_the_hand_written_loop_on_one_device(rows, hand_trained):
    folder, _ = rows
    model = token_model()
    polytrain.fit(model, "hf", data_dir=str(folder), **SGD)
    assert _difference(model, hand_trained[True]) < 1e-13
    # the comparison tells a wrong reading of the labels apart
    assert (
        max((hand_trained[True][n] - hand_trained[False][n]).abs().max() for n in hand_trained[True]) > 1e-3
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "how", [dict(strategy="data"), dict(strategy="pipeline", microbatches=2)], ids=["data", "pipeline"]
)
def test_rows_train_the_hand_written_loop_on_two_ranks(rows, hand_trained, how):
    """Each rank pads its own rows: the loss still counts only the global batch's real tokens."""
    folder, _ = rows
    model = token_model()
    polytrain.fit(model, "hf", data_dir=str(folder), devices=2, **how, **SGD)
    assert _difference(model, hand_trained[True]) < 1e-13


def _saved(folder, **columns):
    datasets.Dataset.from_dict(columns).save_to_disk(str(folder))
    return str(folder)


def test_rows_that_break_a_rule_are_one_line(tmp_path):
    def refused(columns, match, **settings):
        with pytest.raises(DataError, match=match) as caught:
            load_dataset(
                "hf", data_dir=_saved(tmp_path / str(len(list(tmp_path.iterdir()))), **columns), **settings
            )
        assert "\n" not in str(caught.value)

    ids = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    refused(
        dict(input_ids=ids, attention_mask=[[1, 1, 1], [0, 1, 1], [1, 1, 1]]),
        r"[0-9], row 1: attention_mask has a 0 before the row's last 1 \(padding on the left",
    )
    refused(
        dict(
            input_ids=ids,
            labels=[[1, 2, 3], [4, 5, 6], [7, 8, 9]],
            attention_mask=[[1, 1, 1], [1, 1, 1], [1, 1, 0]],
        ),
        r"row 2: a label that is not -100 where attention_mask is 0",
    )
    refused(
        dict(input_ids=ids, labels=[[1, 2], [4, 5, 6], [7, 8, 9]]),
        r"row 0: labels is not as long as input_ids",
    )
    refused(dict(input_ids=[[1, -2, 3], [4, 5, 6], [7, 8, 9]]), r"row 0: input_ids holds a negative id")
    refused(dict(input_ids=ids), r"rows of up to 3 tokens, longer than --context 2", context=2)


def test_bad_input_is_one_line(texts, tmp_path, capsys):
    root, paragraphs = texts
    a = str(root / "a.json")
    with pytest.raises(DataError, match="--data-dir .*nothing.here does not exist"):
        load_dataset("hf", data_dir=str(tmp_path / "nothing.here"), tokenizer=a)
    folder = _saved(tmp_path / "bodies", body=paragraphs[:4], id=[1, 2, 3, 4])
    with pytest.raises(
        DataError, match=r"has no text column 'text' \(its columns: body, id\); name the text"
    ):
        load_dataset("hf", data_dir=folder, tokenizer=a)
    assert load_dataset("hf", data_dir=folder, tokenizer=a, text_key="body", context=8).num_train > 0
    with pytest.raises(DataError, match="holds text, which needs a tokenizer: give --tokenizer"):
        load_dataset("hf", data_dir=folder, text_key="body")
    with pytest.raises(DataError, match=r"has 300 tokens, more than the 200 rows of the model's embedding"):
        load_dataset("hf", data_dir=folder, text_key="body", tokenizer=a, vocab_size=200)
    ids_classes = _saved(tmp_path / "ids-classes", input_ids=[[1, 2], [3, 4]], label=[0, 1])
    with pytest.raises(
        DataError, match="columns 'input_ids' and 'label': rows of ids for a sequence classifier"
    ):
        load_dataset("hf", data_dir=ids_classes)
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all" * 10)
    with pytest.raises(DataError, match=r"broken.parquet cannot be read \(ArrowInvalid: Parquet magic bytes"):
        load_dataset("hf", data_dir=str(tmp_path / "broken.parquet"), tokenizer=a)
    (tmp_path / "lines").mkdir()
    (tmp_path / "lines" / "a.jsonl").write_text(json.dumps({"text": "fine"}) + "\n")
    (tmp_path / "lines" / "b.jsonl").write_text(json.dumps({"text": "fine"}) + "\n{broken\n")
    with pytest.raises(DataError, match=r"b.jsonl cannot be read \(ArrowInvalid: JSON parse error"):
        load_dataset("hf", data_dir=str(tmp_path / "lines"), tokenizer=a)
    # on the command line: one line, before any process starts
    capsys.readouterr()
    assert main(["train", "--model", "gpt", "--dataset", "hf", "--data-dir", folder, "--tokenizer", a]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no text column 'text' (its columns: body, id)" in err
    assert main(["train", "--dataset", "mnist-sample", "--text-key", "body"]) == 2
    assert "--text-key" in capsys.readouterr().err


def test_a_gpt_trains_on_a_text_column_keeps_the_tokenizer_and_generates(texts, tmp_path):
    root, _ = texts
    common = ["--model", "gpt", "--dataset", "hf", "--data-dir", str(root / "saved"), "--context", "16"]
    common += ["--layers", "1", "--width", "16", "--heads", "2", "--batch-size", "4", "--device", "cpu"]
    assert (
        main(
            [
                "train",
                *common,
                "--tokenizer",
                str(root / "a.json"),
                "--max-steps",
                "2",
                "--out",
                str(tmp_path / "r"),
            ]
        )
        == 0
    )
    settings = json.loads((tmp_path / "r" / "config.json").read_text())
    assert settings["tokenizer"] == str(root / "a.json") and settings["dataset"] == "hf"
    assert settings["kept_tokenizer"]["sha256"] == tokenizers_file.file_sha256(root / "a.json")
    assert generate_text(tmp_path / "r", prompt="ROMEO:", tokens=4).startswith("ROMEO:")
    # the run as --init-from: its tokenizer tokenizes (the cache of a.json's ids is read), no --tokenizer
    assert (
        main(
            [
                "train",
                *common,
                "--init-from",
                str(tmp_path / "r"),
                "--max-steps",
                "1",
                "--out",
                str(tmp_path / "s"),
            ]
        )
        == 0
    )


def test_fit_without_verbose_tokenizes_without_a_word(texts, tmp_path, capfd):
    root, _ = texts
    shutil.copytree(root / "saved", tmp_path / "saved")  # a folder whose text no run has tokenized yet
    sizes = dict(layers=1, width=16, heads=2, context=16, batch_size=4, max_steps=1, device="cpu")
    capfd.readouterr()
    polytrain.fit(
        "gpt", "hf", data_dir=str(tmp_path / "saved"), tokenizer=str(root / "a.json"), verbose=False, **sizes
    )
    assert capfd.readouterr().out == ""
    assert list((tmp_path / "saved").glob("polytrain-cache/tokens-*/manifest.json"))  # it did tokenize
