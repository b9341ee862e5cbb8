"""The launching process plans a model built on the meta device without ever holding it whole: the pipeline's
`--split auto` times (or weighs) one layer at a time. Counted by a dispatch mode that sees every tensor torch
makes and weighs the storages still alive after each operation."""

import pytest
import torch
import torch.nn as nn
from conftest import tiny_digits
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from polytrain.config import TrainConfig
from polytrain.errors import UserError
from polytrain.parallel.meta import materialised_copy, one_by_one
from polytrain.pipeline.layers import flatten_layers, time_layers
from polytrain.pipeline.strategy import Pipeline

CPU = torch.device("cpu")
WIDTH, DEPTH = 256, 8
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4  # one Linear's weight and bias


class PeakBytes(TorchDispatchMode):
    """The most bytes of storage made inside the mode alive at once (checked after every operation)."""

    def __init__(self):
        super().__init__()
        self.storages, self.peak = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                storage = tensor.untyped_storage()
                self.storages.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        self.storages = {key: kept for key, kept in self.storages.items() if not kept[0].expired()}
        self.peak = max(self.peak, sum(size for _, size in self.storages.values()))
        return out


def meta_model() -> nn.Sequential:
    with torch.device("meta"):
        return nn.Sequential(
            nn.Flatten(), *[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)], nn.Linear(WIDTH, 10)
        )


def data():
    return tiny_digits(n_train=64, n_val=8, shape=(1, 16, 16))


def config(**settings) -> TrainConfig:
    values = dict(devices=2, strategy="pipeline", batch_size=16, epochs=1, device="cpu", seed=0)
    return TrainConfig(**dict(values, **settings))


def test_split_auto_holds_one_layer_at_a_time_while_timing_or_weighing_a_meta_model():
    whole = (DEPTH * (WIDTH * WIDTH + WIDTH) + WIDTH * 10 + 10) * 4
    for microbatches in (4, 1):  # timed in seconds; weighed in bytes (one micro-batch)
        model = meta_model()
        with PeakBytes() as counted:
            plan = Pipeline.make_plan(config(microbatches=microbatches), model, data(), device=CPU)
        assert len(plan.costs) == DEPTH + 2 and all(cost > 0 for cost in plan.costs[1:])
        # a layer's copy, the module full_values fills it from, its gradients, and a micro-batch or two
        assert counted.peak < 4 * LAYER_BYTES < whole / 2, (microbatches, counted.peak)
        assert all(p.is_meta for p in model.parameters())  # the model itself is left on meta


def test_the_count_catches_the_whole_copy_planning_made_before():
    model, sample = meta_model(), data().sample_inputs(4)
    with PeakBytes() as counted:  # what make_plan did: a materialised copy of the whole model, then timed
        time_layers(flatten_layers(materialised_copy(model, device=CPU, seed=0)), sample, repeats=1)
    assert counted.peak > DEPTH * LAYER_BYTES


def test_layers_one_by_one_have_the_initial_values_of_the_whole_model():
    model = meta_model()
    whole = materialised_copy(model, device=CPU, seed=3).state_dict()
    for name, layer in one_by_one(model, flatten_layers(model), device=CPU, seed=3):
        for key, value in layer.state_dict().items():
            torch.testing.assert_close(value, whole[f"{name}.{key}"], rtol=0, atol=0)


def never_built(*args, **kwargs):
    raise AssertionError("the whole model was built in the launching process")


def test_bench_refuses_a_model_it_could_not_hold_before_building_it(monkeypatch):
    from polytrain.runtime import bench
    from polytrain.scaling import whole_model

    monkeypatch.setattr(whole_model, "available_per_rank", lambda device, devices: 2**20)
    monkeypatch.setattr(bench, "build_model", never_built)
    options = bench.BenchOptions(
        model="gpt", dataset="shakespeare", devices=(1,), strategies=("single",), layers=2, width=64, heads=2
    )
    with pytest.raises(UserError) as refused:
        bench.run_bench(options)
    line = str(refused.value)
    assert "\n" not in line and "polytrain bench" in line and "--strategy sharded" in line, line


def test_strategy_auto_refuses_to_time_a_model_it_could_not_hold_and_names_the_strategy_flag(monkeypatch):
    from polytrain.scaling import auto, whole_model

    monkeypatch.setattr(whole_model, "available_per_rank", lambda device, devices: 2**20)
    monkeypatch.setattr(whole_model, "materialised_copy", never_built)
    with pytest.raises(UserError) as refused:
        auto.choose_strategy(
            config(strategy="auto", microbatches=None),
            meta_model(),
            data(),
            None,
            device=CPU,
            channels_last=False,
        )
    line = str(refused.value)
    assert "\n" not in line and "--strategy auto" in line and "--strategy sharded" in line, line
    assert "5 copies" in line  # on 2 devices: itself, one device's, 2 side by side, one for the sizes


def test_split_at_traces_a_model_built_on_meta_without_giving_it_storage():
    from nanogpt_model import NanoGPT
    from test_pipeline_traced import CONTEXT, plan_of

    with torch.device("meta"):
        model = NanoGPT(11, CONTEXT, width=256)
    with PeakBytes() as counted:
        plan = plan_of(model)
    assert plan.split_at == ("transformer.h.1",) and all(p.is_meta for p in model.parameters())
    assert counted.peak < 64 * 1024, counted.peak  # the example micro-batches; no weights
