"""CUDA graphs for the training passes of a model on one GPU.

A small model's step on a GPU waits on the host: LeNet at batch 64 spends about 2 ms launching kernels for
about 0.3 ms of GPU work. Here each pass's forward (with its loss and metric sums) and its backward are
captured once as two CUDA graphs (`torch.cuda.CUDAGraph`) and replayed for every later pass of
the same input shapes: one launch each instead of dozens. The optimizer, clipping, loss scaling and the
schedule still run eagerly, as written, so the step computes what the eager step computes (up to the GPU's
kernel choices).

- At most two shapes get graphs (a run's full passes and its short last batch); others run eagerly, as
  evaluation does (the model itself is never patched).
- Capturing runs the pass three times on a side stream first (as torch's `make_graphed_callables` does):
  BatchNorm's running statistics and the CUDA random generator are put back as they were afterwards.
- The graphs are captured here rather than by `make_graphed_callables`, which keeps the captured autograd
  graph alive: its parameters' gradient nodes then belong to the side stream, and every eager backward warns
  of (and waits on) the stream mismatch.
- A model whose Python does work per call (hooks, dropout drawn per step, activation checkpointing, a step
  of its own) is not captured: `reason_against` says why in the start-up line, and the run is eager.
- If capturing fails (e.g. a `.item()` in `forward`), one line says so and the run continues eagerly.
"""

from __future__ import annotations

import torch
import torch.nn as nn

MAX_SHAPES = 2  # the full pass and the short last batch


def reason_against(strategy, model: nn.Module):
    """Why this strategy's training passes cannot be replayed as CUDA graphs (None: they can)."""
    objective = strategy.objective
    if strategy.world_size > 1:
        return f"--devices {strategy.world_size} (CUDA graphs replay one-device steps only)"
    if strategy.compile:
        return "--compile (compiled code makes graphs of its own with mode='reduce-overhead')"
    if strategy.activation_checkpointing != "none":
        return "--activation-checkpointing recomputes blocks in the backward pass"
    if objective.step is not None:
        return "the model's own training step (step=, or a LightningModule's training_step)"
    if objective.counted:
        return "the loss gives (sum, count) pairs, whose count the step reads on the host"
    hooked = _hooked(model)
    if hooked:
        return f"{hooked} has hooks, which would run only when the graph is captured"
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return f"dropout ({name}) draws new masks on the host each step"
    return None


def _hooked(model: nn.Module):
    """The name of a module or parameter of `model` with hooks (or 'a global module hook'), else None."""
    module_hooks = nn.modules.module
    if any(
        getattr(module_hooks, table, None)
        for table in (
            "_global_forward_hooks",
            "_global_forward_pre_hooks",
            "_global_backward_hooks",
            "_global_backward_pre_hooks",
        )
    ):
        return "a global module hook"
    for name, module in model.named_modules():
        tables = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
        if any(getattr(module, table, None) for table in tables):
            return f"module {name or 'the model'}"
    for name, parameter in model.named_parameters():
        if parameter._backward_hooks or getattr(parameter, "_post_accumulate_grad_hooks", None):
            return f"parameter {name}"
    return None


class _Pass(nn.Module):
    """One training pass as a module of (inputs, targets): the loss summed over the samples and the metric
    sums. Its parameters are the model's (what the graph's backward returns gradients for)."""

    def __init__(self, model: nn.Module, objective, autocast, with_metrics: bool):
        super().__init__()
        self.model = model
        self.objective = objective
        self.autocast = autocast
        self.with_metrics = with_metrics

    def forward(self, x, y):
        loss_sum, _, outputs = self.objective.compute(self.model, x, y, autocast=self.autocast)
        if self.with_metrics:
            return loss_sum, self.objective.metric_sums(outputs, y)
        return (loss_sum,)


WARMUP = 3  # eager passes on a side stream before capturing (cuDNN's and cuBLAS's choices, lazy set-up)


class _Graph:
    """One input shape's training pass captured as two CUDA graphs: forward (loss and metric sums) and the
    backward pass from the loss to the parameters' gradients. Everything they read and write lives in static
    tensors of their own: a replay copies the batch in and reads the results out."""

    def __init__(self, module: _Pass, x: torch.Tensor, y: torch.Tensor):
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.x, self.y = x.clone(), y.clone()  # static inputs: each batch is copied in (never the dataset)
        state = [(buffer, buffer.clone()) for buffer in module.buffers()]
        rng = torch.cuda.get_rng_state(x.device)
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                loss = module(self.x, self.y)[0]
                torch.autograd.grad(loss, self.params, allow_unused=True)
            del loss
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        with torch.no_grad():  # the warm-up passes' BatchNorm updates and random draws are undone
            for buffer, before in state:
                buffer.copy_(before)
        torch.cuda.set_rng_state(rng, x.device)
        pool = torch.cuda.graph_pool_handle()
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        # thread_local: a loader's thread may use CUDA while this one captures
        with torch.cuda.graph(self.forward_graph, pool=pool, capture_error_mode="thread_local"):
            outputs = module(self.x, self.y)
        self.grad_output = torch.empty_like(outputs[0])
        with torch.cuda.graph(self.backward_graph, pool=pool, capture_error_mode="thread_local"):
            self.grads = torch.autograd.grad(
                outputs[0], self.params, grad_outputs=self.grad_output, allow_unused=True
            )
        # only the results are kept, not the captured autograd graph: the eager steps' autograd nodes are then
        # made on the training stream, as in a run without graphs
        self.loss = outputs[0].detach()
        self.metrics = outputs[1].detach() if len(outputs) > 1 else None

    def forward(self, x, y) -> None:
        self.x.copy_(x)
        self.y.copy_(y)
        self.forward_graph.replay()

    def backward(self, grad_output: torch.Tensor) -> list:
        self.grad_output.copy_(grad_output)
        self.backward_graph.replay()
        # tensors of their own over the static gradients: autograd may then take them as .grad without a copy
        return [None if grad is None else grad.detach() for grad in self.grads]


class _Replay(torch.autograd.Function):
    """A captured pass in the eager autograd graph: its forward replays the forward graph, its backward the
    backward graph, which hands the parameters their gradients."""

    @staticmethod
    def forward(ctx, graph: _Graph, x, y, *params):
        graph.forward(x, y)
        ctx.graph = graph
        return graph.loss.clone()  # the next replay overwrites the graph's own

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        return (None, None, None, *ctx.graph.backward(grad_output))


class GraphedPasses:
    """The training passes of one model on one GPU, replayed from CUDA graphs per input shape."""

    def __init__(self, model: nn.Module, objective, *, precision: str, note=print):
        self.model, self.objective, self.note = model, objective, note
        self.precision = precision
        self.graphs: dict = {}  # (shape, dtype, strides) of inputs and targets -> its _Graph
        self.failed = False
        self.replays = 0  # passes run from a graph (the tests read it)

    def _autocast(self):
        """Autocast without its cache of cast weights, which would outlive the capture."""
        if self.precision in ("bf16", "fp16"):
            dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
            return torch.autocast("cuda", dtype=dtype, cache_enabled=False)
        return torch.autocast("cuda", enabled=False)

    def __call__(self, x, y):
        """(loss sum, samples, metric sums or None) of a pass replayed from a graph, or None: run it eagerly."""
        if self.failed or not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor) or len(y) == 0:
            return None
        key = (tuple(x.shape), x.dtype, x.stride(), tuple(y.shape), y.dtype)
        graph = self.graphs.get(key)
        if graph is None:
            if len(self.graphs) >= MAX_SHAPES:
                return None
            graph = self.graphs[key] = self._capture(x, y)
            if graph is None:
                return None
        self.replays += 1
        loss_sum = _Replay.apply(graph, x, y, *graph.params)
        return loss_sum, len(y), None if graph.metrics is None else graph.metrics.clone()

    def _capture(self, x, y):
        module = _Pass(self.model, self.objective, self._autocast, bool(self.objective.names))
        try:
            hooked = _hooked(self.model)  # registered since start-up (a callback's on_fit_start, say)
            if hooked:
                raise RuntimeError(f"{hooked} has hooks, which would run only when the graph is captured")
            return _Graph(module, x, y)
        except Exception as error:  # noqa: BLE001 - any capture failure leaves the run eager, and says why
            self.failed = True
            text = str(error).strip()
            reason = text.splitlines()[0] if text else type(error).__name__
            self.note(
                f"CUDA graphs: off, capturing the training pass failed ({reason[:160]}); eager from now on"
            )
            return None


def release_gradients(parameters) -> None:
    """Gradients that may be a graph's output buffers, as tensors of their own (before another replay of the
    same graph in one step would overwrite them: accumulation)."""
    holders = [p for p in parameters if p.grad is not None]
    if holders:
        for p, copy in zip(holders, torch._foreach_mul([p.grad for p in holders], 1.0)):
            p.grad = copy


def graph_passes(strategy, model: nn.Module):
    """On a GPU: the strategy's training passes replayed as CUDA graphs where asked and possible (`GraphedPasses`,
    else None), with a start-up line saying which."""
    if strategy.device.type != "cuda" or strategy.world_size > 1:
        return None
    reason = "--no-cuda-graphs" if not strategy.wants_cuda_graphs else reason_against(strategy, model)
    if reason is not None:
        strategy.placement.append(f"CUDA graphs: off ({reason})")
        return None
    strategy.placement.append(
        "CUDA graphs: each training pass's forward and backward replay as graphs captured on its first batch of a "
        "shape (--no-cuda-graphs: eager)"
    )
    return GraphedPasses(model, strategy.objective, precision=strategy.precision)
