"""The GPT, text data and the language-model objective, each against an independent reference: the math of
causal attention and cross-entropy, the windows cut by hand, and a hand-written AdamW loop."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import polytrain_here

import polytrain
from polytrain.cli import parse
from polytrain.commands import generate_text
from polytrain.config.flags import config_from_args
from polytrain.data import load_dataset
from polytrain.data.order import global_batch_order
from polytrain.data.text import TokenLoader, load_text, tokenise
from polytrain.errors import ConfigError, DataError, UserError
from polytrain.models import build_model
from polytrain.models.gpt import GPT
from polytrain.objective import Objective

TINY = dict(layers=2, heads=2, width=16, context=8)


def test_a_later_token_never_changes_earlier_scores():
    torch.manual_seed(0)
    model = GPT(11, **TINY).eval()
    x = torch.randint(0, 11, (3, 8))
    changed = x.clone()
    changed[:, 5] = (x[:, 5] + 1) % 11
    a, b = model(x), model(changed)
    assert a.shape == (3, 8, 11)
    assert torch.equal(a[:, :5], b[:, :5])
    assert (a[:, 5:] - b[:, 5:]).abs().amax() > 1e-4


def test_shapes_tied_head_and_parameter_count():
    model = build_model("gpt", (8,), 11, TINY)
    assert model[-1].weight is model[0].token.weight  # the head is the token embedding
    assert len(model) == 2 + 2 + 1 and model.context == 8
    width, vocab = 16, 11
    block = (
        2 * 2 * width
        + (width * 3 * width + 3 * width)
        + (width * width + width)
        + (width * 4 * width + 4 * width)
        + (4 * width * width + width)
    )
    assert sum(p.numel() for p in model.parameters()) == vocab * width + 8 * width + 2 * block + 2 * width
    assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 11)  # shorter than the context


def test_heads_must_divide_the_width_and_gpt_sizes_are_refused_for_other_models():
    with pytest.raises(ConfigError, match="--heads 3 does not divide --width 32; give --heads 4"):
        build_model("gpt", (8,), 11, dict(heads=3, width=32))
    with pytest.raises(
        ConfigError, match="--layers applies to the gpt and llama models only, not lenet; drop it"
    ):
        build_model("lenet", (1, 28, 28), 10, dict(layers=2))
    _, args = parse(["train", "--heads", "2"])
    with pytest.raises(ConfigError, match="--heads applies to the gpt and llama models only"):
        config_from_args(args)


def test_gpt_brings_its_own_defaults_unless_given():
    _, args = parse(["train", "--model", "gpt", "--lr", "0.01", "--per-device-batch-size", "4"])
    config = config_from_args(args)
    assert (config.optimizer, config.schedule, config.lr, config.batch_size) == ("adamw", "cosine", 0.01, 4)
    assert (config.layers, config.heads, config.width, config.context) == (4, 4, 128, 64)
    assert "lr" not in args.model_defaults and args.model_defaults["optimizer"] == "adamw"
    _, args = parse(["train"])
    assert config_from_args(args).optimizer == "sgd" and args.model_defaults == {}


def test_text_vocabulary_and_split():
    text = "To be, or not to be: that is the question.\n" * 30
    data = tokenise(text, name="t", context=8)
    assert data.vocab == sorted(set(text)) and data.num_classes == len(set(text))
    cut = int(len(text) * 0.9)
    decoded = "".join(data.vocab[i] for i in torch.cat([data.train_tokens, data.val_tokens]).tolist())
    assert decoded == text and len(data.train_tokens) == cut
    assert data.num_train == (cut - 8) // 8 and data.num_val == (len(text) - cut - 1) // 8


def test_shakespeare_is_shipped():
    data = load_dataset("shakespeare", context=64)
    assert len(data.train_tokens) + len(data.val_tokens) == 1_115_394 and data.num_classes == 65
    assert len(data.train_tokens) == 1_003_854 and data.input_shape == (64,)


def _windows(loader, epoch, start_step=0):
    return [(b.x, b.y, b.global_count) for b in loader.train_batches(epoch, start_step=start_step)]


def test_windows_cover_the_split_once_per_epoch_on_any_device_count():
    tokens = torch.arange(203)
    one = TokenLoader(tokens, context=8, batch_size=6, device="cpu", seed=3)
    assert one.num_samples == (203 - 8) // 8 == 24 and len(one) == 4
    for epoch in range(3):
        batches = _windows(one, epoch)
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        assert torch.equal(y, x + 1)  # targets are the next tokens
        starts = x[:, 0].sort().values
        offset = int(starts[0])
        assert 0 <= offset < 8 and torch.equal(starts, offset + 8 * torch.arange(24))
        order = global_batch_order(24, epoch=epoch, seed=3)  # the windows in the seeded order
        assert torch.equal(x[:, 0], offset + 8 * order)
        ranks = [
            _windows(
                TokenLoader(tokens, context=8, batch_size=6, device="cpu", seed=3, rank=r, world_size=2),
                epoch,
            )
            for r in range(2)
        ]
        for step, (bx, _by, count) in enumerate(batches):
            assert torch.equal(torch.cat([ranks[0][step][0], ranks[1][step][0]]), bx) and count == 6
        assert all(torch.equal(a[0], b[0]) for a, b in zip(_windows(one, epoch, start_step=2), batches[2:]))
    evaluation = TokenLoader(tokens, context=8, batch_size=5, device="cpu", training=False)
    starts = torch.cat([b.x[:, 0] for b in evaluation.eval_batches()])
    assert torch.equal(starts, 8 * torch.arange((203 - 1) // 8))


def test_text_mistakes_are_one_line(tmp_path):
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin.txt is not UTF-8 text \(byte 3 is 0xe9\)"):
        load_text(str(latin), context=4)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="holds no text"):
        load_text(str(tmp_path / "empty.txt"), context=4)
    (tmp_path / "short.txt").write_text("a short text, much shorter than the context")
    with pytest.raises(DataError, match="--context 64 is too long for the .* split"):
        load_text(str(tmp_path / "short.txt"), context=64)
    with pytest.raises(DataError, match="needs --data-dir"):
        load_text(None, context=4)


def test_language_loss_is_the_mean_per_token_summed_over_samples():
    torch.manual_seed(0)
    logits, targets = torch.randn(3, 5, 7), torch.randint(0, 7, (3, 5))
    objective = Objective(kind="language")
    assert objective.names == () and objective.metric_sums(logits, targets).numel() == 0
    by_hand = -torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)  # (3, 5) per token
    assert torch.allclose(objective.loss_sum(logits, targets), by_hand.mean(1).sum(), atol=1e-6)
    assert torch.allclose(
        objective.loss_sum(logits, targets) / 3,
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()),
        atol=1e-6,
    )


def _text_file(tmp_path, length=600):
    text = "".join(
        "ROMEO: but soft, what light through yonder window breaks?\n"[i % 58] for i in range(length)
    )
    path = tmp_path / "text.txt"
    path.write_text(text)
    return path, text


def test_one_device_fit_equals_a_hand_written_adamw_loop(tmp_path):
    path, text = _text_file(tmp_path)
    data = tokenise(text, name="text", context=8)
    torch.manual_seed(0)
    model = GPT(data.num_classes, **TINY)
    reference = GPT(data.num_classes, **TINY)
    reference.load_state_dict(model.state_dict())
    settings = dict(
        optimizer="adamw",
        lr=3e-3,
        betas=(0.9, 0.99),
        weight_decay=0.1,
        no_decay_norms_and_biases=True,
        schedule="constant",
        warmup_epochs=0.0,
        batch_size=16,
        context=8,
    )
    history = polytrain.fit(model, "text", data_dir=str(path), epochs=2, verbose=False, **settings)
    decay = [p for p in reference.parameters() if p.dim() > 1]
    no_decay = [p for p in reference.parameters() if p.dim() <= 1]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-3,
        betas=(0.9, 0.99),
    )
    train, n = data.train_tokens, data.num_train
    for epoch in range(2):
        generator = torch.Generator().manual_seed(epoch * 2 + 1)  # the epoch's window offset (seed 0)
        offset = int(torch.randint(0, 8, (1,), generator=generator))
        order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch))
        for step in range(0, n, 16):
            starts = offset + 8 * order[step : step + 16]
            windows = train[starts[:, None] + torch.arange(9)]
            loss = F.cross_entropy(reference(windows[:, :-1]).flatten(0, 1), windows[:, 1:].flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name
    val = data.val_tokens[8 * torch.arange(data.num_val)[:, None] + torch.arange(9)]
    with torch.no_grad():
        val_loss = F.cross_entropy(reference(val[:, :-1]).flatten(0, 1), val[:, 1:].flatten()).item()
    assert history.last["val_loss"] == pytest.approx(val_loss, abs=1e-5)
    assert history.last["perplexity"] == pytest.approx(math.exp(val_loss), rel=1e-5)
    assert history.last["tokens_per_second"] == pytest.approx(history.last["samples_per_second"] * 8)


def test_generate_samples_from_a_run_and_refuses_other_runs(tmp_path):
    path, _ = _text_file(tmp_path)
    run = tmp_path / "run"
    polytrain.fit(
        "gpt",
        "text",
        data_dir=str(path),
        epochs=1,
        verbose=False,
        out=str(run),
        layers=1,
        width=16,
        heads=2,
        context=8,
        batch_size=16,
    )
    vocab = json.loads((run / "config.json").read_text())["vocab"]
    a = generate_text(run, prompt="ROMEO:", tokens=40, seed=1)
    assert a == generate_text(run, prompt="ROMEO:", tokens=40, seed=1) and a.startswith("ROMEO:")
    assert len(a) == 46 and set(a) <= set(vocab)
    greedy = generate_text(run, prompt="R", tokens=3, temperature=0)
    model = build_model("gpt", (8,), len(vocab), dict(layers=1, width=16, heads=2))
    model.load_state_dict(torch.load(run / "model.pt"))
    ids = [vocab.index("R")]
    for _ in range(3):
        ids.append(int(model.eval()(torch.tensor([ids]))[0, -1].argmax()))
    assert greedy == "".join(vocab[i] for i in ids)
    with pytest.raises(UserError, match="not in the"):
        generate_text(run, prompt="ROMEO#")
    other = tmp_path / "lenet"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(dict(model="lenet", dataset="mnist-sample")))
    with pytest.raises(
        UserError, match="is a run of --model lenet on --dataset mnist-sample, not a language model"
    ):
        generate_text(other)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "strategy",
    ["data", "sharded", "parameter-server", "pipeline", "pipeline 4 2", "sharded 4 2"],
)
def test_verify_gpt_on_every_strategy(strategy, capfd):
    """The tied GPT on every strategy; "pipeline 4 2": two pipelines of 2 stages on 4 processes (the hybrid mesh),
    each tying its first and last stage; "sharded 4 2": hybrid sharding, 2 replicas of 2 shards (--replicas 2,
    a (dp_replicate, dp_shard) mesh)."""
    strategy, devices, degree = (strategy.split() + ["2", None])[:3]
    option = "--replicas" if strategy == "sharded" else "--pipeline-stages"
    # dropout (nanoGPT's GPU recipe) drawn over the global batch: per replica, and per micro-batch in a pipeline
    dropout = ["--dropout", "0.1"] if degree is None and strategy in ("data", "pipeline") else []
    result = polytrain_here(
        capfd,
        "verify",
        "--model",
        "gpt",
        "--dataset",
        "shakespeare",
        "--devices",
        devices,
        "--strategy",
        strategy,
        "--layers",
        "2",
        "--width",
        "32",
        "--heads",
        "2",
        "--context",
        "16",
        "--batch-size",
        "8",
        "--steps",
        "2",
        *([option, degree] if degree else []),
        *dropout,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 2 and all(float(diff) <= 1e-5 for *_, diff in rows) and "PASS" in result.stdout
    assert ("(2 replicas x 2 shards)" in result.stdout) == (option == "--replicas" and degree is not None)


@pytest.mark.multiprocess
@pytest.mark.parametrize("tied", [True, False])
def test_a_gpt_trains_on_a_pipeline_as_on_one_device(tmp_path, tied):
    """Token ids reach the first stage as integers (the shape probe keeps their dtype); the tied head's weight
    (on the last stage) and the token embedding (on the first) stay one weight, trained as on one device."""
    path, text = _text_file(tmp_path)
    vocab = len(set(text))
    torch.manual_seed(0)
    one = GPT(vocab, tied=tied, **TINY)
    two = GPT(vocab, tied=tied, **TINY)
    two.load_state_dict(one.state_dict())
    initial = {name: value.clone() for name, value in one.state_dict().items()}
    common = dict(
        data_dir=str(path),
        epochs=1,
        verbose=False,
        optimizer="adamw",
        lr=3e-3,
        schedule="constant",
        warmup_epochs=0.0,
        batch_size=16,
        context=8,
    )
    polytrain.fit(one, "text", **common)
    polytrain.fit(two, "text", devices=2, strategy="pipeline", microbatches=2, split="3", **common)
    for (name, a), b in zip(one.state_dict().items(), two.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-5), name
    assert not torch.allclose(initial["0.token.weight"], one.state_dict()["0.token.weight"])
    assert not torch.allclose(initial["4.weight"], one.state_dict()["4.weight"])
    assert torch.equal(two.state_dict()["4.weight"], two.state_dict()["0.token.weight"]) == tied


def test_another_optimizer_or_schedule_takes_its_own_defaults_not_the_recipes():
    from polytrain.config.model_defaults import apply_model_defaults

    values = {"optimizer": "sgd", "schedule": "steplr"}
    applied = apply_model_defaults(values, {"optimizer", "schedule"}, "gpt")
    assert not {"betas", "lr", "weight_decay", "warmup_epochs", "no_decay_norms_and_biases"} & set(applied)
    assert applied["batch_size"] == 8 and values["optimizer"] == "sgd"


def test_dropout_adds_layers_that_train_and_leave_evaluation_and_names_alone():
    torch.manual_seed(0)
    plain = build_model("gpt", (16,), 65, dict(layers=2, width=32, heads=2))
    torch.manual_seed(0)
    dropped = build_model("gpt", (16,), 65, dict(layers=2, width=32, heads=2, dropout=0.2))
    layers = [m for m in dropped.modules() if isinstance(m, torch.nn.Dropout)]
    assert len(layers) == 1 + 2 * 2 and all(m.p == 0.2 for m in layers)  # embeddings, attention and MLP
    assert not any(isinstance(m, torch.nn.Dropout) for m in plain.modules())
    assert plain.state_dict().keys() == dropped.state_dict().keys()  # checkpoints load either way
    x = torch.randint(0, 65, (4, 16))
    torch.testing.assert_close(dropped.eval()(x), plain.eval()(x), rtol=0, atol=0)
    assert not torch.equal(dropped.train()(x), plain.train()(x))
