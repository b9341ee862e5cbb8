"""Labels of -100 (Hugging Face's convention for padding and prompts) count in neither the loss nor the token
counts: each step minimises the cross-entropy summed over the global batch's other tokens over their number,
so one device and two (data, sharded, pipeline, parameter server) train the same weights, in float64, as SGD
written by hand with F.cross_entropy(ignore_index=-100) (masked_tokens.reference_weights). The four runs on
two devices share one launch of two processes, where fit runs as under torchrun."""

import pytest
import torch
from hand_sgd import plain_sgd
from masked_tokens import MASKED, MaskedWindows, reference_weights, token_model

import polytrain
from polytrain.objective import Objective

SGD = plain_sgd()
STEPS = 4  # 32 windows in batches of 8


@pytest.fixture(scope="module")
def data():
    return MaskedWindows(32, seed=1), MaskedWindows(8, seed=2)


@pytest.fixture(scope="module")
def reference(data):
    return reference_weights(data[0], batch_size=8, steps=STEPS, lr=0.5)


def difference(model, weights) -> float:
    return max((p.detach() - weights[name]).abs().max().item() for name, p in model.named_parameters())


def test_the_language_loss_counts_only_labels_that_are_not_minus_100():
    objective = Objective(kind="language")
    outputs = torch.randn(3, 4, 5, dtype=torch.float64)
    targets = torch.tensor([[1, 2, MASKED, 0], [MASKED] * 4, [4, MASKED, 3, 3]])
    total, count = objective.outputs_loss(outputs, targets)
    by_hand = torch.nn.functional.cross_entropy(outputs.flatten(0, 1), targets.flatten(), reduction="sum")
    assert objective.counted and count.item() == 6 / 4  # in windows of 4 tokens: 6 trained tokens
    torch.testing.assert_close(total * 4, by_hand, rtol=1e-15, atol=0)
    # without masked labels the count is the windows', and each window's loss its mean over its tokens
    _, count = objective.outputs_loss(outputs, targets.clamp(min=0))
    assert count.item() == 3


@pytest.mark.parametrize("how", [dict(), dict(accumulate=3)], ids=["one-pass", "accumulate-3"])
def test_masked_labels_train_the_reference_on_one_device(data, reference, how):
    weights, losses = reference
    model = token_model()
    history = polytrain.fit(model, train=data[0], val=data[1], **SGD, **how)
    assert difference(model, weights) < 1e-13
    # the epoch's loss: the trained tokens' loss over their number, whatever each batch holds
    trained = sum(loss * count for loss, count in losses) / sum(count for _, count in losses)
    assert history.last["train_loss"] == pytest.approx(trained, rel=1e-12)


def test_averaging_each_part_s_token_mean_fails_the_same_comparison(data, reference):
    """What a rank's own token mean averaged over two ranks would train is far from the reference: the
    comparison above can tell them apart."""
    weights, _ = reference
    averaged, _ = reference_weights(data[0], batch_size=8, steps=STEPS, lr=0.5, per_part_mean=2)
    assert max((averaged[name] - weights[name]).abs().max().item() for name in weights) > 1e-3


TWO_DEVICES = (
    dict(strategy="data"),
    dict(strategy="sharded", accumulate=2),
    dict(strategy="pipeline", microbatches=2),
    dict(strategy="parameter-server"),
)


def _fit_each_on_two_ranks(rank: int, world: int, data, folder: str) -> list:
    """On each of 2 ranks (one launch for all four runs, which start no workers of their own: fit joins the
    process group made here, as under torchrun, and ends it): each of TWO_DEVICES' runs; on rank 0 its trained
    weights and its epoch's loss."""
    import os

    import torch.distributed as dist

    store = dist.FileStore(os.path.join(folder, "store"), world)
    os.environ.update(
        TORCHELASTIC_RUN_ID="loss-mask", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )  # fmt: skip
    results = []
    for number, how in enumerate(TWO_DEVICES):
        if not dist.is_initialized():  # (the launch's own group: the first run's)
            dist.init_process_group(
                "gloo", store=dist.PrefixStore(f"run-{number}", store), rank=rank, world_size=world
            )
        model = token_model()
        history = polytrain.fit(model, train=data[0], val=data[1], devices=world, **SGD, **how)
        # (as numpy arrays: tensors would pass through shared memory that ends with this process)
        weights = {name: p.detach().numpy().copy() for name, p in model.named_parameters()}
        results.append((weights, history.last["train_loss"]) if rank == 0 else None)
    return results


@pytest.mark.multiprocess
def test_masked_labels_train_the_reference_on_two_devices(data, reference, tmp_path):
    from distributed import run_on_ranks

    weights, losses = reference
    trained = sum(loss * count for loss, count in losses) / sum(count for _, count in losses)
    results = run_on_ranks(_fit_each_on_two_ranks, data, str(tmp_path), timeout=300)[0]
    assert len(results) == len(TWO_DEVICES)
    for how, (got, loss) in zip(TWO_DEVICES, results):
        got = {name: torch.from_numpy(value) for name, value in got.items()}
        assert max((got[name] - weights[name]).abs().max().item() for name in weights) < 1e-13, how
        assert list(got) == list(weights), how
        assert loss == pytest.approx(trained, rel=1e-12), how
