"""What the cost model needs, measured in this process in a few seconds: the model's sizes, one device's
forward + backward at the slice sizes N devices would run, the optimizer update, and the link between two
ranks (gloo over loopback between two process groups of this process; on GPUs, a copy between two GPUs).

Where the N "devices" are CPU processes of this machine they share its cores: each gets cores/N threads
(polytrain's workers do the same), and beyond one process per core they take turns. The N slices are timed
at once, in N threads, under those conditions, so the prediction for N processes is for this machine.
Every quantity is timed in rounds interleaved with the others' and keeps its fastest round (timing.py): load
from other programs only adds time, and a busy machine should predict, and choose, as an idle one does.
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn as nn

from ..config.host import usable_cores
from ..pipeline.plan import default_microbatches
from ..planning.costmodel import Link, Prediction, Workload
from ..planning.predict import predict_all
from .tensor_inputs import narrowed, runs, split_share, tensor_fields, tensor_plans
from .timing import Step, Together, gloo_pair, gpu_copies, interleave, low, low_by_key

LINK_SIZES = (4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20)
ASSUMED_GPU_LINK = Link(alpha=10e-6, beta=100e9)  # NVLink-class; used only where no link can be measured
# the key of a tensor-parallel layer timing among the measured samples
TENSOR_PROBE = "tensor"


def sample_batch(dataset, count: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """`count` training samples as model input (floats) and targets, repeating the set if it is smaller."""
    if hasattr(dataset, "sample_batch"):  # a Dataset or text: its inputs as the model gets them
        x, y = dataset.sample_batch(
            min(count, len(dataset.train) if hasattr(dataset, "train") else dataset.num_train)
        )
    else:
        x, y = dataset.sample_inputs(count), dataset.train_y[:count]
    repeats = -(-count // len(x))
    return torch.cat([x] * repeats)[:count], torch.cat([y] * repeats)[:count]


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def parameter_layers(model: nn.Module) -> int:
    """FSDP2's units, each gathered separately (parallel/units.py)."""
    from ..parallel.units import unit_count

    return unit_count(model)


@torch.no_grad()
def boundary_bytes(model: nn.Module, sample: torch.Tensor) -> Tuple[float, ...]:
    """Bytes per sample of the activations crossing each cut between consecutive layers of a Sequential
    (empty for a model the pipeline cannot split)."""
    from ..pipeline.layers import flatten_layers

    try:
        layers = flatten_layers(model)
    except Exception:
        return ()
    was_training = model.training
    model.eval()
    sizes, x = [], sample[:1]
    try:
        for _, layer in layers[:-1]:
            x = layer(x)
            sizes.append(float(x.numel() * x.element_size()))
    finally:
        model.train(was_training)
    return tuple(sizes)


def checkpointing_fields(model: nn.Module, objective, x: torch.Tensor, y: torch.Tensor) -> dict:
    """The block figures activation checkpointing changes (blocks, and per sample what one keeps, its input,
    its matrix products' outputs), from a forward on fake tensors (activation_memory.py)."""
    from .activation_memory import activation_profile

    profile = activation_profile(model, objective, x, y)
    return {key: value for key, value in profile.items() if key != "activation_bytes"}


def activation_bytes(model: nn.Module, objective, x: torch.Tensor, y: torch.Tensor) -> float:
    """Bytes per sample that a training forward pass (and its loss) keeps for the backward pass, counted as
    autograd saves them: each storage once (q, k and v are views of one), the weights not at all; over the
    first two samples, halved; 0 where the objective cannot score the outputs alone. The forward runs in training
    mode, which moves BatchNorm's statistics: pass a copy."""
    was_training = model.training
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: Dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    count = min(2, len(x))
    try:
        model.train()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            objective.loss_sum(model(x[:count]), y[:count])
    except Exception:  # an objective that needs more than outputs and targets: unknown (0)
        return 0.0
    finally:
        model.train(was_training)
    return float(sum(kept.values())) / count


@contextmanager
def threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, count))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cpu_threads(devices: int, cores: Optional[int] = None) -> int:
    """Threads each of `devices` worker processes on this machine gets (as hostenv.share_cores gives)."""
    return max(1, (cores or usable_cores()) // devices)


def measure_workload(
    model: nn.Module,
    dataset,
    objective,
    *,
    batch_size: int,
    device: torch.device,
    devices: Iterable[int],
    repeats: int = 5,
    channels_last: bool = False,
    plain: bool = False,
    tensor_devices: Iterable[int] = (),
) -> Workload:
    """One device's step at `batch_size`, and each count's replica slice and pipeline micro-batch, timed as
    they would run: on CPU processes, all slices at once on the cores they share. With `channels_last` and
    `plain`, the same again in the default memory format (`Workload.plain`), for the strategies that train in it.
    Where the model has a tensor plan, its sizes, and at each of `tensor_devices` a tensor rank's share."""
    return measure(
        model,
        dataset,
        objective,
        batch_size=batch_size,
        device=device,
        devices=devices,
        repeats=repeats,
        channels_last=channels_last,
        plain=plain,
        tensor_devices=tensor_devices,
    )[0]


def measure(
    model: nn.Module,
    dataset,
    objective,
    *,
    batch_size: int,
    device: torch.device,
    devices: Iterable[int],
    repeats: int = 5,
    channels_last: bool = False,
    plain: bool = False,
    link: bool = False,
    min_seconds: float = 0.0,
    tensor_plan=None,
    tensor_devices: Iterable[int] = (),
) -> Tuple[Workload, Optional[Tuple[Link, str]]]:
    """`measure_workload`, and with `link` the link as `measure_link` gives it, every quantity timed in at least
    `repeats` interleaved rounds spanning at least `min_seconds`, each count's apart; each keeps its fastest.
    `tensor_plan`: the run's plan for tensor parallelism (None: the built-in one, where the model has one)."""
    formats = (channels_last, False) if channels_last and plain else (channels_last,)
    x, y = sample_batch(dataset, batch_size)
    samples: Dict[tuple, list] = {}
    plans = tensor_plans(model, [n for n in set(devices) if n >= 2], tensor_plan=tensor_plan)
    stand_ins = {t: narrowed(model, plan, t) for t, plan in plans.items()}
    tensor = _TensorProbes(
        {t: m for t, m in stand_ins.items() if runs(m, objective, x, y)}, set(tensor_devices)
    )
    with ExitStack() as whole_run:
        probes, how = {}, None
        if link:
            link_probe, how = _link_probe(device, whole_run)
            if link_probe is not None:
                probes["link"] = link_probe
        for n in sorted(n for n in set(devices) if n >= 2) or [None]:
            with ExitStack() as group:
                for memory_format in formats:
                    probes.update(
                        _probes(
                            model, x, y, objective, n, device=device, channels_last=memory_format, stack=group
                        )
                    )
                    probes.update(
                        tensor.probes(
                            x, y, objective, n, device=device, channels_last=memory_format, stack=group
                        )
                    )
                found = interleave(probes, rounds=repeats, min_seconds=min_seconds)
                for key, values in found.items():
                    samples.setdefault(key, []).extend(values)
            probes = {key: probe for key, probe in probes.items() if key == "link"}
    fields = tensor_fields(model, plans, objective, x, y)
    works = [
        tensor.fill(
            _workload(
                samples, memory_format, model=model, x=x, y=y, objective=objective, batch_size=batch_size
            ),
            fields,
            samples,
            memory_format,
        )
        for memory_format in formats
    ]
    work = dataclasses.replace(works[0], plain=works[1]) if len(works) == 2 else works[0]
    if not link:
        return work, None
    if "link" not in samples:
        return work, (ASSUMED_GPU_LINK, how)
    return work, (_fit(low_by_key(samples["link"]), two_rank_allreduce=device.type == "cpu"), how)


def _probes(
    model: nn.Module,
    x,
    y,
    objective,
    n: Optional[int],
    *,
    device: torch.device,
    channels_last: bool,
    stack: ExitStack,
) -> Dict[tuple, Callable]:
    """What one round times in one memory format: one device's whole batch, and for `n` devices the replica
    slice (where the batch divides) and the pipeline's micro-batch, side by side on CPUs."""
    import copy

    own = copy.deepcopy(model)
    whole = Step(own, x, y, objective, device=device, channels_last=channels_last)
    probes: Dict[tuple, Callable] = {(channels_last, "whole"): whole}
    if n is None:
        return probes
    sizes = {"micro": len(x) // default_microbatches(len(x), n)}
    if len(x) % n == 0:
        sizes["replica"] = len(x) // n
    if device.type == "cpu":  # n processes at once on the cores they share
        side = stack.enter_context(
            _side_by_side(model, x, y, objective, list(sizes.values()), copies=n, channels_last=channels_last)
        )
        for which, what in enumerate(sizes):
            probes[(channels_last, what, n)] = partial(_slowest, side, which, cpu_threads(n))
    else:  # each GPU computes alone
        for what, size in sizes.items():
            step = Step(own, x[:size], y[:size], objective, device=device, channels_last=channels_last)
            probes[(channels_last, what, n)] = partial(lambda step: step()[0], step)
    return probes


def _side_by_side(
    model: nn.Module, x, y, objective, sizes: List[int], *, copies: int, channels_last: bool
) -> Together:
    """`copies` replicas, each in its own thread on its own copy: a call `side(i)` steps all of them at once on
    the first `sizes[i]` samples, as that many CPU processes would on this machine's shared cores."""
    import copy

    def setup(_):
        own = copy.deepcopy(model)
        steps = [
            Step(own, x[:size], y[:size], objective, device=torch.device("cpu"), channels_last=channels_last)
            for size in sizes
        ]
        return lambda which: steps[which]()[0]

    return Together(copies, setup)


def _slowest(side: Together, which: int, count: int) -> float:
    """The slowest replica's pass, which a synchronous step waits for, with each replica on `count` threads."""
    with threads(count):
        return max(side(which))


def _workload(
    samples: Dict[tuple, list], memory_format: bool, *, model: nn.Module, x, y, objective, batch_size: int
) -> Workload:
    import copy

    passes, updates = zip(*samples[(memory_format, "whole")])
    timed = {
        what: {
            key[2]: low(values)
            for key, values in samples.items()
            if key != "link" and key[0] == memory_format and key[1] == what
        }
        for what in ("replica", "micro")
    }
    plain_model = copy.deepcopy(model).to("cpu", memory_format=torch.contiguous_format)
    return Workload(
        compute_seconds=low(passes) + low(updates),
        parameter_bytes=parameter_bytes(model),
        batch_size=batch_size,
        update_seconds=low(updates),
        layers=parameter_layers(model),
        boundary_bytes=boundary_bytes(plain_model, x[:1].cpu()),
        activation_bytes=activation_bytes(plain_model, objective, x.cpu(), y.cpu()),  # (a copy)
        **checkpointing_fields(plain_model, objective, x[:2].cpu(), y[:2].cpu()),
        replica_seconds=timed["replica"],
        microbatch_seconds=timed["micro"],
        **mixture_fields(plain_model, x.cpu()),
    )


def mixture_fields(model: nn.Module, x: torch.Tensor) -> dict:
    """The Workload's fields of `model`'s mixtures of experts ({} for a dense model): how many, the experts of
    each, the bytes of their stacked experts, the bytes per sample one mixture sends in one all-to-all (each
    of a sample's tokens once per expert it chooses, a row of the model's width), and how the sample batch `x`
    is routed: each expert's (token, choice) pairs over every mixture (one forward, in training mode)."""
    from ..models.moe import mixtures

    found = mixtures(model)
    if not found:
        return {}
    kept, training = [m.routed for m in found], model.training  # (a run's counts, which its records read)
    for mixture in found:
        mixture.routed = None
    with torch.no_grad():
        model.train()(x)
    model.train(training)
    counted = [m.routed for m in found if m.routed is not None]
    for mixture, routed in zip(found, kept):
        mixture.routed = routed
    first = found[0].experts
    weights = [p for m in found for p in m.experts.parameters()]
    element = weights[0].element_size()
    return dict(
        mixtures=len(found),
        experts=first.experts,
        expert_bytes=float(sum(p.numel() * p.element_size() for p in weights)),
        routed_bytes=float(x[0].numel() * found[0].per_token * first.width * element),
        routed_counts=tuple(float(c) for c in sum(counted).tolist()) if counted else (),
    )


class _TensorProbes:
    """The timings of tensor parallelism's stand-ins (`tensor_inputs.narrowed`, by group size): the smallest
    group's on the whole batch as one device runs it (the split layers' share of a pass), and at each count of
    `counts` one rank of every group that divides it, on its group's slice, side by side on CPUs."""

    def __init__(self, stand_ins: Dict[int, nn.Module], counts: set):
        self.stand_ins, self.counts = stand_ins, counts

    def probes(
        self,
        x,
        y,
        objective,
        n: Optional[int],
        *,
        device: torch.device,
        channels_last: bool,
        stack: ExitStack,
    ) -> Dict[tuple, Callable]:
        import copy

        if not self.stand_ins:
            return {}
        smallest = copy.deepcopy(self.stand_ins[min(self.stand_ins)])
        step = Step(smallest, x, y, objective, device=device, channels_last=channels_last)
        probes: Dict[tuple, Callable] = {(channels_last, "narrow"): step}
        for tensor, stand_in in self.stand_ins.items():
            if n is None or n not in self.counts or n % tensor or len(x) % (n // tensor):
                continue
            size = len(x) // (n // tensor)
            if device.type == "cpu":  # n processes at once, each a rank of one of the groups
                side = stack.enter_context(
                    _side_by_side(stand_in, x, y, objective, [size], copies=n, channels_last=channels_last)
                )
                probes[(channels_last, TENSOR_PROBE, n, tensor)] = partial(_slowest, side, 0, cpu_threads(n))
            else:
                alone = Step(
                    copy.deepcopy(stand_in),
                    x[:size],
                    y[:size],
                    objective,
                    device=device,
                    channels_last=channels_last,
                )
                probes[(channels_last, TENSOR_PROBE, n, tensor)] = partial(lambda step: step()[0], alone)
        return probes

    def fill(self, work: Workload, fields: dict, samples: Dict[tuple, list], memory_format: bool) -> Workload:
        """`work` with the tensor fields: sizes, the split layers' share of a pass, the ranks' timed shares."""
        if not fields:
            return work
        narrow = samples.get((memory_format, "narrow"))
        share = split_share(
            work.pass_seconds,
            low([p for p, _ in narrow]) if narrow else None,
            tensor=min(self.stand_ins) if self.stand_ins else 2,
            fallback=fields["split_bytes"] / work.parameter_bytes,
        )
        timed = {
            (key[2], key[3]): low(values)
            for key, values in samples.items()
            if key != "link" and key[0] == memory_format and key[1] == TENSOR_PROBE
        }
        return dataclasses.replace(work, split_share=share, tensor_seconds=timed, **fields)


def turns(devices: int, *, device_type: str, cores: Optional[int] = None) -> float:
    """How many CPU processes take turns on each core (1 where there are no more processes than cores, and on
    GPUs)."""
    return max(1.0, devices / (cores or usable_cores())) if device_type == "cpu" else 1.0


def link_for(link: Link, devices: int, *, device_type: str, cores: Optional[int] = None) -> Link:
    """The link as `devices` ranks see it: CPU processes beyond one per core take turns on the cores, so each
    message waits for its receiver to be scheduled (latency grows by devices / cores)."""
    return Link(alpha=link.alpha * turns(devices, device_type=device_type, cores=cores), beta=link.beta)


def predictions_for(
    work: Workload,
    link: Link,
    *,
    devices: int,
    kind: str,
    message_costs: Optional[dict] = None,
    meshes: bool = True,
) -> Dict[str, Prediction]:
    """Every strategy's predicted step on `devices` of `kind`, as this machine's processes or GPUs run it
    (`meshes`: also tensor parallelism on (data, tensor) meshes), and for a mixture of experts each with the
    experts split over the ranks it can lend them (planning/experts.py)."""
    from ..strategy_registry import contiguous_strategies

    turned = link_for(link, devices, device_type=kind)
    return predict_all(
        work,
        devices,
        turned,
        microbatches=default_microbatches(work.batch_size, devices),
        contiguous=contiguous_strategies(),
        scatter_by_allreduce=kind == "cpu",
        message_costs=message_costs,
        meshes=meshes,
        turns=turns(devices, device_type=kind),
    )


def measure_link(device: torch.device, *, repeats: int = 8) -> Tuple[Link, str]:
    """The link between two ranks, fitted to timed messages (each size's fastest of `repeats`), and how it was
    obtained."""
    with ExitStack() as stack:
        probe, how = _link_probe(device, stack)
        if probe is None:
            return ASSUMED_GPU_LINK, how
        timed = interleave({"link": probe}, rounds=repeats)["link"]
    return _fit(low_by_key(timed), two_rank_allreduce=device.type == "cpu"), how


def _link_probe(device: torch.device, stack: ExitStack) -> Tuple[Optional[Callable], str]:
    """A callable timing one message of each of LINK_SIZES (None where no link can be measured), and what it
    measures."""
    if device.type == "cuda":
        if torch.cuda.device_count() < 2:
            return None, (
                "assumed (one GPU here, no link to measure): "
                f"{ASSUMED_GPU_LINK.alpha * 1e6:.0f} us, {ASSUMED_GPU_LINK.beta / 1e9:.0f} GB/s"
            )
        return gpu_copies(LINK_SIZES), "measured: copies between GPU 0 and GPU 1"
    pair = stack.enter_context(gloo_pair(LINK_SIZES))
    return (
        lambda: {size: max(r[size] for r in pair()) for size in LINK_SIZES}
    ), "measured: gloo all-reduce over loopback"


def _fit(samples: Dict[int, float], *, two_rank_allreduce: bool = False) -> Link:
    fitted = Link.fit(list(samples), list(samples.values()), relative=True)
    # a two-rank ring all-reduce takes S/B + 2 alpha: the fitted intercept is two messages' latency
    return Link(alpha=fitted.alpha / 2, beta=fitted.beta) if two_rank_allreduce else fitted
