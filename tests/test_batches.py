"""Batches of any structure, a model's own loss, step=, and token-exact (sum, count) losses.

The reference is SGD written by hand on the same global batches (token_data.reference_weights): each step
minimises the batch's summed token losses over its token count. Sequences have different lengths, so averaging
per-batch means (how accumulation and devices were once combined) trains other weights: a test shows that.
"""

import pytest
import torch
from hand_sgd import plain_sgd
from token_data import (
    PAD,
    MeanTokenModel,
    PaddedTokens,
    TokenModel,
    reference_weights,
    token_loss,
    token_step,
)

import polytrain
from polytrain.errors import UserError

SGD = plain_sgd(batch_size=16)
STEPS = 4  # 64 training sequences in batches of 16


@pytest.fixture(scope="module")
def data():
    return PaddedTokens(64, seed=1), PaddedTokens(16, seed=2)


@pytest.fixture(scope="module")
def reference(data):
    return reference_weights(data[0], batch_size=16, steps=STEPS, lr=0.5)


def difference(model, weights) -> float:
    return max((p.detach() - weights[name]).abs().max().item() for name, p in model.named_parameters())


def token_mean(model, data) -> float:
    """The validation loss by hand: every token's loss summed over the whole set, over its token count."""
    batch = {key: torch.stack([data[i][key] for i in range(len(data))]) for key in ("input_ids", "labels")}
    with torch.no_grad():
        total, count = model(**batch)["loss"]
    return (total / count).item()


@pytest.mark.parametrize(
    "how",
    [dict(), dict(accumulate=4), dict(step=token_step), dict(micro_batch_size=1)],
    ids=["model-loss", "accumulate-4", "step", "micro-batch-1"],
)
def test_token_exact_losses_train_the_reference_on_one_device(data, reference, how):
    model = TokenModel()
    history = polytrain.fit(model, train=data[0], val=data[1], **SGD, **how)
    assert difference(model, reference) < 1e-6
    assert history.last["val_loss"] == pytest.approx(token_mean(model, data[1]), rel=1e-6)


def test_averaging_per_batch_means_fails_the_same_test(data, reference):
    """A model that returns its batch's token mean, accumulated over 4 passes, averages 4 per-pass means:
    the old way, which the hand-written reference of that way reproduces and the token-exact one does not."""
    model = MeanTokenModel()
    polytrain.fit(model, train=data[0], val=data[1], **SGD, accumulate=4)
    averaged = reference_weights(data[0], batch_size=16, steps=STEPS, lr=0.5, parts=4, per_part_mean=True)
    assert difference(model, averaged) < 1e-6
    assert difference(model, reference) > 1e-3


@pytest.mark.multiprocess
def test_token_exact_losses_train_the_reference_on_two_devices(data, reference):
    for how in (
        dict(strategy="data"),
        dict(strategy="sharded", accumulate=2),
        dict(strategy="parameter-server", step=token_step),
    ):
        model = TokenModel()
        history = polytrain.fit(model, train=data[0], val=data[1], devices=2, **SGD, **how)
        assert difference(model, reference) < 1e-6, how
        assert history.last["val_loss"] == pytest.approx(token_mean(model, data[1]), rel=1e-6), how
    # the pipeline: a loss= giving (sum, count) pairs on the last stage, integer tokens into the first
    from token_data import SEQUENTIAL_NAMES, TokenPairs, sequential_twin

    model = sequential_twin()
    polytrain.fit(
        model,
        train=TokenPairs(data[0]),
        val=TokenPairs(data[1]),
        loss=token_loss,
        devices=2,
        strategy="pipeline",
        microbatches=2,
        **SGD,
    )
    renamed = {
        SEQUENTIAL_NAMES[key.split(".")[0]] + "." + key.split(".")[1]: p
        for key, p in model.named_parameters()
    }
    assert max((p.detach() - reference[name]).abs().max().item() for name, p in renamed.items()) < 1e-6


def test_a_resumed_token_exact_run_continues_the_same_training(data, tmp_path):
    straight = TokenModel()
    polytrain.fit(straight, train=data[0], val=data[1], **dict(SGD, epochs=2))
    resumed = TokenModel()
    polytrain.fit(resumed, train=data[0], val=data[1], out=str(tmp_path / "run"), **SGD)
    history = polytrain.fit(
        resumed, train=data[0], val=data[1], resume=str(tmp_path / "run"), **dict(SGD, epochs=2)
    )
    assert difference(resumed, dict(straight.named_parameters())) < 1e-6
    assert history.last["val_loss"] == pytest.approx(token_mean(straight, data[1]), rel=1e-6)


class Triples(torch.utils.data.Dataset):
    """(input_ids, labels, weight) tuples: no separate target; the model takes all three."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        item = self.data[i]
        return item["input_ids"], item["labels"], torch.tensor(1.0)


class TripleModel(TokenModel):
    def forward(self, input_ids, labels, weight):
        return super().forward(input_ids, labels)


class Pairs(Triples):
    def __getitem__(self, i):
        item = self.data[i]
        return item["input_ids"], item["labels"]


def test_tuple_items_are_positional_arguments_and_pairs_reach_a_step_as_inputs_and_targets(data, reference):
    model = TripleModel()
    polytrain.fit(model, train=Triples(data[0]), val=Triples(data[1]), **SGD)
    assert difference(model, reference) < 1e-6
    seen = []

    def step(model, batch):
        inputs, targets = batch
        seen.append((inputs.dtype, targets.shape))
        return token_loss(model(inputs)["logits"], targets)

    model = TokenModel()
    polytrain.fit(model, train=Pairs(data[0]), val=Pairs(data[1]), step=step, **SGD)
    assert difference(model, reference) < 1e-6
    assert (torch.int64, (16, 12)) in seen


def test_eval_step_replaces_the_step_in_validation(data):
    calls = {"eval": 0}

    def eval_step(model, batch):
        calls["eval"] += 1
        assert not torch.is_grad_enabled()
        return token_step(model, batch)

    history = polytrain.fit(
        TokenModel(), train=data[0], val=data[1], step=token_step, eval_step=eval_step, **SGD
    )
    assert calls["eval"] >= 1 and history.last["val_loss"] > 0


class Empty(PaddedTokens):
    """Every label is padding: no token is counted."""

    def __getitem__(self, i):
        item = super().__getitem__(i)
        item["labels"][:] = PAD
        return item


class Other(TokenModel):
    def forward(self, tokens, labels=None):
        return super().forward(tokens, labels)


def wrong_kind(model, batch):
    return model(**batch)["logits"]


def bad_count(model, batch):
    return token_step(model, batch)


@pytest.mark.parametrize(
    "model, train, options, words",
    [
        (Other, PaddedTokens, {}, "the key input_ids, which Other.forward(tokens, labels) does not take"),
        (
            TokenModel,
            PaddedTokens,
            dict(step=wrong_kind),
            "step= returned a float32 tensor of shape (2, 12, 11)",
        ),
        (TokenModel, Empty, {}, "the loss counted 0 elements in a whole global batch of 16 samples"),
        (
            TokenModel,
            PaddedTokens,
            dict(devices=2, strategy="pipeline"),
            "the pipeline strategy computes the loss",
        ),
        (
            TokenModel,
            PaddedTokens,
            dict(devices=2, strategy="parameter-server", staleness=1),
            "drop staleness=",
        ),
        (TokenModel, PaddedTokens, dict(metrics={"x": wrong_kind}), "drop metrics="),
        (TokenModel, PaddedTokens, dict(step=token_step, loss=token_loss), "give either loss="),
    ],
    ids=["dict-keys", "step-returns", "zero-count", "pipeline", "staleness", "metrics", "loss-and-step"],
)
def test_mistakes_with_batches_and_steps_are_one_line(model, train, options, words):
    with pytest.raises(UserError) as error:
        polytrain.fit(model(), train=train(32), val=PaddedTokens(8), **dict(SGD, **options))
    assert words in str(error.value)
    assert "\n" not in str(error.value)


def test_items_without_targets_need_a_model_that_returns_its_loss():
    class NoLoss(TokenModel):
        def forward(self, input_ids, labels=None):
            return super().forward(input_ids)["logits"]

    with pytest.raises(UserError, match="with no separate target.*return an output with .loss"):
        polytrain.fit(NoLoss(), train=PaddedTokens(32), val=PaddedTokens(8), **SGD)


LIGHTNING = dict(epochs=1, batch_size=16, verbose=False)


def test_a_lightning_module_trains_with_its_own_steps_optimizer_and_schedule(data):
    from token_data import LitTokens, lightning_reference

    model = LitTokens()
    history = polytrain.fit(model, train=data[0], val=data[1], **LIGHTNING)
    assert (
        difference(model, lightning_reference(data[0], batch_size=16, steps=STEPS, lr=0.5, gamma=0.9)) < 1e-6
    )
    assert history.last["lr"] == pytest.approx(0.5 * 0.9**STEPS)
    assert history.last["val_loss"] == pytest.approx(token_mean(model, data[1]), rel=1e-6)
    with pytest.raises(UserError, match="the tensor strategy splits the model"):
        polytrain.fit(LitTokens(), train=data[0], val=data[1], devices=2, strategy="tensor", **LIGHTNING)


@pytest.mark.multiprocess
def test_a_lightning_module_trains_the_same_on_two_devices(data):
    from token_data import LitTokens, lightning_reference

    reference = lightning_reference(data[0], batch_size=16, steps=STEPS, lr=0.5, gamma=0.9)
    for strategy in ("data", "sharded"):
        model = LitTokens()
        polytrain.fit(model, train=data[0], val=data[1], devices=2, strategy=strategy, **LIGHTNING)
        assert difference(model, reference) < 1e-6, strategy
