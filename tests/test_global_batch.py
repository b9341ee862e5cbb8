"""BatchNorm and Dropout compute over the global batch on data-parallel layouts, so that N devices equal one
(parallel/global_batch.py): the dropout masks of every slice and pass are the rows of one device's mask, the
BatchNorm statistics those of the whole batch, and verify passes on the built-in models that hold them (on a
pipeline against one device in as many passes as micro-batches, BatchNorm normalising over each)."""

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from conftest import polytrain_here

from polytrain.parallel.global_batch import GlobalRows, slice_offsets, whole_batch_layers


def dropped(model, rows, x, start, stop, total, *, step=1, seed=0):
    torch.manual_seed(seed)
    rows.set(start, stop, total, step=step)
    return model(x[start:stop])


def test_each_slice_and_pass_gets_its_rows_of_the_one_device_mask():
    x = torch.randn(8, 3, 4, 4, dtype=torch.float64)
    layouts = []
    for _ in range(3):
        model, rows = nn.Sequential(nn.Dropout(0.5)), GlobalRows()
        assert whole_batch_layers(model, rows, batchnorm=False) == ["0"]
        layouts.append((model, rows))
    (one, one_rows), (rank0, rows0), (rank1, rows1) = layouts
    whole = dropped(one, one_rows, x, 0, 8, 8)
    halves = [dropped(rank0, rows0, x, 0, 4, 8), dropped(rank1, rows1, x, 4, 8, 8)]
    assert torch.equal(torch.cat(halves), whole)
    # a rank's two accumulation passes of one step: rows of the mask drawn in its first pass
    torch.manual_seed(0)
    rows1.set(4, 6, 8, step=2)
    first = rank1(x[4:6])
    rows1.set(6, 8, 8, step=2)
    assert torch.equal(torch.cat([first, rank1(x[6:8])]), whole[4:])
    # channels-last inputs draw the same mask (drawn in the default format)
    last = dropped(one, one_rows, x.contiguous(memory_format=torch.channels_last), 0, 8, 8, step=3)
    assert torch.equal(last, whole)
    # a Bernoulli(1 - p) mask scaled by 1 / (1 - p), as F.dropout's
    big = dropped(one, one_rows, torch.ones(4096, 16, dtype=torch.float64), 0, 4096, 4096, step=4)
    assert set(big.unique().tolist()) == {0.0, 2.0} and abs(float((big == 0).double().mean()) - 0.5) < 0.01
    # outside polytrain's steps the layer is torch's own; the model deep-copies and pickles
    one_rows.active = False
    torch.manual_seed(0)
    native = F.dropout(x, 0.5)
    torch.manual_seed(0)
    assert torch.equal(one(x), native)
    clone = copy.deepcopy(one)
    assert clone[0].forward.module is clone[0] and pickle.loads(pickle.dumps(one))[0].p == 0.5
    # each layer's mask is its own: drawn in either order (stages of a pipeline) the masks are the same
    pair, pair_rows = nn.Sequential(nn.Dropout(0.5), nn.Dropout(0.5)), GlobalRows()
    whole_batch_layers(pair, pair_rows, batchnorm=False)
    masks = {}
    for order in ([0, 1], [1, 0]):
        torch.manual_seed(0)
        pair_rows.set(0, 8, 8, step=10 + order[0])
        drawn = {i: pair[i](torch.ones(8, 4)) for i in order}
        masks[tuple(order)] = [drawn[0], drawn[1]]
    assert all(torch.equal(a, b) for a, b in zip(masks[(0, 1)], masks[(1, 0)]))
    assert not torch.equal(*masks[(0, 1)])  # and not the same mask for both
    # plain per-rank dropout, what this replaces: the second rank's mask is not the one device's
    torch.manual_seed(0)
    assert not torch.equal(F.dropout(x[4:8], 0.5), whole[4:])


def test_slices_are_cut_as_the_loader_cuts_them():
    for total, parts in [(10, 3), (8, 2), (3, 4)]:
        cut = torch.tensor_split(torch.arange(total), parts)
        assert slice_offsets(total, parts) == [
            (int(c[0]), int(c[-1]) + 1) if len(c) else (s, s)
            for c, s in zip(cut, [sum(len(d) for d in cut[:i]) for i in range(parts)])
        ]


def test_batchnorm_over_the_gathered_statistics_is_torchs(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    x = torch.randn(6, 3, 5, 5, dtype=torch.float64) * 3 + 2
    ours = nn.BatchNorm2d(3).double()
    with torch.no_grad():
        ours.weight.uniform_()
        ours.bias.uniform_()
    theirs = copy.deepcopy(ours)
    whole_batch_layers(ours, GlobalRows(), batchnorm=True)
    a, b = ours(x.requires_grad_()), theirs(x)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
    (grad_a,) = torch.autograd.grad(a.pow(2).sum(), x)
    (grad_b,) = torch.autograd.grad(b.pow(2).sum(), x)
    torch.testing.assert_close(grad_a, grad_b, rtol=0, atol=1e-12)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), rtol=0, atol=1e-14)
    ours.eval(), theirs.eval()
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-13)  # evaluation: the layer's own


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "model, strategy",
    [("resnet", "data"), ("cifar-cnn", "sharded"), ("resnet", "pipeline"), ("cifar-cnn", "pipeline")],
)
def test_verify_passes_on_models_with_batchnorm_and_dropout(model, strategy, capfd):
    result = polytrain_here(
        capfd, "verify", "--model", model, "--strategy", strategy, "--devices", "2", "--steps", "3",
        "--dataset", "synthetic", "--synthetic-shape", "3,16,16", "--batch-size", "16",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS: largest parameter difference" in result.stdout


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--strategy", "pipeline", "--accumulate", "2"], "BatchNorm layers compute over the samples"),
        (["--strategy", "data", "--accumulate", "2"], "BatchNorm normalises over each pass"),
    ],
)
def test_verify_says_in_one_line_what_cannot_equal_one_device(argv, words, capfd):
    result = polytrain_here(
        capfd, "verify", "--model", "resnet", "--devices", "2", "--steps", "2", "--dataset", "synthetic",
        "--synthetic-shape", "3,16,16", *argv,
    )  # fmt: skip
    assert result.returncode != 0 and words in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_verify_refuses_every_layer_that_draws_dropout_masks_on_each_rank():
    from types import SimpleNamespace

    from polytrain.errors import UserError
    from polytrain.runtime.verify import reference_passes

    config = SimpleNamespace(devices=2, accumulate=1)
    for model, named in [
        (nn.Sequential(nn.LSTM(4, 4, 2, dropout=0.2)), "0 (LSTM dropout 0.2) draws"),
        (nn.Sequential(nn.MultiheadAttention(4, 2, dropout=0.1)), "1 attention layer draws"),
        (nn.Sequential(nn.Dropout2d(0.5)), "0 (Dropout2d 0.5) draws"),
    ]:
        with pytest.raises(UserError) as refused:
            reference_passes(model, config, "data", None, float64=True)
        assert str(refused.value).startswith(f"verify: {named} dropout masks on each rank, so 2 devices")
    assert reference_passes(nn.Sequential(nn.LSTM(4, 4, 2)), config, "data", None, float64=True) == 1
