"""CUDA graphs' choices, tested without a GPU: which models and settings are captured, what a capture leaves
as it was, which shapes replay. (The graphs themselves are tested against eager steps in test_cuda.py.)"""

import contextlib
import copy

import pytest
import torch
import torch.nn as nn

from polytrain.models import build_model
from polytrain.objective import Objective
from polytrain.strategies import cuda_graphs
from polytrain.strategy_registry import STRATEGIES


def strategy(name="single", **settings):
    return STRATEGIES[name](device="cpu", objective=settings.pop("objective", Objective()), **settings)


def test_what_cannot_be_captured_is_named():
    lenet = build_model("lenet", (1, 28, 28), 10)
    assert cuda_graphs.reason_against(strategy(), lenet) is None
    assert "--compile" in cuda_graphs.reason_against(strategy(compile=True), lenet)
    assert "checkpointing" in cuda_graphs.reason_against(strategy(activation_checkpointing="full"), lenet)
    assert "--devices 2" in cuda_graphs.reason_against(strategy("data", world_size=2), lenet)
    own = strategy(objective=Objective(step=lambda model, batch: model(batch[0]).sum()))
    assert "own training step" in cuda_graphs.reason_against(own, lenet)
    dropout = build_model("cifar-cnn", (3, 32, 32), 10)
    assert "dropout" in cuda_graphs.reason_against(strategy(), dropout)
    handle = lenet[0].register_forward_hook(lambda *args: None)
    assert "hooks" in cuda_graphs.reason_against(strategy(), lenet)
    handle.remove()
    lenet[0].weight.register_hook(lambda grad: grad)
    assert "parameter" in cuda_graphs.reason_against(strategy(), lenet)


class _FakeStream:
    def wait_stream(self, other):
        pass


@pytest.fixture
def no_gpu(monkeypatch):
    """torch.cuda as far as the host sees it: a capture runs the pass once (a real one records its kernels
    instead, and the first replay runs them), replays do nothing. Returns the shapes captured."""
    captured = []

    class FakeGraph:
        def replay(self):
            pass

    @contextlib.contextmanager
    def capture(graph, pool=None, capture_error_mode=None):
        captured.append(graph)
        yield

    for name, value in dict(
        synchronize=lambda: None,
        Stream=_FakeStream,
        current_stream=_FakeStream,
        stream=lambda stream: contextlib.nullcontext(),
        graph_pool_handle=lambda: None,
        CUDAGraph=FakeGraph,
        graph=capture,
        get_rng_state=lambda device: torch.get_rng_state(),
        set_rng_state=lambda state, device: torch.set_rng_state(state),
    ).items():
        monkeypatch.setattr(torch.cuda, name, value)
    return captured


def test_a_capture_leaves_batchnorm_statistics_and_random_state_as_they_were(no_gpu):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(10))
    x, y = torch.randn(8, 1, 6, 6), torch.randint(0, 10, (8,))
    model(x)  # the lazy layer's shape
    eager = {k: v.clone() for k, v in model.state_dict().items()}
    reference = nn.Sequential(*[m for m in model])  # the same modules: one eager pass for comparison
    graphed = cuda_graphs.GraphedPasses(model, Objective(), precision="fp32", note=print)
    before = torch.get_rng_state()
    loss, count, metrics = graphed(x, y)
    assert torch.equal(torch.get_rng_state(), before)
    after_one = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(eager)
    reference(x)  # exactly one forward's update of the running statistics
    for name, value in model.state_dict().items():
        assert torch.equal(after_one[name], value), name
    assert count == 8 and metrics.shape == (1,) and not metrics.requires_grad and loss.requires_grad
    loss.backward()  # the backward graph hands each parameter its gradient
    assert all(p.grad is not None for p in model.parameters())


def test_two_shapes_are_captured_and_others_run_eagerly(no_gpu):
    model = build_model("mlp", (1, 4, 4), 10)
    graphed = cuda_graphs.GraphedPasses(model, Objective(), precision="fp32")
    for rows in (8, 8, 3, 8, 5, 3):
        result = graphed(torch.randn(rows, 1, 4, 4), torch.randint(0, 10, (rows,)))
        assert (result is None) == (rows == 5)
    assert len(no_gpu) == 2 * 2 and graphed.replays == 5  # a forward and a backward graph per shape
    assert sorted(key[0] for key in graphed.graphs) == [(3, 1, 4, 4), (8, 1, 4, 4)]
    assert graphed(torch.randn(8, 16), torch.randint(0, 10, (8,))) is None  # another shape, a third
    assert graphed({"x": torch.randn(8, 1, 4, 4)}, torch.zeros(8)) is None  # dict inputs: eager


def test_a_failed_capture_says_so_once_and_leaves_the_run_eager(no_gpu, monkeypatch):
    def fail(graph, pool=None, capture_error_mode=None):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(torch.cuda, "graph", fail)
    notes = []
    graphed = cuda_graphs.GraphedPasses(build_model("mlp", (1, 4, 4), 10), Objective(), precision="fp32",
                                        note=notes.append)  # fmt: skip
    for _ in range(3):
        assert graphed(torch.randn(8, 1, 4, 4), torch.randint(0, 10, (8,))) is None
    assert notes == [
        "CUDA graphs: off, capturing the training pass failed (operation not permitted when stream is "
        "capturing); eager from now on"
    ]


def test_gradients_released_from_a_graphs_buffers_are_copies():
    layer = nn.Linear(3, 2)
    shared = torch.ones(2, 3)
    layer.weight.grad = shared
    cuda_graphs.release_gradients(list(layer.parameters()))
    shared.zero_()  # the graph's next replay
    assert torch.equal(layer.weight.grad, torch.ones(2, 3)) and layer.bias.grad is None


def test_hooks_registered_after_start_up_keep_the_run_eager_with_one_line(no_gpu):
    model = build_model("mlp", (1, 4, 4), 10)
    notes = []
    graphed = cuda_graphs.GraphedPasses(model, Objective(), precision="fp32", note=notes.append)
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))  # e.g. by a callback's on_fit_start
    assert graphed(torch.randn(8, 1, 4, 4), torch.randint(0, 10, (8,))) is None
    assert len(notes) == 1 and "has hooks" in notes[0] and not no_gpu and graphed.failed


def test_a_training_step_takes_a_replayed_pass_as_it_takes_an_eager_one(no_gpu):
    """The strategy's step takes a captured pass's loss and metric sums as the eager step's (the fake capture
    computed this batch), counts the replay, and hands every parameter the gradient the graph returns. (The fake cannot replay the backward with the step's real incoming gradient: the equality of whole
    steps is tested on a GPU, test_cuda.py.)"""
    from polytrain.data.order import Batch

    torch.manual_seed(0)
    model = build_model("mlp", (1, 4, 4), 10)
    x, y = torch.randn(8, 1, 4, 4), torch.randint(0, 10, (8,))
    steps = []
    for graphed in (True, False):
        single = strategy()
        single.setup(
            copy.deepcopy(model),
            lambda named: torch.optim.SGD([p for _, p in named], lr=0.1, momentum=0.9),
            lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        )
        if graphed:
            single.graphed = cuda_graphs.GraphedPasses(single.model, single.objective, precision="fp32")
        stats = single.train_step(Batch(x, y, global_count=8, step=0))
        steps.append((stats, single))
    (graphed_stats, graphed), (eager_stats, eager) = steps
    assert graphed.graphed.replays == 1
    torch.testing.assert_close(graphed_stats.loss_sum, eager_stats.loss_sum, rtol=0, atol=0)
    torch.testing.assert_close(graphed_stats.metrics, eager_stats.metrics, rtol=0, atol=0)
    # the gradients the graph handed over reached every parameter (their values come from the fake capture's
    # incoming gradient, an uninitialised buffer: only a real replay fills it)
    assert all(p.grad is not None and p.grad.shape == p.shape for p in graphed.model.parameters())
