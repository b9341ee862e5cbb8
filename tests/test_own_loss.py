"""A Hugging Face causal LM given labels padded with -100 returns its own loss: the mean over the labels of the
part of a batch it sees. One device, accumulation and two ranks (data; sharded with accumulation) train the
weights of SGD written by hand on each whole global batch's token mean (hf_rows.hand_trained, float64), and
report that mean as val_loss: the model is given num_items_in_batch and its losses are summed (models/own_loss.py).
A model whose forward takes no num_items_in_batch keeps its per-part mean, and the run says so in one line."""

import pytest
import torch
from hand_sgd import plain_sgd
from hf_rows import LabelledRows, global_token_mean, hand_trained, stacked, tiny_llama

import polytrain
from polytrain.errors import UserError
from polytrain.models.own_loss import label_shift, trained_labels

pytest.importorskip("transformers")

SGD = plain_sgd(batch_size=8)
STEPS = 4  # 32 rows in batches of 8; parts of 2 rows hold 0 to 21 trained labels


@pytest.fixture(scope="module")
def data():
    return LabelledRows(32, seed=1), LabelledRows(8, seed=2)


@pytest.fixture(scope="module")
def hand(data):
    return hand_trained(data[0], batch_size=8, steps=STEPS, lr=0.5)


def difference(model, weights) -> float:
    return max((p.detach() - weights[name]).abs().max().item() for name, p in model.named_parameters())


def val_token_mean(model, val) -> float:
    with torch.no_grad():
        return global_token_mean(model, stacked(val, range(len(val)))).item()


def test_the_labels_counted_are_those_a_causal_lm_trains(data):
    """Shifted one place, as transformers' ForCausalLMLoss shifts them: its mean over our count is its sum."""
    model, batch = tiny_llama(), stacked(data[0], range(8))
    assert label_shift(model, batch, model(**batch).loss, lambda given: model(**given).loss) == (1, None)
    count = trained_labels(batch["labels"], 1)
    with torch.no_grad():
        summed = model(**batch, num_items_in_batch=torch.tensor(1)).loss
        torch.testing.assert_close(model(**batch).loss * count, summed, rtol=1e-6, atol=0)


@pytest.mark.parametrize("how", [dict(), dict(accumulate=4)], ids=["one-pass", "accumulate-4"])
def test_a_causal_lm_s_own_loss_trains_the_hand_loop_on_one_device(data, hand, how):
    # accumulate=4: passes of 2 rows, one of them with no trained label (its mean was NaN)
    model = tiny_llama()
    history = polytrain.fit(model, train=data[0], val=data[1], **SGD, **how)
    assert difference(model, hand) < 1e-6
    assert history.last["val_loss"] == pytest.approx(val_token_mean(model, data[1]), rel=1e-6)


@pytest.mark.multiprocess
def test_a_causal_lm_s_own_loss_trains_the_hand_loop_on_two_devices(data, hand):
    for how in (dict(strategy="data"), dict(strategy="sharded", accumulate=2)):
        model = tiny_llama()
        history = polytrain.fit(model, train=data[0], val=data[1], devices=2, **SGD, **how)
        assert difference(model, hand) < 1e-6, how
        assert history.last["val_loss"] == pytest.approx(val_token_mean(model, data[1]), rel=1e-6), how


class WithoutNumItems(torch.nn.Module):
    """The tiny Llama behind a forward that names its arguments: no num_items_in_batch reaches its loss."""

    def __init__(self):
        super().__init__()
        self.llama = tiny_llama()

    def forward(self, input_ids, attention_mask, labels):
        return self.llama(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


class IgnoresNumItems(WithoutNumItems):
    """A forward that takes **kwargs but drops them: its loss stays the mean."""

    def forward(self, input_ids, attention_mask, labels, **kwargs):
        return super().forward(input_ids, attention_mask, labels)


@pytest.mark.parametrize(
    "model, why",
    [
        (WithoutNumItems, "WithoutNumItems.forward takes no num_items_in_batch"),
        (IgnoresNumItems, "given num_items_in_batch, IgnoresNumItems's loss on two samples was not"),
    ],
    ids=["no-keyword", "ignores-it"],
)
def test_a_model_without_num_items_keeps_its_mean_and_says_so_once(data, model, why, capsys):
    model = model()
    polytrain.fit(model, train=data[0], val=data[1], **dict(SGD, verbose=True, accumulate=2))
    said = capsys.readouterr().out
    assert said.count("note: the model's own loss is its mean over each micro-batch's labels") == 1
    assert (
        why in said and "use a model whose forward takes num_items_in_batch" in said and "accumulate=" in said
    )
    # as before: each pass's mean weighted by its samples, not the hand loop's token mean
    assert difference(model.llama, hand_trained(data[0], batch_size=8, steps=STEPS, lr=0.5)) > 1e-3


def test_pairs_given_to_a_causal_lm_are_refused_pointing_to_rows_with_labels():
    """(inputs, targets) pairs reach a Hugging Face causal LM without labels, so it returns no loss: the one
    line names the dict form that trains (it said only that the model must return a row per sample)."""

    class Pairs(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            return torch.arange(i, i + 8) % 16, torch.arange(i + 1, i + 9) % 16

    with pytest.raises(UserError, match=r"CausalLMOutputWithPast without a loss: .*give items as dicts "):
        polytrain.fit(tiny_llama(), train=Pairs(), val=Pairs(), **SGD)
