"""--init-from RUN: a polytrain run folder starts a new run from its weights (step 0, a new optimizer), its
model settings taken from the run's config.json. A Llama run on one device (one model.pt) and a tied-head Llama
run on 2 sharded ranks (shards) each start a run on one device and one on 2 sharded ranks: each new run's first
step sees exactly the source's weights (the source model's loss on the same batch), and at a learning rate too
small to move a float32 weight (1e-30) its final weights are the source's, bit for bit. Mistakes are one line
before any worker.
"""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

import polytrain
from polytrain.cli import main
from polytrain.data.loader import make_loaders
from polytrain.runtime.inference import load_run

SIZES = dict(layers=2, heads=4, kv_heads=2, width=32, context=16)
TRAIN = dict(data="shakespeare", batch_size=4, device="cpu", verbose=False)
SOURCES = {"one": dict(strategy="single", devices=1), "sharded": dict(strategy="sharded", devices=2)}
TARGETS = {"one": dict(strategy="single", devices=1), "sharded": dict(strategy="sharded", devices=2)}
CASES = [(source, target) for source in SOURCES for target in TARGETS]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The two source runs (3 steps at the llama's learning rate, no warm-up), and a run of one step at lr 1e-30 from each
    on each layout: {name or (source, target): folder}."""
    folder = tmp_path_factory.mktemp("runs")
    folders = {}
    for name, layout in SOURCES.items():
        folders[name] = folder / name
        tied = dict(tie_embeddings=True) if name == "sharded" else {}
        polytrain.fit(
            "llama", out=str(folders[name]), max_steps=3, warmup_epochs=0, **SIZES, **TRAIN, **tied, **layout
        )
    assert (folders["sharded"] / "checkpoint-1").is_dir()  # its weights are shards
    for source, target in CASES:
        folders[source, target] = folder / f"{source}-to-{target}"
        polytrain.fit(
            None,
            init_from=str(folders[source]),
            out=str(folders[source, target]),
            max_steps=1,
            lr=1e-30,
            **TRAIN,
            **TARGETS[target],
        )
    return folders


def first_batch(config, dataset) -> tuple:
    train, _ = make_loaders(dataset, batch_size=config.batch_size, device="cpu", seed=config.seed)
    batch = next(train.train_batches(0))
    return batch.x, batch.y


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case[0]}-to-{case[1]}")
def test_a_new_run_starts_from_the_source_runs_weights(runs, case):
    source, _ = case
    _, _, expected = load_run(runs[source])
    config, dataset, model = load_run(runs[case])
    assert config.init_from == str(runs[source]) and bool(config.tie_embeddings) == (source == "sharded")
    got, weights = model.state_dict(), expected.state_dict()
    assert list(got) == list(weights)
    for name in weights:
        torch.testing.assert_close(got[name], weights[name], rtol=0, atol=0)
    x, y = first_batch(config, dataset)
    with torch.no_grad():
        loss = F.cross_entropy(expected.eval()(x).flatten(0, 1), y.flatten()).item()
    lines = (runs[case] / "metrics.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert first["global_step"] == 1 and first["train_loss"] == pytest.approx(loss, rel=1e-6)
    progress = torch.load(runs[case] / "checkpoint.pt", weights_only=True)
    assert progress["position"]["step"] == 1  # a new run: its own steps from 0, not the source's 3


@pytest.mark.multiprocess
def test_the_comparison_sees_the_seeded_weights(runs, tmp_path):
    """The same run without --init-from starts from the seed's weights, which the source has trained away from."""
    polytrain.fit("llama", out=str(tmp_path / "seeded"), max_steps=1, lr=1e-30, **SIZES, **TRAIN)
    _, _, seeded = load_run(tmp_path / "seeded")
    _, _, source = load_run(runs["one"])
    apart = max((seeded.state_dict()[k] - v).abs().max().item() for k, v in source.state_dict().items())
    assert apart > 1e-3
    first = json.loads((tmp_path / "seeded" / "metrics.jsonl").read_text().splitlines()[0])
    loaded = json.loads((runs["one", "one"] / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(first["train_loss"] - loaded["train_loss"]) > 1e-3


@pytest.mark.multiprocess
def test_mistakes_are_one_line_before_any_worker(runs, tmp_path, capsys):
    common = ["--dataset", "shakespeare", "--context", "16", "--batch-size", "4", "--max-steps", "1"]

    def refused(folder, words, *extra):
        """Exit 2, one `polytrain: error:` line, no run folder (the line of the llama's defaults may come first,
        where the weights are checked after the settings)."""
        out = tmp_path / "out"
        capsys.readouterr()
        code = main(["train", "--init-from", str(folder), *common, *extra, "--out", str(out)])
        captured = capsys.readouterr()
        assert code == 2 and captured.err.startswith("polytrain: error:"), captured.out + captured.err
        assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
        assert all(line.startswith("--model llama defaults:") for line in captured.out.splitlines())
        assert all(word in captured.err for word in words) and not out.exists(), captured.err

    one = runs["one"]
    refused(one, ["--width 64 contradicts", "(width: 32)", "from the run's config.json"], "--width", "64")
    refused(
        one, ["--tie-embeddings True contradicts", "tie_embeddings: null, the default"], "--tie-embeddings"
    )
    refused(one, ["--model gpt", "holds a llama model"], "--model", "gpt")
    empty = tmp_path / "unsaved"
    empty.mkdir()
    shutil.copy(one / "config.json", empty / "config.json")
    refused(empty, ["has no model.pt", f"--resume {empty}"])
    wider = tmp_path / "wider"
    shutil.copytree(one, wider)
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps(dict(config, ffn_width=96)))
    refused(wider, ["1.feed_forward.w1.weight", "has shape [128, 32]", "model [96, 32]"])


def test_a_gpt_run_starts_a_gpt_that_reads_shorter_windows(tmp_path, capsys):
    """A GPT run's table of positions (its --context, where --positions was not given) is fixed for the new run,
    whose windows may be shorter: its weights start as the source's, bit for bit; longer windows are one line."""
    polytrain.fit(
        "gpt", out=str(tmp_path / "source"), layers=2, heads=4, width=32, context=16, max_steps=2, **TRAIN
    )
    polytrain.fit(
        None,
        init_from=str(tmp_path / "source"),
        out=str(tmp_path / "new"),
        context=8,
        max_steps=1,
        lr=1e-30,
        **TRAIN,
    )
    _, _, source = load_run(tmp_path / "source")
    config, _, model = load_run(tmp_path / "new")
    assert (config.model, config.context, config.positions) == ("gpt", 8, 16)
    for name, value in source.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0)
    longer = tmp_path / "longer"
    capsys.readouterr()
    code = main(["train", "--init-from", str(tmp_path / "source"), "--dataset", "shakespeare", "--context", "32",
                 "--out", str(longer)])  # fmt: skip
    err = capsys.readouterr().err
    assert (
        code == 2 and err.count("\n") == 1 and "--context 32 is longer than" in err and not longer.exists()
    ), err
