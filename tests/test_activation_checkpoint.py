"""Activation checkpointing changes no number and keeps fewer tensors for the backward pass: gradients equal
those of the plain model exactly (float64), dropout keeps its mask when recomputed, the parameter names stay
the model's, and `polytrain verify` passes with it on real gloo processes against one device without it."""

import copy
import functools

import pytest
import torch
import torch.nn as nn
from conftest import polytrain_here
from torch.profiler import ProfilerActivity, profile

from polytrain.models.gpt import GPT
from polytrain.parallel import activation_checkpoint as ac
from polytrain.parallel.activation_checkpoint import apply_activation_checkpointing, find_blocks

MODES = ("none", "full", "selective", "selective:2")


def gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(65, context=16, layers=4, heads=2, width=32).double()


def tokens() -> torch.Tensor:
    return torch.randint(0, 65, (4, 16), generator=torch.Generator().manual_seed(1))


def hook_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for the backward pass, each storage counted once (as
    pipeline/layers.py `layer_memory` counts them)."""
    saved = {}

    def keep(tensor):
        saved[(tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model(x)
    return sum(saved.values())


def held_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes the forward pass leaves allocated besides its output, from the allocator (the profiler's memory
    events): also what selective checkpointing keeps in its own cache, which no saved-tensor hook sees."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as run:
        out = model(x)
    return sum(event.self_cpu_memory_usage for event in run.events()) - out.numel() * out.element_size()


def gradients(model: nn.Module, x: torch.Tensor) -> dict:
    model(x).logsumexp(-1).sum().backward()
    return {name: p.grad for name, p in model.named_parameters()}


def checkpointed(mode: str) -> nn.Module:
    model = gpt()
    apply_activation_checkpointing(model, mode)
    return model


def test_gradients_are_exactly_the_plain_models_and_the_names_stay():
    x, plain = tokens(), gpt()
    expected, names = gradients(plain, x), list(plain.state_dict())
    for mode in MODES[1:]:
        model = checkpointed(mode)
        got = gradients(model, x)
        assert list(got) == list(expected) and list(model.state_dict()) == names, mode
        for name in expected:
            assert torch.equal(got[name], expected[name]), (mode, name)
    # a copy runs its own blocks (the replaced forward is deep-copied with its module)
    model = checkpointed("full")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        model[1].mlp[0].weight.add_(1.0)
    assert torch.equal(gradients(twin, x)["1.mlp.0.weight"], expected["1.mlp.0.weight"])


def test_checkpointing_keeps_fewer_bytes_for_backward():
    x = tokens()
    saved = {mode: hook_bytes(checkpointed(mode), x) for mode in MODES}
    held = {mode: held_bytes(checkpointed(mode), x) for mode in MODES}
    # full keeps each block's input only: the saved-tensor count (checkpoint saves that input through it) drops
    assert saved["full"] < saved["selective:2"] < saved["none"]
    assert not saved["none"] < saved["full"]  # the comparison can fail: the plain model saves more
    # selective keeps matmul outputs in its own cache: the allocator sees it between full and none
    assert (
        held["full"] < held["selective"] < held["none"] and held["full"] < held["selective:2"] < held["none"]
    )
    assert not held["none"] < held["selective"]


def test_a_strategy_checkpoints_the_blocks_of_the_model_it_sets_up():
    from polytrain.strategies import Strategy

    strategy = Strategy(device="cpu", activation_checkpointing="selective:2")
    strategy.setup(gpt(), lambda named: torch.optim.SGD([p for _, p in named], lr=0.1), lambda opt: None)
    replaced = [name for name, module in strategy.model.named_modules() if "forward" in vars(module)]
    assert replaced == ["2", "4"] and strategy.parameter_names == [
        name for name, _ in gpt().named_parameters()
    ]


class DropoutBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.dropout = nn.Linear(8, 8), nn.Dropout(0.5)

    def forward(self, x):
        return x + self.dropout(torch.tanh(self.linear(x)))


def dropout_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(DropoutBlock(), DropoutBlock(), nn.Linear(8, 3)).double()


def dropout_gradients(model: nn.Module) -> dict:
    torch.manual_seed(5)  # the dropout masks
    x = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    return gradients(model, x)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_dropout_draws_the_same_mask_when_recomputed(mode, monkeypatch):
    expected = dropout_gradients(dropout_model())
    model = dropout_model()
    apply_activation_checkpointing(model, mode)
    got = dropout_gradients(model)
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    # the check can fail: recomputed without restoring the RNG state, the masks differ
    monkeypatch.setattr(
        "torch.utils.checkpoint.checkpoint",
        functools.partial(torch.utils.checkpoint.checkpoint, preserve_rng_state=False),
    )
    model = dropout_model()
    apply_activation_checkpointing(model, mode)
    got = dropout_gradients(model)
    assert not all(torch.equal(got[name], expected[name]) for name in expected)


def test_the_blocks_are_the_repeated_modules_of_the_models_own():
    assert [name for name, _ in find_blocks(gpt())] == ["1", "2", "3", "4"]
    one = GPT(65, context=16, layers=1, heads=2, width=32)  # Embeddings and Block once each: the larger
    assert [name for name, _ in find_blocks(one)] == ["1"]
    assert ac.check_activation_checkpointing(gpt(), "selective:2") == ["2", "4"]
    assert ac.check_activation_checkpointing(gpt(), "none") == []
    assert find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []
    from polytrain.models.llama import Llama

    llama = Llama(65, context=16, layers=2, heads=2, width=32)
    assert [name for name, _ in find_blocks(llama)] == ["1", "2"]


def test_torchs_transformer_layers_are_blocks_and_recompute_exactly():
    def stack():
        torch.manual_seed(0)
        layers = [nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True) for _ in range(2)]
        return nn.Sequential(nn.Linear(4, 8), *layers, nn.Linear(8, 3))

    x = torch.randn(2, 5, 4)
    expected = gradients(stack(), x)
    assert [name for name, _ in find_blocks(stack())] == ["1", "2"]
    for mode in MODES[1:]:
        model = stack()
        apply_activation_checkpointing(model, mode)
        got = gradients(model, x)
        for name in expected:
            assert torch.equal(got[name], expected[name]), (mode, name)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--activation-checkpointing", "partial"], ["must be one of none, full, selective"]),
        (["--activation-checkpointing", "full"], ["LeNet is made of torch.nn layers only"]),
        (
            ["--model", "resnet", "--dataset", "synthetic", "--synthetic-shape", "3,32,32"]
            + ["--activation-checkpointing", "full"],
            ["BatchNorm", "twice per step"],
        ),
        (
            ["--model", "gpt", "--dataset", "shakespeare", "--activation-checkpointing", "selective:5"],
            ["one block in 5", "has 4 (Block)"],
        ),
        (
            ["--model", "gpt", "--dataset", "shakespeare", "--activation-checkpointing", "full"]
            + ["--devices", "2", "--strategy", "pipeline", "--split-at", "2"],
            ["does not combine with --split-at"],
        ),
    ],
    ids=["value", "no-blocks", "batchnorm", "every-k", "split-at"],
)
def test_meaningless_checkpointing_is_refused_in_one_line(capsys, tmp_path, argv, words):
    from polytrain.cli import main

    code = main(["train", *argv, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("polytrain: error:") and err.count("\n") == 1, err
    assert all(word in err for word in words) and not (tmp_path / "run").exists(), err


def test_fit_takes_the_keyword_and_refuses_as_the_flag():
    import polytrain
    from polytrain.errors import ConfigError

    with pytest.raises(ConfigError, match="LeNet is made of torch.nn layers only"):
        polytrain.fit("lenet", activation_checkpointing="full", verbose=False)
    with pytest.raises(ConfigError, match="must be one of none, full, selective"):
        polytrain.fit("lenet", activation_checkpointing="selective:0", verbose=False)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "model, strategy, mode",
    [
        ("gpt", ["--strategy", "data", "--accumulate", "2", "--clip-grad-norm", "0.05"], "full"),
        ("gpt", ["--strategy", "sharded"], "selective"),
        ("gpt", ["--strategy", "pipeline"], "selective:2"),
        ("gpt", ["--strategy", "tensor", "--accumulate", "2", "--clip-grad-norm", "0.05"], "selective"),
        ("llama", ["--strategy", "sharded"], "selective"),
        ("llama", ["--strategy", "tensor", "--devices", "4", "--tensor-parallel", "2"], "selective"),
    ],
    ids=[
        "data-full-knobs",
        "sharded-selective",
        "pipeline-every-2",
        "tensor-selective-knobs",
        "llama-sharded-selective",
        "llama-tensor-2x2-selective",
    ],
)
def test_verify_passes_with_activation_checkpointing(model, strategy, mode, capfd):
    """Two ranks checkpointing their blocks train as one device that keeps every activation (verify's
    reference), in float64; FSDP2's units are the blocks, so its hooks run around a checkpointed region
    (inside it, selective checkpointing found FSDP2's operations missing when it replayed the Llama's)."""
    sizes = ("--heads", "4", "--kv-heads", "2") if model == "llama" else ()
    result = polytrain_here(
        capfd,
        "verify",
        *("--model", model, "--dataset", "shakespeare", "--layers", "2", "--width", "32", "--heads", "2"),
        *sizes,
        *("--context", "16", "--batch-size", "8", "--steps", "2", "--devices", "2", "--device", "cpu"),
        *strategy,
        "--activation-checkpointing",
        mode,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 2 and "PASS" in result.stdout and "both in float64" in result.stdout
