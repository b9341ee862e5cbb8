"""--freeze PATTERN (freeze= in fit): the parameters its globs match keep their values bit for bit, get no
gradient and no optimizer state, and the others train as SGD written by hand with the same parameters frozen
(masked_tokens.reference_weights), on one device and on 2 processes (data; sharded, where FSDP2's unit of the
head mixes a frozen bias with a trained weight; the pipeline; parameter servers), and on tensor-parallel ranks
as on one device (verify)."""

import pytest
import torch
from conftest import polytrain_here
from hand_sgd import plain_sgd
from masked_tokens import MaskedWindows, reference_weights, token_model

import polytrain
from polytrain.errors import UserError
from polytrain.optim import make_optimizer
from polytrain.optim.freeze import freeze
from polytrain.parallel.presets import plain_layout
from polytrain.planning.costmodel import Workload
from polytrain.planning.memory import memory_per_rank

SGD = plain_sgd()
FROZEN = ("0.weight", "2.bias")  # the embedding, and the head's bias beside its trained weight


@pytest.fixture(scope="module")
def data():
    return MaskedWindows(32, seed=1), MaskedWindows(8, seed=2)


@pytest.fixture(scope="module")
def reference(data):
    return reference_weights(data[0], batch_size=8, steps=4, lr=0.5, frozen=FROZEN)[0]


def check(model, initial, reference, how) -> None:
    for name, p in model.named_parameters():
        if name in FROZEN:
            assert torch.equal(p.detach(), initial[name]), (name, how)
        else:
            assert not torch.equal(p.detach(), initial[name]), (name, how)
            assert (p.detach() - reference[name]).abs().max().item() < 1e-13, (name, how)


def test_frozen_parameters_keep_their_values_and_the_rest_train_as_by_hand(data, reference):
    model = token_model()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    polytrain.fit(model, train=data[0], val=data[1], freeze="0.*, 2.bias", **SGD)
    check(model, initial, reference, "one device")


def test_frozen_parameters_get_no_optimizer_state_and_count_no_memory_for_it():
    model = token_model()
    freeze(model, "0.*")
    optimizer = make_optimizer(list(model.named_parameters()), name="adamw")
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert len(held) == 2 and all(p.requires_grad for p in held)
    work = Workload(compute_seconds=0.0, parameter_bytes=100.0, batch_size=1)
    half = Workload(compute_seconds=0.0, parameter_bytes=100.0, batch_size=1, trained_bytes=50.0)
    # weights, gradients and 2 slots of Adam: 400 bytes; half frozen: 100 + 50 * 3
    assert memory_per_rank(work, plain_layout("single", 1), optimizer_slots=2) == 400.0
    assert memory_per_rank(half, plain_layout("single", 1), optimizer_slots=2) == 250.0


def test_a_group_whose_parameters_are_all_frozen_does_not_exist():
    """Frozen 1-D tensors (norms, biases) would leave the no-decay group empty: a placeholder in it on every
    rank, which torch.distributed.checkpoint cannot name (a sharded run crashed at its first checkpoint)."""
    from polytrain.optim.optimizers import plan_groups

    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2, bias=False)
    )
    freeze(model, "0.bias,1.*")
    groups = plan_groups(model.named_parameters(), no_decay=True)
    optimizer = make_optimizer(list(model.named_parameters()), name="adamw", groups=groups)
    assert [len(group["params"]) for group in optimizer.param_groups] == [2]
    assert all(p.numel() for group in optimizer.param_groups for p in group["params"])


@pytest.mark.parametrize(
    "pattern, message",
    [
        ("emb*", "'emb*' matches no parameter; the model's parameters are named e.g. 0.weight"),
        ("*", "matches every parameter of the model, which would train nothing"),
    ],
)
def test_a_pattern_that_matches_nothing_or_everything_is_one_line(data, pattern, message):
    with pytest.raises(UserError, match=message.replace("*", r"\*").replace("(", r"\(")):
        polytrain.fit(token_model(), train=data[0], val=data[1], freeze=pattern, **SGD)


@pytest.mark.multiprocess
def test_frozen_parameters_on_two_devices(data, reference):
    for how in (
        dict(strategy="data"),
        dict(strategy="sharded", accumulate=2),
        dict(strategy="pipeline"),  # the embedding on one stage, the head's bias on the other
        dict(strategy="parameter-server"),
    ):
        model = token_model()
        initial = {name: p.detach().clone() for name, p in model.named_parameters()}
        polytrain.fit(model, train=data[0], val=data[1], devices=2, freeze="0.*,2.bias", **SGD, **how)
        check(model, initial, reference, how)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "model, strategy", [("llama", "tensor"), ("llama", "parameter-server"), ("gpt", "tensor")]
)
def test_a_frozen_model_trains_as_one_device_with_adamw_s_weight_decay(capfd, model, strategy):
    """The first block and every norm frozen, the rest split over 2 tensor ranks, or served by a parameter server:
    equal to one device in float64 with the llama's AdamW and its weight decay (one device's freezing is the
    hand-written loop's, above). A server's master copies of frozen parameters were decayed by its optimizer;
    the GPT's norms, sequence-parallel on tensor ranks, were made trainable by torch's SequenceParallel."""
    heads = ["--kv-heads", "2"] if model == "llama" else []
    done = polytrain_here(
        capfd, "verify", "--model", model, "--dataset", "shakespeare", "--layers", "2", "--width", "32",
        "--heads", "4", *heads, "--context", "16", "--strategy", strategy, "--devices", "2",
        "--steps", "3", "--freeze", "1.*,*norm*",
    )  # fmt: skip
    assert done.returncode == 0 and "PASS" in done.stdout, done.stdout + done.stderr
    assert "frozen" in done.stdout


@pytest.mark.multiprocess
def test_a_sharded_run_whose_one_dimensional_tensors_are_all_frozen_writes_its_checkpoint(tmp_path):
    """The optimizer's groups are planned after --freeze: the no-decay group, all frozen, does not exist (it held a
    placeholder on every rank, and torch.distributed.checkpoint's state dict failed on it with a KeyError)."""
    sizes = dict(layers=2, width=32, heads=4, kv_heads=2, context=16)
    polytrain.fit(
        "llama", "shakespeare", strategy="sharded", devices=2, freeze="*norm*,3.*", max_steps=2, verbose=False,
        out=str(tmp_path / "run"), **sizes,
    )  # fmt: skip
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert (tmp_path / "run" / state["shards"]).is_dir()
