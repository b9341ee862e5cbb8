"""Code as users bring it (pytorch/examples' word_language_model): sequence-first batches through nn.Dropout,
a step= that calls the model's own methods, a positional-encoding buffer of unusual strides, and the layers
that draw dropout masks on each rank, named in one line."""

import copy

import pytest
import torch
import torch.nn as nn
from hand_sgd import plain_sgd
from sequence_first import SequenceFirstLM, Windows, sequence_first_step

import polytrain
from polytrain.errors import UserError
from polytrain.parallel.global_batch import (
    GlobalRows,
    batch_dimension,
    per_rank_dropout_line,
    whole_batch_layers,
)

SGD = plain_sgd()


def test_a_sequence_first_dropout_gives_each_rank_its_columns_of_the_one_device_mask():
    x = torch.randn(5, 8, 3, dtype=torch.float64)  # (T, B, width)
    layers = []
    for _ in range(3):
        model, rows = nn.Sequential(nn.Dropout(0.5)), GlobalRows()
        whole_batch_layers(model, rows, batchnorm=False)
        layers.append((model, rows))
    drawn = []
    for (model, rows), (start, stop) in zip(layers, [(0, 8), (0, 4), (4, 8)]):
        torch.manual_seed(0)
        rows.set(start, stop, 8, step=1)
        drawn.append(model(x[:, start:stop]))
    assert torch.equal(torch.cat(drawn[1:], dim=1), drawn[0])
    assert batch_dimension(torch.Size([5, 4, 3]), 4) == 1
    assert batch_dimension(torch.Size([5, 4, 4]), 4) == 1  # the first that fits: a width equal to the samples
    assert batch_dimension(torch.Size([4, 4, 3]), 4) == 0  # batch-first code
    assert batch_dimension(torch.Size([5, 3, 3]), 3, remembered=2) == 2
    assert batch_dimension(torch.Size([20, 3]), 4) is None


def test_a_dropout_without_a_batch_dimension_is_torchs_own_and_says_so_once(capsys):
    model, rows = nn.Sequential(nn.Dropout(0.5)), GlobalRows()
    whole_batch_layers(model, rows, batchnorm=False)
    rows.loud = True
    x = torch.ones(20, 3)  # 5 steps of 4 samples, flattened into one dimension
    for step in (1, 2):
        rows.set(0, 4, 8, step=step)
        out = model(x)
        assert out.shape == x.shape and set(out.unique().tolist()) <= {0.0, 2.0}
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "note: dropout 0 gets a (20, 3) tensor with no dimension of this pass's 4 samples, so it draws its "
        "masks on each rank as torch does: several devices train with other masks than one"
    ]


def test_word_language_model_code_trains_on_two_devices_as_on_one():
    """Sequence-first nn.Dropout (drawn over the global batch), a step= calling model.init_hidden under DDP,
    and the positional encoding buffer that DDP's broadcast could not copy into."""
    torch.manual_seed(0)
    model = SequenceFirstLM()
    assert model.pe.stride() == (8, 512, 1)  # not (8, 8, 1): DDP could not broadcast into it
    data = dict(train=Windows(32, seed=1), val=Windows(8, seed=2), step=sequence_first_step)
    trained = {}
    for devices in (1, 2):
        trained[devices] = copy.deepcopy(model)
        polytrain.fit(
            trained[devices], devices=devices, strategy="auto" if devices == 1 else "data", **data, **SGD
        )
    for (name, one), two in zip(trained[1].named_parameters(), trained[2].parameters()):
        torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(trained[1].decoder.weight, model.decoder.weight)


def test_under_ddp_a_step_reads_the_models_own_methods_and_buffers_get_default_strides(tmp_path):
    import torch.distributed as dist

    from polytrain.parallel.ddp import Replicated, contiguous_buffers

    model = SequenceFirstLM()
    pe = model.pe.clone()
    contiguous_buffers(model)
    assert model.pe.stride() == (8, 8, 1) and torch.equal(model.pe, pe)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        replicated = Replicated(model)
        hidden, _ = replicated.init_hidden(3)
        assert hidden.shape == (2, 3, 8) and replicated.width == 8 and replicated.module is model
        with pytest.raises(AttributeError, match="no attribute 'missing'"):
            assert replicated.missing is None
    finally:
        dist.destroy_process_group()


def test_a_forward_that_needs_a_second_argument_points_to_step():
    with pytest.raises(UserError) as error:
        polytrain.fit(SequenceFirstLM(), train=Windows(16, seed=1), val=Windows(8, seed=2), **SGD)
    assert str(error.value) == (
        "SequenceFirstLM.forward(input, hidden) needs 2 arguments and each batch gives 1 input; pass "
        "step=fn(model, batch) that calls the model with what it needs and returns the loss"
    )


class Attention(nn.Module):
    """As nanoGPT's: the probability handed to scaled_dot_product_attention."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout
        self.proj = nn.Linear(4, 4)


@pytest.mark.parametrize(
    "model, words",
    [
        (SequenceFirstLM(rnn_dropout=0.2), "rnn (LSTM dropout 0.2) draws"),
        (
            nn.Sequential(
                nn.GRU(4, 4, 3, dropout=0.1),
                nn.TransformerEncoderLayer(4, 2, 8, dropout=0.1),
                nn.TransformerEncoderLayer(4, 2, 8, dropout=0.1),
                nn.Dropout2d(0.3),
            ),
            "0 (GRU dropout 0.1), 3 (Dropout2d 0.3) and 2 attention layers draw",
        ),
        (nn.Sequential(Attention(0.1), Attention(0.0)), "1 attention layer draws"),
    ],
)
def test_layers_that_draw_dropout_masks_on_each_rank_are_named_in_one_line(model, words):
    line = per_rank_dropout_line(model, 4)
    assert line == (
        f"note: {words} dropout masks on each rank: 4 devices train with other masks than one device; set "
        f"their dropout to 0 for identical results"
    )
    assert per_rank_dropout_line(model, 1) is None
    for module in model.modules():  # at 0 nothing is drawn
        for name in ("dropout", "p"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)
    assert per_rank_dropout_line(model, 4) is None


def test_hugging_face_attention_dropout_is_named():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, vocab_size=50
    )
    assert per_rank_dropout_line(transformers.LlamaForCausalLM(config), 2) is None
    config.attention_dropout = 0.1
    line = per_rank_dropout_line(transformers.LlamaForCausalLM(config), 2)
    assert line.startswith("note: 2 attention layers draw dropout masks on each rank: 2 devices")
    bert = transformers.BertConfig(
        hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32, vocab_size=50
    )
    assert per_rank_dropout_line(transformers.BertForMaskedLM(bert), 2).startswith("note: 3 attention layers")


def test_fit_names_them_before_any_worker_starts(capsys):
    with pytest.raises(UserError, match="cannot be sent to the worker processes"):
        polytrain.fit(
            SequenceFirstLM(rnn_dropout=0.2),
            train=Windows(16, seed=1),
            val=Windows(8, seed=2),
            step=lambda model, batch: sequence_first_step(model, batch),
            devices=2,
            **dict(SGD, verbose=True),
        )
    assert (
        "note: rnn (LSTM dropout 0.2) draws dropout masks on each rank: 2 devices" in capsys.readouterr().out
    )
