"""Hugging Face GPT-2 and Llama under --strategy tensor: GPT-2's `Conv1D` layers (a Linear with the weight stored
[inputs, outputs]) can be named in a tensor plan, and training equals one device; fused parts of one are refused in
one line. A Llama's attention and MLP split as Megatron splits them train as one device, its rotary embedding's
frequencies (a buffer outside the state dict) kept whole on every rank."""

import copy

import pytest
import torch
from conftest import assert_same_weights
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import polytrain
from polytrain.errors import ConfigError
from polytrain.strategies.tensor import model_layers

PLAN = {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int, seed: int):
        self.ids = torch.randint(0, 32, (count, 8), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def gpt2():
    torch.manual_seed(0)
    zero = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=2, n_head=2, **zero))


def test_conv1d_layers_are_linear_layers_with_their_weight_transposed():
    layers = model_layers(gpt2())
    fc = layers["transformer.h.0.mlp.c_fc"]
    assert (fc.kind, fc.inputs, fc.outputs, fc.transposed) == ("linear", 16, 64, True)


TRAIN, VAL = Tokens(32, seed=1), Tokens(8, seed=2)
SETTINGS = dict(epochs=1, batch_size=8, optimizer="sgd", lr=0.1, verbose=False)


def trains_as_one_device(build, plan):
    """A model of `build` trained on one device and on 2 tensor ranks split by `plan` ends with the same weights
    (which moved); returns the one device's model."""
    one, two = build(), build()
    polytrain.fit(one, train=TRAIN, val=VAL, **SETTINGS)
    polytrain.fit(two, train=TRAIN, val=VAL, devices=2, strategy="tensor", tensor_plan=plan, **SETTINGS)
    start = build().state_dict()
    moved = max((one.state_dict()[k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-3  # the comparison below is not between two untrained models
    assert_same_weights(two.state_dict(), one.state_dict(), atol=1e-5)
    return one


@pytest.mark.multiprocess
def test_gpt2_mlp_split_by_a_tensor_plan_trains_as_one_device():
    one = trains_as_one_device(gpt2, PLAN)
    train, val, settings = TRAIN, VAL, SETTINGS
    with pytest.raises(ConfigError, match=r"c_attn is a Conv1D .*\(colwise:3\)"):
        polytrain.fit(
            copy.deepcopy(one), train=train, val=val, devices=2, strategy="tensor",
            tensor_plan={**PLAN, "transformer.h.*.attn.c_attn": "colwise:3"}, **settings,
        )  # fmt: skip


LLAMA_PLAN = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}


def llama():
    torch.manual_seed(0)
    shape = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4)
    return LlamaForCausalLM(
        LlamaConfig(vocab_size=32, num_key_value_heads=2, max_position_embeddings=8, **shape)
    )


@pytest.mark.multiprocess
def test_a_hugging_face_llama_split_by_heads_and_mlp_trains_as_one_device():
    """Each of 2 ranks runs 2 of the 4 query heads and 1 of the 2 key/value heads, and half the MLP."""
    assert "inv_freq" in dict(llama().model.rotary_emb.named_buffers())  # (the buffer each rank keeps whole)
    trains_as_one_device(llama, LLAMA_PLAN)
