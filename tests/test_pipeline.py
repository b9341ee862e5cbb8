"""Pipeline parallelism on 2 CPU processes (gloo), 4 for the 2 x 2 mesh, against one device: every schedule and
micro-batch count takes the one-device step; checkpoints hold the whole, unsplit model; runs resume across
strategies; user mistakes get one line before any process starts."""

import copy
import json
import re
import shutil
from functools import partial

import pytest
import torch
from conftest import assert_same_weights, load_weights, tiny_digits
from distributed import run_on_ranks
from processes import polytrain as run_polytrain

import polytrain
from polytrain.cli import main
from polytrain.config import TrainConfig
from polytrain.data.loader import make_loaders
from polytrain.models import build_model
from polytrain.optim import make_optimizer, make_scheduler
from polytrain.pipeline.strategy import Pipeline
from polytrain.runtime.hostenv import share_cores
from polytrain.strategy_registry import make_plan
from polytrain.trainer import Trainer

pytestmark = pytest.mark.multiprocess

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
STEPS = dict(epochs=1, batch_size=16, max_steps=20, device="cpu", verbose=False)  # 20 of 25 steps: mid-epoch


def changed(after: torch.nn.Module, before: torch.nn.Module) -> float:
    return max(float((a - b).detach().abs().max()) for a, b in zip(after.parameters(), before.parameters()))


@pytest.fixture(scope="module")
def lenet_on_one_device():
    """(data, the untrained LeNet, the same LeNet after 20 steps on one device): the reference of the
    equality tests below, trained once."""
    data = tiny_digits(n_train=400, n_val=20)
    torch.manual_seed(0)
    start = build_model("lenet", data.input_shape, 10)
    one = copy.deepcopy(start)
    polytrain.fit(one, data, devices=1, **STEPS)
    assert changed(one, start) > 1e-3  # it did train
    return data, start, one


def _train_each_on_ranks(rank, world_size, model, data, jobs):
    """On each of the 2 ranks: train the pipeline of every (config, plan) in `jobs` as a worker of `fit` does
    (loaders sharded by replica, the run's optimizer and schedule, the trainer); rank 0 returns the weights."""
    found = []
    for config, plan in jobs:
        torch.manual_seed(config.seed)
        strategy = Pipeline(
            device=torch.device("cpu"), rank=rank, world_size=world_size, plan=plan, layout=config.layout
        )
        train, val = make_loaders(
            data,
            batch_size=config.batch_size,
            device="cpu",
            rank=strategy.data_rank,
            world_size=strategy.data_world,
            seed=config.seed,
        )
        steps = len(train)
        strategy.setup(
            copy.deepcopy(model),
            partial(
                make_optimizer,
                name=config.optimizer,
                lr=config.effective_lr,
                momentum=config.momentum,
                weight_decay=config.weight_decay,
            ),
            partial(
                make_scheduler,
                kind=config.schedule,
                total_steps=config.epochs * steps,
                warmup_steps=round(config.warmup_epochs * steps),
            ),
        )
        Trainer(strategy, train, val, epochs=config.epochs, max_steps=config.max_steps).fit()
        weights = strategy.model_state()  # every rank takes part; rank 0 gets the whole model
        found.append(
            {key: value.numpy() for key, value in weights.items()}
        )  # plain pickles through the queue
    return found


@pytest.fixture(scope="module")
def every_schedule_and_microbatch_count(lenet_on_one_device):
    """{(schedule, micro-batches): LeNet's weights after the 20 steps on a 2-stage pipeline}, all nine trained
    in one pair of processes (a spawn per run would cost seconds each)."""
    data, start, _ = lenet_on_one_device
    combos = [(schedule, m) for schedule in SCHEDULES for m in (1, 2, 4)]
    jobs = []
    for schedule, microbatches in combos:
        config = TrainConfig(
            devices=2,
            strategy="pipeline",
            microbatches=microbatches,
            pipeline_schedule=schedule,
            **{k: v for k, v in STEPS.items() if k != "verbose"},
        )
        jobs.append((config, make_plan("pipeline", config, start, data, device=torch.device("cpu"))))
        assert jobs[-1][1].microbatches == microbatches and jobs[-1][1].schedule == schedule
    found = run_on_ranks(_train_each_on_ranks, start, data, jobs, timeout=240)[0]
    return {
        combo: {key: torch.from_numpy(value) for key, value in weights.items()}
        for combo, weights in zip(combos, found)
    }


@pytest.mark.parametrize("microbatches", [1, 2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_and_microbatch_count_equals_one_device(
    lenet_on_one_device, every_schedule_and_microbatch_count, schedule, microbatches
):
    _, start, one = lenet_on_one_device
    weights = every_schedule_and_microbatch_count[schedule, microbatches]
    assert max(float((weights[k] - v).abs().max()) for k, v in start.state_dict().items()) > 1e-3
    assert_same_weights(weights, one.state_dict())


def test_two_pipelines_of_two_stages_on_four_processes_equal_one_device(lenet_on_one_device):
    data, start, one = lenet_on_one_device
    model = copy.deepcopy(start)
    polytrain.fit(model, data, devices=4, strategy="pipeline", pipeline_stages=2, microbatches=2, **STEPS)
    assert changed(model, start) > 1e-3
    assert_same_weights(model.state_dict(), one.state_dict())


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved-1f1b"])  # the 4-process test runs 1f1b
def test_a_smaller_last_batch_that_the_microbatches_do_not_divide_equals_one_device(schedule):
    data = tiny_digits(n_train=5 * 16 + 6, n_val=20)  # a whole epoch: 5 batches of 16, then one of 6
    torch.manual_seed(0)
    start = build_model("lenet", data.input_shape, 10)
    one, two = copy.deepcopy(start), copy.deepcopy(start)
    settings = dict(epochs=1, batch_size=16, device="cpu", verbose=False)
    expected = polytrain.fit(one, data, devices=1, **settings)
    history = polytrain.fit(
        two, data, devices=2, strategy="pipeline", microbatches=4, pipeline_schedule=schedule, **settings
    )  # 4 micro-batches of 4; the last batch of 6 is not
    assert changed(one, start) > 1e-3
    assert_same_weights(two.state_dict(), one.state_dict())
    # the last 6 samples count in the epoch's loss and accuracy too
    assert history.last["train_loss"] == pytest.approx(expected.last["train_loss"], abs=1e-5)
    assert history.last["train_acc"] == expected.last["train_acc"]
    assert history.last["val_acc"] == expected.last["val_acc"]


# -- checkpoints hold the whole model, by its own names ---------------------------------------------------------

RESNET = [
    "--model",
    "resnet",
    "--dataset",
    "synthetic",
    "--synthetic-size",
    "64",
    "--synthetic-shape",
    "3,16,16",
    "--batch-size",
    "16",
    "--epochs",
    "1",
    "--device",
    "cpu",
    "--no-channels-last",
]


@pytest.fixture(scope="module")
def resnet_runs(tmp_path_factory):
    """A ResNet-20 (BatchNorm, nested Sequentials) trained one epoch on a 2-stage pipeline with one micro-batch
    (so each BatchNorm sees the whole batch, as on one device), and the same on one device."""
    folder = tmp_path_factory.mktemp("resnet")
    assert (
        main(
            [
                "train",
                *RESNET,
                "--strategy",
                "pipeline",
                "--devices",
                "2",
                "--microbatches",
                "1",
                "--out",
                str(folder / "pipeline"),
            ]
        )
        == 0
    )
    # the one-device run (in this process, on its threads) on as many threads as each stage's worker had: float32
    # sums split over another count of threads round differently (oneDNN's AVX2 convolutions' weight gradients
    # do, by 1e-5)
    threads = torch.get_num_threads()
    share_cores(2)  # (sets them)
    try:
        assert main(["train", *RESNET, "--out", str(folder / "one")]) == 0
    finally:
        torch.set_num_threads(threads)
    return folder / "pipeline", folder / "one"


def test_a_pipeline_checkpoint_is_the_whole_unsplit_model(resnet_runs):
    pipeline, one = resnet_runs
    saved = load_weights(pipeline / "model.pt")
    fresh = build_model("resnet", (3, 16, 16), 10)
    expected = fresh.state_dict()
    assert list(saved) == list(expected)
    assert {key: tuple(value.shape) for key, value in saved.items()} == {
        key: tuple(value.shape) for key, value in expected.items()
    }
    assert (
        "stem.0.weight" in saved
        and "stages.3.conv1.weight" in saved
        and "stages.3.shortcut.1.running_var" in saved
    )
    fresh.load_state_dict(saved)  # strict: no key missing, none left over
    reference = load_weights(one / "model.pt")
    parameters = {name for name, _ in fresh.named_parameters()}
    assert_same_weights(
        {k: v for k, v in saved.items() if k in parameters},
        {k: v for k, v in reference.items() if k in parameters},
    )


def test_a_pipeline_checkpoint_keeps_batchnorm_statistics_like_one_device(resnet_runs):
    pipeline, one = resnet_runs
    # with one micro-batch each BatchNorm sees the whole batch once per step, as on one device: no extra
    # training-mode forward (a stage's shape inference) may move running_mean, running_var, num_batches_tracked
    assert_same_weights(load_weights(pipeline / "model.pt"), load_weights(one / "model.pt"))


# -- resuming across strategies ---------------------------------------------------------------------------------

COMMON = [
    "--dataset",
    "synthetic",
    "--synthetic-size",
    "96",
    "--model",
    "mlp",
    "--batch-size",
    "16",
    "--epochs",
    "1",
    "--schedule",
    "constant",
    "--device",
    "cpu",
]  # 6 steps; the runs below stop after 3


def train(capfd, *args) -> str:
    code = main(["train", *map(str, args)])
    captured = capfd.readouterr()
    assert code == 0, captured.out + captured.err
    return captured.out


def final_weights(run_dir) -> dict:
    return load_weights(run_dir / "model.pt")


@pytest.fixture(scope="module")
def stopped_runs(tmp_path_factory):
    """(folder, the weights of a straight one-device run): in the folder, "pipeline" (2 stages split at layer 3,
    2 micro-batches) and "single" stopped after 3 of 6 steps, mid-epoch; resumed by copies of them."""
    folder = tmp_path_factory.mktemp("resume")
    assert main(["train", *COMMON, "--out", str(folder / "straight")]) == 0
    assert (
        main(
            [
                "train",
                *COMMON,
                "--strategy",
                "pipeline",
                "--devices",
                "2",
                "--split",
                "3",
                "--microbatches",
                "2",
                "--max-steps",
                "3",
                "--out",
                str(folder / "pipeline"),
            ]
        )
        == 0
    )
    assert main(["train", *COMMON, "--max-steps", "3", "--out", str(folder / "single")]) == 0
    return folder, final_weights(folder / "straight")


@pytest.mark.parametrize(
    "flags, strategy",
    [
        (["--strategy", "data"], "data"),
        (["--strategy", "single", "--devices", "1"], "single"),
        (["--devices", "1"], "single"),  # one device: the pipeline cannot stay, one device remains
    ],
    ids=["data", "single", "devices-1"],
)
def test_a_stopped_pipeline_resumes_under_another_strategy_like_one_straight_run(
    stopped_runs, tmp_path, capfd, flags, strategy
):
    folder, straight = stopped_runs
    shutil.copytree(folder / "pipeline", tmp_path / "run")
    out = train(capfd, "--resume", tmp_path / "run", *flags)
    assert out.startswith(f"resuming {tmp_path / 'run'} in epoch 1 at step 3 of 6 on "), out
    if "--strategy" in flags:
        assert f"--strategy {strategy} (was pipeline)" in out.splitlines()[0]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["strategy"] == strategy
    assert_same_weights(final_weights(tmp_path / "run"), straight)


def test_a_stopped_one_device_run_resumes_as_a_pipeline_with_another_split_like_one_straight_run(
    stopped_runs, tmp_path, capfd
):
    folder, straight = stopped_runs
    shutil.copytree(folder / "single", tmp_path / "run")
    out = train(capfd, "--resume", tmp_path / "run", "--strategy", "pipeline", "--devices", 2, "--split", 4)
    assert "in epoch 1 at step 3 of 6 on 2 CPU processes" in out.splitlines()[0], out
    assert "layers 0-3" in out and "layers 4-5" in out  # split before layer 4, not 3 as above
    assert json.loads((tmp_path / "run" / "config.json").read_text())["strategy"] == "pipeline"
    assert_same_weights(final_weights(tmp_path / "run"), straight)


# -- LeNet on the command line: where its layers run, and the checkpoint it leaves -------------------------------


@pytest.fixture(scope="module")
def lenet_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lenet") / "run"
    result = run_polytrain(
        "train",
        "--strategy",
        "pipeline",
        "--devices",
        "2",
        "--microbatches",
        "1",
        "--model",
        "lenet",
        "--epochs",
        "1",
        "--device",
        "cpu",
        "--max-steps",
        "2",
        "--logger",
        "tensorboard",
        "--out",
        run_dir,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout, run_dir


def test_rank_0_logs_each_step_s_loss_that_its_last_stage_computed(lenet_run):
    """Rank 0 runs the first stage; the step's loss it logs (and shows in the progress line) is the last stage's,
    shared over the pipeline: its mean over the steps is the run's training loss summed over all ranks."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir = lenet_run
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    losses = [event.value for event in events.Scalars("train/step_loss")]
    assert len(losses) == 2 and min(losses) > 1.0, losses  # (LeNet's first steps: about ln 10)
    partial = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert sum(losses) / 2 == pytest.approx(partial["train_loss"], rel=1e-6)


def test_lenet_in_two_stages_puts_convolutions_on_one_device_and_dense_layers_on_the_other(lenet_run):
    out, _ = lenet_run
    stages = {}
    for line in out.splitlines():
        found = re.match(r"\s*stage (\d+): cpu \(rank (\d+)\), layers (\d+)(?:-(\d+))? ", line)
        if found:
            stage, rank, first, last = found.groups()
            assert stage == rank, line
            stages[int(stage)] = range(int(first), int(last or first) + 1)
    assert sorted(stages) == [0, 1], out
    layers = list(build_model("lenet", (1, 28, 28), 10))
    assert [i for span in stages.values() for i in span] == list(
        range(len(layers))
    )  # each layer once, in order
    kinds = {
        kind: {s for s, span in stages.items() for i in span if isinstance(layers[i], kind)}
        for kind in (torch.nn.Conv2d, torch.nn.Linear)
    }
    assert kinds == {torch.nn.Conv2d: {0}, torch.nn.Linear: {1}}, out


def test_the_run_folder_records_which_layers_each_stage_held(lenet_run):
    out, run_dir = lenet_run
    plan = json.loads((run_dir / "config.json").read_text())["strategy_plan"]
    names = [name for name, _ in build_model("lenet", (1, 28, 28), 10).named_children()]
    assert [stage["pipeline_rank"] for stage in plan["stages"]] == [0, 1]
    assert [
        name for stage in plan["stages"] for name in stage["layers"]
    ] == names  # each layer once, in order
    first = len(plan["stages"][0]["layers"])
    assert plan["summary"].startswith("pipeline of 2 stages x 1 replica(s), schedule ")
    assert plan["summary"].endswith(f"split before layers {first}")


def test_a_lenet_checkpoint_loads_into_the_unsplit_model(lenet_run):
    _, run_dir = lenet_run
    saved = load_weights(run_dir / "model.pt")
    fresh = build_model("lenet", (1, 28, 28), 10)
    assert [(k, v.shape) for k, v in saved.items()] == [(k, v.shape) for k, v in fresh.state_dict().items()]
    fresh.load_state_dict(saved)
    result = polytrain.evaluate(fresh, "mnist-sample", device="cpu")
    assert result["count"] > 0 and 0 <= result["acc"] <= 1


def test_evaluate_reads_pipeline_run_folders(lenet_run, resnet_runs):
    _, run_dir = lenet_run
    fresh = build_model("lenet", (1, 28, 28), 10)
    fresh.load_state_dict(load_weights(run_dir / "model.pt"))
    from_folder = polytrain.evaluate(str(run_dir), device="cpu")
    from_module = polytrain.evaluate(fresh, "mnist-sample", device="cpu")
    assert from_folder["count"] == from_module["count"] > 0
    assert from_folder["loss"] == pytest.approx(from_module["loss"], rel=1e-6)
    assert from_folder["acc"] == from_module["acc"]
    pipeline, one = resnet_runs
    split, whole = polytrain.evaluate(str(pipeline), device="cpu"), polytrain.evaluate(str(one), device="cpu")
    assert split["count"] == whole["count"] == 12
    assert split["loss"] == pytest.approx(whole["loss"], abs=1e-5) and split["acc"] == whole["acc"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_compiled_stages_train_as_one_device(capfd):
    """--compile on a pipeline of a model without blocks: each of LeNet's stages compiled in place and held by
    DDP over 2 pipelines of 2 stages (test_parallelize.py checks what is compiled); one device's steps, in
    float64."""
    from conftest import polytrain_here

    done = polytrain_here(
        capfd, "verify", "--model", "lenet", "--dataset", "mnist-sample", "--strategy", "pipeline",
        "--devices", "4", "--pipeline-stages", "2", "--compile", "--steps", "2",
    )  # fmt: skip
    assert done.returncode == 0 and "PASS" in done.stdout, done.stdout + done.stderr
