"""`--dataset hf` on texts with a class each: a sequence classifier (data/text_classes.py, models/classifier.py).

The tests build their datasets with `datasets` and a tokenizer trained on their own text (nothing downloads).
Each row is its text's ids cut or right-padded to --context, its label a class id (string labels and ClassLabel
names kept); the model scores the hidden state of each row's last token, as a hand computation and
transformers' LlamaForSequenceClassification do; 1 device, 2 data ranks and 2 sharded ranks train the same
weights in float64 (verify); bad input is one line each before any worker starts.
"""

import json
import random

import pytest
import torch
import torch.nn as nn

datasets = pytest.importorskip("datasets")
datasets.disable_progress_bars()

import polytrain  # noqa: E402
from polytrain.cli import main  # noqa: E402
from polytrain.data import load_dataset, text_classes  # noqa: E402
from polytrain.data import tokenizer as tokenizers_file  # noqa: E402
from polytrain.data.text_classes import PAD  # noqa: E402
from polytrain.errors import DataError  # noqa: E402
from polytrain.models import build_model  # noqa: E402
from polytrain.runtime.inference import load_run  # noqa: E402

WORDS = {
    "neg": "bad awful terrible sad horrible poor dreadful",
    "pos": "good great fine lovely happy superb joy",
}
SMALL = dict(layers=1, width=16, heads=2, context=8)


def _texts(count: int, seed: int):
    generator = random.Random(seed)
    texts, labels = [], []
    for _ in range(count):
        label = generator.choice(["neg", "pos"])
        words = WORDS[label].split()
        texts.append(" ".join(generator.choice(words) for _ in range(generator.randint(0, 12))))
        labels.append(label)
    return texts, labels


@pytest.fixture(scope="module")
def sentiment(tmp_path_factory):
    """A DatasetDict of 48 training and 8 validation texts with string labels, and a tokenizer trained on them."""
    root = tmp_path_factory.mktemp("classes")
    (train, train_labels), (val, val_labels) = _texts(48, 1), _texts(8, 2)
    datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"text": train, "label": train_labels}),
        validation=datasets.Dataset.from_dict({"text": val, "label": val_labels}),
    ).save_to_disk(str(root / "saved"))
    tokenizers_file.train_byte_bpe(iter(train + val), vocab_size=280).save(str(root / "tokenizer.json"))
    return root, train, train_labels


def _load(folder, tokenizer, **settings):
    return load_dataset("hf", data_dir=str(folder), tokenizer=str(tokenizer), verbose=False, **settings)


def test_rows_are_their_texts_ids_cut_or_padded_and_string_labels_become_sorted_classes(
    sentiment, monkeypatch
):
    root, train, labels = sentiment
    data = _load(root / "saved", root / "tokenizer.json", context=8)
    assert data.kind == "classification" and data.classes == ["neg", "pos"] and data.num_classes == 2
    assert data.sequence_vocabulary == 280 and data.input_shape == (8,) and data.num_train == 48
    tokenizer = tokenizers_file.load(root / "tokenizer.json")
    cut = 0
    for i in range(48):
        ids = tokenizer.encode(train[i]).ids
        cut += len(ids) > 8
        x, y = data.train[i]
        assert x.tolist() == ids[:8] + [PAD] * max(0, 8 - len(ids)) and int(y) == ["neg", "pos"].index(
            labels[i]
        )
    assert data.cut[0] == cut > 0
    # a second load (another --context) reads the cached ids and encodes nothing
    monkeypatch.setattr(text_classes, "_encode", lambda *_: pytest.fail("tokenized again"))
    longer = _load(root / "saved", root / "tokenizer.json", context=64)
    assert longer.folder == data.folder and longer.train[3][0][:8].tolist() == data.train[3][0].tolist()


def test_class_labels_and_integer_labels_keep_their_classes(sentiment, tmp_path):
    root, train, _ = sentiment
    named = datasets.Dataset.from_dict({"text": train[:10], "label": [0, 2, 1, 2, 0, 1, 1, 0, 2, 2]})
    named = named.cast_column("label", datasets.ClassLabel(names=["low", "mid", "high"]))
    named.save_to_disk(str(tmp_path / "named"))
    data = _load(tmp_path / "named", root / "tokenizer.json", context=4, val_fraction=0.2)
    assert data.classes == ["low", "mid", "high"] and data.num_train == 8 and data.num_val == 2
    assert [int(data.val[i][1]) for i in range(2)] == [2, 2]  # (the last rows held out)
    numbered = datasets.Dataset.from_dict({"text": train[:6], "label": [0, 3, 1, 3, 0, 1]})
    numbered.save_to_disk(str(tmp_path / "numbered"))
    data = _load(tmp_path / "numbered", root / "tokenizer.json", context=4)
    assert data.num_classes == 4 and data.classes == ["0", "1", "2", "3"]


def _hand_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The body on the ids (pads read as 0), each row's hidden state at its last real token, then the head."""
    hidden = ids.clamp(min=0)
    for layer in list(model.children())[:-1]:
        hidden = layer(hidden)
    last = (ids != PAD).sum(1) - 1
    return torch.stack([hidden[row, int(last[row])] for row in range(len(ids))]) @ model.score.weight.T


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_logits_are_the_last_real_tokens_hidden_state_through_the_head(name):
    torch.manual_seed(0)
    model = build_model(name, (6,), 3, dict(SMALL, context=6), vocabulary=40).double()
    assert (
        isinstance(model.score, nn.Linear)
        and model.score.weight.shape == (3, 16)
        and model.score.bias is None
    )
    ids = torch.tensor([[5, 9, 2, PAD, PAD, PAD], [7, 1, 3, 3, 8, 4], [11, PAD, PAD, PAD, PAD, PAD]])
    logits = model(ids)
    assert logits.shape == (3, 3)
    torch.testing.assert_close(logits, _hand_logits(model, ids), rtol=0, atol=1e-12)
    # the pads reach nothing: a row alone, unpadded, gives its logits
    torch.testing.assert_close(logits[0], model(ids[:1, :3])[0], rtol=0, atol=1e-12)
    # the comparison sees pooling at another place
    assert (logits[0] - _hand_logits(model, torch.tensor([[5, 9, 2, 0, PAD, PAD]]))[0]).abs().max() > 1e-4


def test_a_llama_sequence_classifier_checkpoint_loads_and_gives_transformers_logits(sentiment, tmp_path):
    transformers = pytest.importorskip("transformers")
    root, _, _ = sentiment
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=280,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        num_labels=2,
        pad_token_id=0,
        initializer_range=0.2,
    )
    theirs = transformers.LlamaForSequenceClassification(config).double().eval()
    theirs.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "tokenizer.json").write_bytes((root / "tokenizer.json").read_bytes())
    polytrain.fit(
        None,
        "hf",
        data_dir=str(root / "saved"),
        init_from=str(tmp_path / "ckpt"),
        context=8,
        max_steps=1,
        lr=1e-30,
        out=str(tmp_path / "run"),
        verbose=False,
    )
    _, data, ours = load_run(tmp_path / "run")
    ids = torch.stack([data.val[i][0] for i in range(8)])
    assert (ids == PAD).any()
    with torch.no_grad():
        expected = theirs(input_ids=ids.masked_fill(ids == PAD, 0), attention_mask=(ids != PAD).long()).logits
        torch.testing.assert_close(ours.double()(ids), expected, rtol=1e-5, atol=1e-5)


def test_a_lora_fine_tune_of_a_classifier_exports_what_peft_loads(sentiment, tmp_path):
    """--lora on a Hugging Face sequence classifier trains the adapters and the score head whole (peft's SEQ_CLS
    modules_to_save): `--format peft` writes both, and peft's model on the checkpoint gives the run's logits, which
    differ from the checkpoint's own (so the check can fail)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    root, _, _ = sentiment
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=280, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, num_labels=2, pad_token_id=0,
    )  # fmt: skip
    transformers.LlamaForSequenceClassification(config).save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "tokenizer.json").write_bytes((root / "tokenizer.json").read_bytes())
    polytrain.fit(
        None, "hf", data_dir=str(root / "saved"), init_from=str(tmp_path / "ckpt"), context=8, max_steps=3,
        lora=4, lr=0.05, out=str(tmp_path / "run"), verbose=False,
    )  # fmt: skip
    assert main(["export", str(tmp_path / "run"), "--format", "peft", "--out", str(tmp_path / "peft")]) == 0
    saved = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert saved["task_type"] == "SEQ_CLS" and saved["modules_to_save"] == ["score"]
    _, data, ours = load_run(tmp_path / "run")
    ids = torch.stack([data.val[i][0] for i in range(8)])
    base = transformers.LlamaForSequenceClassification.from_pretrained(tmp_path / "ckpt").eval()
    inputs = dict(input_ids=ids.masked_fill(ids == PAD, 0), attention_mask=(ids != PAD).long())
    with torch.no_grad():
        before = base(**inputs).logits
        theirs = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()(**inputs).logits
        mine = ours.eval()(ids)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert (mine - before).abs().max() > 1e-3


@pytest.mark.multiprocess
def test_one_device_two_data_ranks_and_two_sharded_ranks_train_alike(sentiment, capsys):
    root, _, _ = sentiment
    common = [
        "--dataset",
        "hf",
        "--data-dir",
        str(root / "saved"),
        "--tokenizer",
        str(root / "tokenizer.json"),
    ]
    common += ["--layers", "1", "--width", "16", "--heads", "2", "--context", "8", "--steps", "3"]
    for strategy in ("data", "sharded"):
        assert main(["verify", "--model", "gpt", *common, "--devices", "2", "--strategy", strategy]) == 0
        assert "PASS" in capsys.readouterr().out


def test_a_run_keeps_its_classes_and_refuses_generate(sentiment, tmp_path, capsys):
    root, _, _ = sentiment
    polytrain.fit(
        "llama",
        "hf",
        data_dir=str(root / "saved"),
        tokenizer=str(root / "tokenizer.json"),
        out=str(tmp_path / "run"),
        max_steps=2,
        verbose=False,
        **SMALL,
    )
    settings = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (
        settings["classes"] == ["neg", "pos"]
        and settings["classifies_texts"]
        and settings["metrics"] == ["acc"]
    )
    assert set(polytrain.evaluate(str(tmp_path / "run"))) >= {"loss", "acc"}
    result = polytrain.predict(str(tmp_path / "run"))
    assert result["images"] is None and len(result["true"]) == 8 and result["classes"] == ["neg", "pos"]
    assert main(["generate", str(tmp_path / "run")]) == 2
    assert "is a sequence classifier" in capsys.readouterr().err


def _saved(folder, **columns) -> str:
    datasets.Dataset.from_dict(columns).save_to_disk(str(folder))
    return str(folder)


def test_bad_input_is_one_line_before_any_worker(sentiment, tmp_path, capsys):
    root, train, _ = sentiment
    tokenizer = str(root / "tokenizer.json")

    def refused(folder, words):
        with pytest.raises(DataError, match=words) as caught:
            load_dataset("hf", data_dir=folder, tokenizer=tokenizer, verbose=False)
        assert "\n" not in str(caught.value)

    refused(
        _saved(tmp_path / "none", text=train[:4], label=[0, 1, None, 1]), r"row 2: label is missing \(None\)"
    )
    named = datasets.Dataset.from_dict({"text": train[:4], "label": [0, 1, 5, 1]})
    named.cast_column("label", datasets.ClassLabel(names=["neg", "pos"])).save_to_disk(
        str(tmp_path / "outside")
    )
    refused(str(tmp_path / "outside"), r"row 2: label is 5, outside its 2 classes \['neg', 'pos'\]")
    unlabelled = datasets.Dataset.from_dict({"text": train[:4], "label": [0, -1, 1, 1]})
    unlabelled.cast_column("label", datasets.ClassLabel(names=["neg", "pos"])).save_to_disk(
        str(tmp_path / "minus")
    )
    refused(str(tmp_path / "minus"), r"row 1: label is -1 \(the ClassLabel's \"no label\"")
    refused(
        _saved(tmp_path / "negative", text=train[:4], label=[0, 1, -3, 1]), r"row 2: label is -3, outside"
    )
    refused(
        _saved(tmp_path / "float", text=train[:4], label=[0.5, 1.0, 0.0, 1.0]), r"holds double, not classes"
    )
    refused(_saved(tmp_path / "one", text=train[:4], label=["a"] * 4), r"every label is a, one class")
    refused(
        _saved(tmp_path / "body", body=train[:4], label=[0, 1, 0, 1]),
        r"has no text column 'text' \(its columns: body, label\)",
    )
    # on the command line, before any process starts: a model that cannot classify texts
    folder = str(root / "saved")
    assert (
        main(["train", "--model", "lenet", "--dataset", "hf", "--data-dir", folder, "--tokenizer", tokenizer])
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model lenet cannot classify texts" in err
    common = [
        "--dataset",
        "hf",
        "--data-dir",
        folder,
        "--tokenizer",
        tokenizer,
        "--layers",
        "1",
        "--width",
        "16",
    ]
    assert (
        main(
            [
                "train",
                "--model",
                "gpt",
                *common,
                "--heads",
                "2",
                "--devices",
                "2",
                "--strategy",
                "data",
                "--context-parallel",
                "2",
            ]
        )
        == 2
    )
    assert "sequence classifier scores a text by its last token" in capsys.readouterr().err
