"""FSDP2's units (parallel/units.py): one per transformer block, one per layer outside blocks, shared weights
in the root; and what the memory check counts as gathered at once."""

import torch
import torch.nn as nn

from polytrain.models.gpt import GPT
from polytrain.models.lenet import LeNet
from polytrain.models.llama import Llama
from polytrain.parallel.units import gathered_bytes, shard_units, unit_count


def names(model):
    return [name for name, _ in shard_units(model)]


def test_a_transformer_is_sharded_by_block_with_a_large_embedding_and_head_apart():
    llama = Llama(4096, context=16, layers=3, heads=2, width=32)  # a vocabulary larger than a block
    assert names(llama) == ["0", "1", "2", "3", "5"]  # embedding, 3 blocks, head; the norm in the root
    blocks = dict(shard_units(llama))
    assert type(blocks["1"]).__name__ == "Block" and unit_count(llama) == 6
    small = Llama(65, context=16, layers=3, heads=2, width=32)  # shakespeare's 65 characters
    assert names(small) == ["1", "2", "3"]  # as torchtitan: the blocks, the rest in the root


def test_tied_weights_stay_in_the_root():
    gpt = GPT(4096, context=16, layers=2, heads=2, width=32)  # token embedding and head share one weight
    assert names(gpt) == ["1", "2"]  # the position table and the final norm, smaller than a block, too
    untied = GPT(4096, context=16, layers=2, heads=2, width=32, tied=False)
    assert names(untied) == ["0.token", "1", "2", "4"]


def test_a_torch_layer_with_parameters_of_its_own_keeps_its_children():
    """nn.MultiheadAttention holds in_proj_weight and a child out_proj: one unit (sharding the child first and
    its parent after failed)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.MultiheadAttention(16, 2), nn.Linear(16, 3))
    assert names(model) == ["0", "1", "2"]


def test_torchs_transformer_layers_are_blocks():
    layers = [nn.TransformerEncoderLayer(16, 2, 32, batch_first=True) for _ in range(2)]
    model = nn.Sequential(nn.Embedding(8, 16), *layers, nn.Linear(16, 3))
    assert names(model) == ["1", "2"]  # the embedding and the head, smaller than a layer, in the root


def test_a_model_without_blocks_is_sharded_by_layer():
    assert names(LeNet()) == ["0", "3", "7", "9"]


def test_gathered_bytes_count_the_root_and_the_two_largest_units():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 8), nn.Linear(8, 2))
    model.register_parameter("scale", nn.Parameter(torch.ones(3)))  # the root's own
    sizes = [(4 * 4 + 4) * 4, (4 * 8 + 8) * 4, (8 * 2 + 2) * 4]
    assert gathered_bytes(model) == 3 * 4 + sizes[1] + sizes[0]
    llama = Llama(4096, context=16, layers=4, heads=2, width=32)
    head = 4096 * 32 * 4  # the head and the embedding are the largest units here
    assert gathered_bytes(llama) == 32 * 4 + 2 * head  # the final norm in the root
    assert gathered_bytes(llama) < sum(p.numel() * 4 for p in llama.parameters()) * 0.85
    small = Llama(65, context=16, layers=4, heads=2, width=32)
    block = sum(p.numel() * 4 for p in small[1].parameters())
    assert gathered_bytes(small) == (2 * 65 * 32 + 32) * 4 + 2 * block  # the root's embedding, norm and head


def test_a_meta_model_has_the_same_units():
    with torch.device("meta"):
        llama = Llama(4096, context=16, layers=2, heads=2, width=32)
    assert names(llama) == ["0", "1", "2", "4"]
    assert gathered_bytes(llama) > 0
