"""The CUDA and NCCL paths; skipped on machines without a GPU (CI), run by hand on one."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_digits

import polytrain
from polytrain.data.loader import make_loaders
from polytrain.models import build_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_fit_on_cuda_matches_a_hand_written_cuda_loop(monkeypatch):
    # TF32 convolutions round differently for different memory layouts; compare in full fp32.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    data = tiny_digits(n_train=192)
    torch.manual_seed(0)
    model = build_model("lenet", data.input_shape, 10)
    reference = copy.deepcopy(model).cuda()
    train, _ = make_loaders(data, batch_size=32, device="cuda")
    opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for batch in train.train_batches(0):
        loss = F.cross_entropy(reference(batch.x.contiguous()), batch.y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    polytrain.fit(
        model,
        data,
        epochs=1,
        batch_size=32,
        lr=0.05,
        momentum=0.9,
        weight_decay=0.0,
        schedule="constant",
        warmup_epochs=0,
        device="cuda",
        verbose=False,
    )
    for ours, theirs in zip(model.state_dict().values(), reference.state_dict().values()):
        torch.testing.assert_close(ours, theirs.cpu(), atol=1e-4, rtol=1e-4)  # cuDNN picks its own kernels


@pytest.mark.parametrize("settings", [dict(precision="bf16"), dict(compile=True), dict(strategy="data")])
def test_cuda_variants_train(settings):
    history = polytrain.fit(
        "lenet", tiny_digits(n_train=512), epochs=3, batch_size=64, device="cuda", verbose=False, **settings
    )
    assert history.last["val_acc"] > 0.9


def _graph_recorder(monkeypatch):
    from polytrain.strategies import cuda_graphs

    made = []
    original = cuda_graphs.GraphedPasses.__init__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(cuda_graphs.GraphedPasses, "__init__", record)
    return made


@pytest.mark.parametrize(
    "model, settings",
    [("lenet", dict(accumulate=2)), ("resnet", dict(precision="fp32")), ("lenet", dict(precision="fp16"))],
)
def test_cuda_graphs_train_as_the_eager_steps(monkeypatch, model, settings):
    # full fp32 (no TF32) so that graphs and eager steps can be compared closely; 200 samples in batches
    # of 64: a short last batch of 8, which gets a graph of its own
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    # cuDNN's default weight-gradient kernels add in a varying order: two eager runs of the ResNet differ too
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    shape = (3, 32, 32) if model == "resnet" else (1, 28, 28)
    data = tiny_digits(n_train=200, shape=shape)
    made = _graph_recorder(monkeypatch)
    states = []
    for graphs in (True, False):
        torch.manual_seed(0)
        net = build_model(model, data.input_shape, 10)
        polytrain.fit(net, data, epochs=2, batch_size=64, device="cuda", verbose=False, cuda_graphs=graphs,
                      **settings)  # fmt: skip
        states.append({k: v.detach().cpu().clone() for k, v in net.state_dict().items()})
    (graphed,) = made
    passes = 2 * 4 * settings.get("accumulate", 1)
    assert graphed.replays == passes and len(graphed.graphs) == 2 and not graphed.failed
    for name, value in states[1].items():  # BatchNorm's running statistics too
        gap = (states[0][name].double() - value.double()).abs().max().item()
        torch.testing.assert_close(states[0][name], value, atol=1e-4, rtol=1e-4, msg=f"{name}: {gap:.3g}")


class _ReadsTheHost(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = build_model("lenet", (1, 28, 28), 10)

    def forward(self, x):
        if x.abs().sum().item() < 0:  # a host read: cannot be captured
            return x
        return self.net(x)


def test_a_model_that_cannot_be_captured_trains_eagerly_with_one_line(capsys):
    data = tiny_digits(n_train=128)
    torch.manual_seed(0)
    model = _ReadsTheHost()
    reference = copy.deepcopy(model)
    polytrain.fit(model, data, epochs=1, batch_size=64, device="cuda", verbose=True, lr=0.01)
    out = capsys.readouterr().out
    assert out.count("CUDA graphs: off, capturing the training pass failed") == 1, out
    polytrain.fit(reference, data, epochs=1, batch_size=64, device="cuda", verbose=False, lr=0.01,
                  cuda_graphs=False)  # fmt: skip
    for ours, theirs in zip(model.state_dict().values(), reference.state_dict().values()):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
