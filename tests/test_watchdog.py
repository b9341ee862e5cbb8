"""The watchdog's allowance: a step is judged against the steps the run has taken and the first step against
what the model's size predicts, so a healthy slow step is never killed and a real hang is still named within
the stated bound; an explicit --hang-timeout is a fixed bound. The watching thread runs here for real, with
allowances of seconds instead of minutes, and reports into a list instead of ending the process."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from polytrain.runtime.watchdog import Allowance, Watchdog, first_step_work, predicted_step_seconds


class Recording(Watchdog):
    """A watchdog whose report is recorded (with when it came) instead of ending the process."""

    def __init__(self, allowance: Allowance):
        super().__init__(rank=1, allowance=allowance, poll=0.05)
        self.reports = []

    def report(self, silent, stack, waiting, limit):
        self.reports.append((silent, limit, self.describe(silent, stack, waiting, limit)))
        self.stopped.set()


class Run:
    """The trainer as the watchdog sees it: one epoch of steps, each taking the seconds given."""

    def __init__(self, dog: Watchdog):
        self.dog, self.position = dog, SimpleNamespace(epoch=0, step=0)
        dog.on_fit_start(self)
        dog.on_epoch_start(self, 0)

    def step(self, seconds: float) -> None:
        time.sleep(seconds)
        self.dog.on_step_end(self, self.position.step)
        self.position.step += 1

    def hang(self, seconds: float) -> float:
        """No beat for up to `seconds`; when the watchdog reported, how long after the last beat."""
        began = time.monotonic()
        self.dog.stopped.wait(seconds)
        return time.monotonic() - began


@pytest.fixture
def run_of():
    runs = []

    def start(allowance: Allowance) -> Run:
        runs.append(Run(Recording(allowance)))
        return runs[-1]

    yield start
    for run in runs:
        run.dog.on_fit_end(run)


def test_a_first_step_the_model_size_predicts_is_not_killed_and_a_first_step_hang_is_named(run_of):
    # floor 0.3 s (+0.2 s start-up); the model's size predicts 1.0 s for the first step: it may take 2.0 s
    allowance = Allowance(predicted_first=1.0, floor=0.3, start_up=0.2)
    assert allowance.first_step() == 2.0
    healthy = run_of(allowance)
    healthy.step(1.2)  # longer than the plain allowance (0.5 s), within the prediction's
    assert healthy.dog.reports == []
    stuck = run_of(allowance)
    silent = stuck.hang(30)
    assert len(stuck.dog.reports) == 1 and 2.0 <= silent < 2.0 + 5
    assert "epoch 1, step 1 (allowed: 2s, the first step's allowance" in stuck.dog.reports[0][2]


def test_a_step_as_slow_as_the_runs_earlier_steps_is_not_killed_and_a_later_hang_is_named(run_of):
    allowance = Allowance(floor=0.3, start_up=0.2)  # nothing predicted: the first step may take 0.5 s
    run = run_of(allowance)
    for _ in range(2):
        run.step(0.25)
    run.step(0.7)  # slower than the floor, and within 4x the slowest step so far (0.25 s or more)
    assert run.dog.reports == [] and run.dog.slowest >= 0.7
    bound = allowance.later_step(run.dog.slowest)
    assert bound == pytest.approx(4 * run.dog.slowest)
    silent = run.hang(30)
    assert len(run.dog.reports) == 1 and bound <= silent < bound + 5
    assert "4x the slowest step so far" in run.dog.reports[0][2]


def test_an_explicit_hang_timeout_bounds_every_step_as_given(run_of):
    allowance = Allowance(fixed=0.5, predicted_first=100.0, start_up=0.2)  # the prediction is not used
    assert allowance.first_step() == pytest.approx(0.7) and allowance.later_step(100.0) == 0.5
    run = run_of(allowance)
    run.step(0.4)
    silent = run.hang(30)  # 4x the slowest step would allow 1.6 s; the user said 0.5 s
    assert len(run.dog.reports) == 1 and 0.5 <= silent < 0.5 + 5
    assert "--hang-timeout)" in run.dog.reports[0][2]


def test_the_defaults_and_compilation():
    assert Allowance().first_step() == 90.0 and Allowance().later_step(1.0) == 60.0
    assert Allowance().later_step(100.0) == 400.0
    assert Allowance(predicted_first=421.0).first_step() == 842.0
    assert Allowance(compiling=True).first_step() == 630.0
    assert (
        Allowance(fixed=1500.0).first_step() == 1530.0 and Allowance(fixed=1500.0).later_step(9e9) == 1500.0
    )
    assert Allowance(fixed=10.0, compiling=True).first_step() == 130.0


def test_the_predicted_step_by_hand():
    # 1e12 FLOPs on half a CPU core at 2 GFLOP/s, 1 GB over a 100 MB/s link
    assert predicted_step_seconds(flops=1e12, exchanged_bytes=1e9, device_type="cpu", cores=0.5) == 1010.0
    assert predicted_step_seconds(flops=1e12, exchanged_bytes=1e9, device_type="cuda", cores=0.5) == 2.0
    # 1e6 parameters of 4 bytes, 3e8 FLOPs per sample, 2 samples, checkpointing recomputes the forward
    flops, moved = first_step_work(
        flops_per_sample=3e8, samples=2, parameters=10**6, parameter_bytes=4 * 10**6, world=2,
        checkpointing="full",
    )  # fmt: skip
    assert flops == pytest.approx(3e8 * 2 * 4 / 3 + 12e6) and moved == 16e6
    flops, moved = first_step_work(
        flops_per_sample=float("nan"), samples=1, parameters=10**6, parameter_bytes=4 * 10**6, world=1,
        checkpointing="none",
    )  # fmt: skip
    assert flops == 6e6 + 12e6 and moved == 0.0


def test_the_large_llama_the_defaults_killed_gets_a_first_step_allowance_of_minutes(monkeypatch):
    """The 620M-parameter Llama on 8 sharded CPU processes of a 2-core machine, --batch-size 8, --context 32,
    --activation-checkpointing full: its steps took 137 s and 124 s, and the default watchdog killed it after
    91 s. Its first step is now allowed several times what it took, and a hang is still named in under 15
    minutes."""
    from polytrain.config import TrainConfig
    from polytrain.data import load_dataset
    from polytrain.models import build_model_on_meta
    from polytrain.objective import Objective
    from polytrain.runtime import worker

    options = dict(layers=24, heads=12, kv_heads=4, width=1536, context=32)
    config = TrainConfig(
        model="llama", dataset="shakespeare", batch_size=8, devices=8, strategy="sharded",
        activation_checkpointing="full", **options,
    )  # fmt: skip
    dataset = load_dataset("shakespeare", context=32)
    model = build_model_on_meta("llama", (32,), dataset.num_classes, options)
    assert 600e6 < sum(p.numel() for p in model.parameters()) < 640e6
    job = worker.Job(config, "sharded", dataset, model, objective=Objective(kind=dataset.kind))
    strategy = SimpleNamespace(data_world=8, world_size=8, device=torch.device("cpu"), is_main=False)
    monkeypatch.setattr(worker, "usable_cores", lambda: 2)
    callbacks, _, _ = worker._make_callbacks(
        job, strategy, SimpleNamespace(local_world_size=8), module_loop=None, rank=1
    )
    (dog,) = [c for c in callbacks if isinstance(c, Watchdog)]
    first = dog._limit()
    assert 4 * 137 < first < 15 * 60, first  # predicted: 842 s
    dog.steps_seen, dog.slowest = 1, 137.0
    assert dog._limit() == 4 * 137.0  # the second step (124 s) has that much
