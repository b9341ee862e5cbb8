"""Pipeline stages of a model that is not an nn.Sequential (--split-at NAME,...): torch's tracer
(`torch.distributed.pipelining.pipeline`, built on torch.export) records the model's forward as a graph and cuts
it where the named modules begin.

The graph holds the micro-batch's shape (a `view(B, T, ...)` keeps B as a number), so a micro-batch of another
size would fail in one stage while its peer waits forever. Each size of micro-batch (the smaller last batch of an
epoch, validation's batches) therefore gets a trace of its own, made from the same module: every trace's stage
holds the very same parameter objects, so one optimizer trains one set. Validation traces the model in eval mode.

    polytrain.fit(my_gpt, "shakespeare", strategy="pipeline", devices=2, split_at="transformer.h.2")

The stages hold the model's own parameter objects under the model's names, so the strategy's state dicts, and
so model.pt and checkpoints, use the original names. Every rank keeps the whole model to trace new sizes from.
"""

from __future__ import annotations

import difflib
import warnings
from typing import Iterable, List, Tuple

import torch
import torch.nn as nn

from ..errors import ConfigError, first_line
from .plan import PipelinePlan, last_batch, microbatches_for, stages_per_rank

HOW = (
    "write forward() without Python control flow on tensor values (if x.sum() > 0, .item(), loops over a "
    "tensor's values), or write the model as an nn.Sequential and leave out --split-at, or use --strategy data"
)


def split_names(value) -> Tuple[str, ...]:
    """`"a,b"` (the flag) or ["a", "b"] (from Python) as ("a", "b")."""
    names = value.split(",") if isinstance(value, str) else list(value)
    names = tuple(str(name).strip() for name in names)
    if not names or any(not name for name in names):
        raise ConfigError(
            f"--split-at takes module names separated by commas, such as transformer.h.2, got {value!r}"
        )
    return names


def check_names(model: nn.Module, names: Iterable[str]) -> None:
    """One line for a name that is not a module of `model`: the nearest ones and the names that are."""
    modules = dict(model.named_modules())
    modules.pop("", None)
    for name in names:
        if name in modules:
            continue
        parent = name.rpartition(".")[0]
        near = difflib.get_close_matches(name, list(modules), n=1, cutoff=0.0)
        siblings = [
            n
            for n in modules
            if n.rpartition(".")[0]
            == (parent if parent in modules else near[0].rpartition(".")[0] if near else "")
        ]
        top = [n for n in modules if "." not in n]
        listed = ", ".join(dict.fromkeys(top + siblings[:12]))
        raise ConfigError(
            f"--split-at {name!r} is not a module of {type(model).__name__}"
            f"{f'; did you mean {near[0]!r}' if near else ''}? its modules include {listed}"
        )


def trace(model: nn.Module, names: Tuple[str, ...], example: torch.Tensor, *, training: bool = True):
    """torch's Pipe of `model` cut before each of `names`, traced on `example` (a micro-batch), in training or
    eval mode; the model is left as it was (the tracer wraps the named modules' forward for the trace)."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    was_training = model.training
    model.train(training)
    try:
        with warnings.catch_warnings():  # torch's own deprecations inside export
            warnings.simplefilter("ignore", FutureWarning)
            pipe = pipeline(
                model, mb_args=(example,), split_spec={name: SplitPoint.BEGINNING for name in names}
            )
        return outputs_logits(pipe)
    except Exception as error:  # what torch.export refused, said in one line
        cause = error.__cause__ or error
        raise ConfigError(
            f"--split-at: torch's tracer cannot follow {type(model).__name__}.forward "
            f"({type(cause).__name__}: {first_line(cause, 160)}); {HOW}"
        ) from None
    finally:
        model.train(was_training)
        for name in names:
            module = model.get_submodule(name)
            module.__dict__.pop("forward", None)  # back to the class's forward
            module.__dict__.pop("_orig_forward", None)


def outputs_logits(pipe):
    """`pipe` with its last stage giving only the first of a tuple the model returns ((logits, loss) as
    nanoGPT's forward(idx, targets=None)): the objective takes the logits, and the schedule, which joins the
    micro-batches' outputs, could not join a scalar."""
    last = pipe.get_stage_module(pipe.num_stages - 1)
    output = next(node for node in last.graph.nodes if node.op == "output")
    if isinstance(output.args[0], (tuple, list)):
        output.args = (output.args[0][0],)
        last.graph.eliminate_dead_code()
        last.recompile()
    return pipe


def stage_owners(pipe) -> List[List[str]]:
    """The names of the parameters and buffers each traced stage holds (the model's own names)."""
    return [[name for name, _ in _tensors(pipe.get_stage_module(s))] for s in range(pipe.num_stages)]


def _tensors(module: nn.Module):
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


def modules_of(owners: List[str], depth: int) -> List[str]:
    """Tensor names cut to their module at `depth` dots ("transformer.h.0.ln_1.weight" -> "transformer.h.0")."""
    cut = [".".join(name.split(".")[:-1][:depth]) or name for name in owners]
    return list(dict.fromkeys(cut))


def traced_plan(
    config, model: nn.Module, dataset, layout, schedule: str, microbatches: int, per_replica: int
) -> PipelinePlan:
    """The plan of a traced split, checked here, in the launching process: the names, the trace at the
    runtime micro-batch's shape, the number of stages it gives, and no weight on two stages."""
    stages = layout.pipeline * stages_per_rank(schedule)
    names = split_names(config.split_at)
    if config.split not in (None, "auto"):
        raise ConfigError(
            "give either --split (layer indices of an nn.Sequential) or --split-at (module names), not both"
        )
    if len(names) != stages - 1:
        raise ConfigError(
            f"--split-at names {len(names)} module(s), which makes {len(names) + 1} stages, and the "
            f"pipeline has {stages}; name {stages - 1} module(s) where a stage begins"
        )
    check_names(model, names)
    dtype = str(dataset.sample_inputs(1).dtype).replace("torch.", "")
    sizes = micro_batch_sizes(config, dataset, layout, schedule, microbatches, per_replica)
    device = next(model.parameters(), torch.empty(0)).device
    pipe = trace(
        model, names, torch.zeros(sizes[0], *dataset.input_shape, dtype=getattr(torch, dtype), device=device)
    )
    if pipe.num_stages != stages:
        raise ConfigError(
            f"--split-at {','.join(names)} gave {pipe.num_stages} stages instead of {stages}: each "
            f"named module must run once in each forward; {HOW}"
        )
    refuse_copies(model, pipe)
    for size in sizes[1:]:  # the short last batch's trace, once to see that it works
        trace(
            model, names, torch.zeros(size, *dataset.input_shape, dtype=getattr(torch, dtype), device=device)
        )
    owners = stage_owners(pipe)
    depth = max(name.count(".") + 1 for name in names)
    per_stage = [modules_of(tensors, depth) for tensors in owners]
    points = tuple(sum(len(part) for part in per_stage[:s]) for s in range(1, stages))
    return PipelinePlan(
        schedule,
        microbatches,
        points,
        tuple(n for part in per_stage for n in part),
        tuple(dataset.input_shape),
        input_dtype=dtype,
        split_at=names,
        micro_batch=sizes[0],
    )


def micro_batch_sizes(config, dataset, layout, schedule: str, microbatches: int, per_replica: int) -> list:
    """The sizes of training micro-batches a pipeline replica runs: a whole batch's, then a short last batch's
    (as the strategy's schedules cut them), so that those traces are known to work before any worker starts."""
    wanted = microbatches * config.accumulate
    last = last_batch(dataset.num_train, config.batch_size, config.max_steps) % config.batch_size
    parts = [per_replica] + [
        len(part) for part in torch.tensor_split(torch.arange(last), layout.data_degree)
    ] * bool(last)
    sizes = [
        part // microbatches_for(part, wanted, schedule=schedule, ranks=layout.pipeline) for part in parts
    ]
    return list(dict.fromkeys(sizes))


def refuse_copies(model: nn.Module, pipe) -> None:
    """One line unless every tensor of every traced stage is the model's own (same object, same name): the
    tracer copies a weight that two names share (tied embeddings), and each copy would train apart."""
    own = dict(_tensors(model))
    aliases = {}
    for name, tensor in own.items():
        aliases.setdefault(id(tensor), []).append(name)
    tied = [names for names in aliases.values() if len(names) > 1]
    if tied:
        raise ConfigError(
            f"{' and '.join(tied[0])} are one tensor (tied weights), which torch's tracer copies "
            f"for each stage, so the copies would train apart; untie them for --split-at, or use "
            f"--strategy data or sharded"
        )
    for stage in range(pipe.num_stages):
        for name, tensor in _tensors(pipe.get_stage_module(stage)):
            if own.get(name) is not tensor:
                raise ConfigError(
                    f"torch's tracer gave stage {stage} a copy of {name} instead of the model's tensor; {HOW}"
                )


def view_of(modules: Iterable[nn.Module], keys) -> nn.Module:
    """A module holding the stages' parameters and buffers (the same objects) under their names in the model,
    so its state_dict() has the model's keys for them (only those in `keys`: persistent state)."""
    root = nn.Module()
    for module in modules:
        for name, tensor in _tensors(module):
            *parents, leaf = name.split(".")
            node = root
            for part in parents:
                if not hasattr(node, part):
                    node.add_module(part, nn.Module())
                node = getattr(node, part)
            if hasattr(node, leaf):
                continue
            if isinstance(tensor, nn.Parameter):
                node.register_parameter(leaf, tensor)
            else:
                node.register_buffer(leaf, tensor, persistent=name in keys)
    return root


class TracedStages:
    """A pipeline rank's stages of a traced model, for each micro-batch size and mode, built on demand: the whole
    `model` (later traces start from it), cut as `plan` says; this rank holds model stages `held` on `device`."""

    def __init__(self, model: nn.Module, plan: PipelinePlan, *, held, device: torch.device):
        self.model, self.plan, self.held, self.device = model, plan, tuple(held), device
        self.built = {}  # (size, training) -> (the traced pipe, [this rank's stage modules])

    def modules(self, size: int, *, training: bool = True) -> list:
        key = (size, training)
        if key not in self.built:
            plan = self.plan
            example = torch.zeros(
                size, *plan.input_shape, dtype=getattr(torch, plan.input_dtype), device=self.device
            )
            pipe = trace(self.model, plan.split_at, example, training=training)
            self.built[key] = (pipe, [pipe.get_stage_module(stage) for stage in self.held])
        return self.built[key][1]

    def stages(self, size: int, group, *, training: bool = True) -> list:
        """Fresh PipelineStages (they remember the schedule's micro-batch count) for micro-batches of `size`,
        exchanging activations over `group` (the pipeline's)."""
        self.modules(size, training=training)
        pipe = self.built[(size, training)][0]
        return [pipe.build_stage(stage, self.device, group) for stage in self.held]

    def evaluation(self, microbatches: int, size: int, group, loss):
        """A forward-only schedule over eval-mode traces of `microbatches` micro-batches of `size` (validation)
        over `group`, each micro-batch's output given to `loss`."""
        from torch.distributed.pipelining import ScheduleGPipe, ScheduleInterleaved1F1B

        stages = self.stages(size, group, training=False)
        if len(stages) == 1:
            return ScheduleGPipe(stages[0], microbatches, loss_fn=loss)
        return ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss)


def forward_only(schedule, inputs, target) -> None:
    """One forward-only pass of `schedule` (its `eval`, or its step without backward on a torch before it)."""
    if hasattr(schedule, "eval"):
        schedule.eval(*inputs, target=target)
        return
    kept, schedule._has_backward = schedule._has_backward, False  # torch before eval()
    try:
        schedule.step(*inputs, target=target)
    finally:
        schedule._has_backward = kept


def traced_stages(
    model: nn.Module, plan: PipelinePlan, *, held, device: torch.device, keys
) -> Tuple[TracedStages, nn.Module]:
    """`Pipeline.setup`'s part for --split-at: this rank's stages (`held`) traced at the training micro-batch's
    size, and a module holding their tensors under the model's names (the rank's `model`; `keys` its persistent
    state's)."""
    traced = TracedStages(model, plan, held=held, device=device)
    return traced, view_of(traced.modules(plan.micro_batch), keys)


def traced_holdings(plan):
    """What each traced stage holds, for the start-up lines: its modules (the plan's names for them)."""
    return lambda stage: f"modules {', '.join(plan.layer_names[i] for i in plan.stage_layers(stage))}"
