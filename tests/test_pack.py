"""Packed rows (`--pack`: data/token_rows.py `PackedRows`, models/packing.py): short rows in windows of --context
tokens, each attending to itself at positions from 0. A packed batch's loss and gradients equal those of the same
rows each padded alone, in float64, for the llama and the GPT (and differ where the rows are merely concatenated,
so the check can fail); a step of a packed run on 2 sharded ranks is a step of the unpadded run on one device;
verify passes on every layout --pack takes (the GPT's on tensor ranks with its sequence parallelism and
vocabulary split); best fit leaves no row out and no window over; bad input is one line.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import polytrain_here

import polytrain
from polytrain.cli import main
from polytrain.data.token_rows import IGNORE_INDEX, PackedRows, TokenRows, best_fit
from polytrain.models.gpt import GPT
from polytrain.models.llama import Llama
from polytrain.runtime.inference import load_run

datasets = pytest.importorskip("datasets")

CONTEXT = 16
LENGTHS = [9, 7, 5, 4, 3, 3, 2, 12, 6, 8, 1, 10]  # 70 tokens: 5 windows of 16 (best fit)


def rows_of(lengths, seed=0) -> "datasets.Dataset":
    """Rows of ids with labels, a prompt's first third of each -100 (as instruction rows are)."""
    generator = np.random.RandomState(seed)
    rows = []
    for length in lengths:
        ids = generator.randint(0, 60, length).tolist()
        labels = [IGNORE_INDEX] * (length // 3) + ids[length // 3 :]
        rows.append({"input_ids": ids, "labels": labels})
    return datasets.Dataset.from_list(rows)


def batch(dataset):
    samples = [dataset[i] for i in range(len(dataset))]
    return torch.utils.data.default_collate(samples)


def loss_and_gradients(model, x, y):
    """The mean token loss over every trained token of the batch, and its gradients."""
    model.zero_grad()
    logits = model(*x) if isinstance(x, (list, tuple)) else model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    loss = loss / (y != IGNORE_INDEX).sum()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_a_packed_batch_is_its_rows_each_alone_in_float64(name):
    torch.manual_seed(0)
    if name == "llama":
        model = Llama(60, context=CONTEXT, layers=2, heads=4, kv_heads=2, width=32)
    else:
        model = GPT(60, context=CONTEXT, layers=2, heads=4, width=32)
    model = model.double()
    rows = rows_of(LENGTHS)
    lengths = np.asarray(LENGTHS)
    packed = PackedRows(rows, context=CONTEXT, lengths=lengths)
    assert len(packed) == 5 and packed.describe() == "12 rows in 5 windows of 16 tokens (87.5% filled)"
    alone = loss_and_gradients(model, *batch(TokenRows(rows, context=CONTEXT)))
    together = loss_and_gradients(model, *batch(packed))
    torch.testing.assert_close(together[0], alone[0], rtol=0, atol=1e-13)
    for key, gradient in alone[1].items():
        torch.testing.assert_close(together[1][key], gradient, rtol=0, atol=1e-12, msg=key)
    # the same windows without the rows' positions (one sequence each): another loss, so the check can fail
    (ids, _), targets = batch(packed)
    concatenated = loss_and_gradients(model, ids, targets)
    assert abs(concatenated[0] - alone[0]) > 1e-3


def test_best_fit_puts_every_row_in_one_window_and_no_window_over():
    assert [sorted(w.tolist()) for w in best_fit(np.array([5, 4, 3, 3, 1]), 8)] == [[0, 2], [1, 3, 4]]
    lengths = np.random.RandomState(1).randint(0, 60, 5000)
    windows = best_fit(lengths, 64)
    placed = np.concatenate(windows)
    assert sorted(placed.tolist()) == np.flatnonzero(lengths).tolist()  # (an empty row trains nothing)
    assert all(lengths[w].sum() <= 64 for w in windows)
    assert lengths.sum() / (64 * len(windows)) > 0.99  # (a lower bound is the tokens over 64)
    # each window: its rows in order (4 tokens fit beside 3), positions from 0, the rest padding
    packed = PackedRows(rows_of([3, 2, 4]), context=8, lengths=np.array([3, 2, 4]))
    (ids, positions), targets = packed[0]
    assert positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 0] and len(packed) == 2
    assert targets[2] == IGNORE_INDEX and targets[6:].tolist() == [IGNORE_INDEX] * 2 and ids[7] == 0


def write_rows(folder, lengths, seed=0):
    datasets.DatasetDict(
        train=rows_of(lengths, seed), validation=rows_of([9, 10, 12], seed + 1)
    ).save_to_disk(str(folder))
    return folder


@pytest.mark.multiprocess
def test_a_packed_step_on_two_sharded_ranks_is_the_padded_step_on_one_device(tmp_path):
    """The token loss is the mean over the global batch's trained tokens on every layout: one step over all 12
    rows, padded one to a sample on one device, packed into 6 windows on 2 sharded ranks (3 each), trains the
    same weights."""
    data = write_rows(tmp_path / "rows", LENGTHS + [8])  # 78 tokens: 6 windows
    common = dict(data="hf", data_dir=str(data), context=CONTEXT, layers=2, heads=4, width=32, kv_heads=2)
    common.update(optimizer="sgd", lr=0.5, max_steps=1, verbose=False, device="cpu", seed=3)
    polytrain.fit("llama", out=str(tmp_path / "padded"), batch_size=13, **common)
    polytrain.fit(
        "llama",
        out=str(tmp_path / "packed"),
        batch_size=6,
        pack=True,
        strategy="sharded",
        devices=2,
        **common,
    )
    polytrain.fit("llama", out=str(tmp_path / "still"), batch_size=13, **{**common, "lr": 1e-12})
    initial, padded, packed = (
        load_run(tmp_path / run)[2].state_dict() for run in ("still", "padded", "packed")
    )  # (the sharded run's weights are its ranks' shards)
    moved = max((padded[k] - packed[k]).abs().max().item() for k in padded)
    assert moved < 2e-6, moved
    assert max((padded[k] - initial[k]).abs().max().item() for k in padded) > 1e-3  # (the step moved them)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "model, layout",
    [
        ("llama", ["--strategy", "data"]),
        ("llama", ["--strategy", "sharded", "--activation-checkpointing", "full", "--accumulate", "2"]),
        ("llama", ["--strategy", "tensor"]),
        ("gpt", ["--strategy", "sharded"]),
        ("gpt", ["--strategy", "tensor"]),
        ("llama", ["--strategy", "sharded", "--context-parallel", "2", "--activation-checkpointing", "full"]),
        ("gpt", ["--strategy", "sharded", "--context-parallel", "2"]),
    ],
    ids=[
        "llama-data",
        "llama-sharded-checkpointed-accumulated",
        "llama-tensor",
        "gpt-sharded",
        "gpt-tensor",
        "llama-cp2-checkpointed",
        "gpt-cp2",
    ],
)
def test_verify_passes_in_float64_on_packed_rows(tmp_path, capfd, model, layout):
    data = write_rows(tmp_path / "rows", LENGTHS * 3)
    sizes = ["--layers", "2", "--width", "32", "--heads", "4", "--context", str(CONTEXT)]
    done = polytrain_here(
        capfd, "verify", "--model", model, "--dataset", "hf", "--data-dir", data, *sizes, "--pack",
        *layout, "--devices", "2", "--steps", "3", "--batch-size", "4",
    )  # fmt: skip
    assert done.returncode == 0 and "PASS" in done.stdout, done.stdout + done.stderr
    assert "packed: 36 rows in 14 windows of 16 tokens" in done.stdout, done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 3 and all(float(row[3]) < 1e-12 for row in rows), done.stdout


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--strategy", "pipeline", "--devices", "2"], ["--pack does not take --strategy pipeline yet"]),
        (["--text"], ["holds text, which is read as one stream of full windows already; drop --pack"]),
    ],
    ids=["pipeline", "text-column"],
)
def test_what_cannot_pack_is_one_line_before_any_run_folder(tmp_path, capsys, argv, words):
    data = tmp_path / "rows"
    if argv == ["--text"]:
        datasets.Dataset.from_list([{"text": "the cat sat"}] * 4).save_to_disk(str(data))
        argv = []
    else:
        write_rows(data, LENGTHS)
    capsys.readouterr()
    out = tmp_path / "out"
    sizes = ["--layers", "2", "--width", "32", "--heads", "4", "--context", str(CONTEXT)]
    code = main(
        ["train", "--model", "llama", "--dataset", "hf", "--data-dir", str(data), *sizes, "--pack", *argv]
        + ["--out", str(out)]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("polytrain: error:") and err.count("\n") == 1, err
    assert all(word in err for word in words), err
    assert not out.exists()


def test_a_model_that_takes_no_positions_is_one_line(tmp_path):
    data = write_rows(tmp_path / "rows", LENGTHS)
    model = torch.nn.Sequential(torch.nn.Embedding(60, 8), torch.nn.Linear(8, 60))
    with pytest.raises(
        polytrain.UserError, match="Sequential takes none .the llama and the gpt do.; drop pack=True"
    ):
        polytrain.fit(
            model, data="hf", data_dir=str(data), context=CONTEXT, pack=True, max_steps=1, verbose=False
        )
