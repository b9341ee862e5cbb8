"""Every user mistake gets a polytrain answer: one line naming the problem and the fix, never a traceback."""

import pytest
import torch
from conftest import tiny_digits

import polytrain
from polytrain.cli import main
from polytrain.errors import ConfigError, UserError


def one_line_error(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    return err


@pytest.mark.parametrize("devices", [1, 2])
def test_a_model_with_too_few_outputs_is_refused_before_training(tmp_path, devices):
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 5))
    with pytest.raises(UserError) as refused:  # before any worker starts: a UserError, not WorkerFailed
        polytrain.fit(
            model,
            tiny_digits(),
            devices=devices,
            batch_size=32,
            device="cpu",
            out=str(tmp_path / "run"),
            verbose=False,
        )
    assert str(refused.value) == (
        "the model gives 5 outputs per image, but the dataset has 10 classes "
        "(labels 0..9); make its last layer give 10 outputs"
    )
    assert not (tmp_path / "run").exists()


def test_a_model_that_cannot_take_the_images_is_refused_in_one_line():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10))
    with pytest.raises(UserError) as refused:
        polytrain.fit(model, tiny_digits(), verbose=False)
    message = str(refused.value)
    assert message.startswith("the model cannot take the dataset's 1x28x28 images") and "\n" not in message


def test_tensor_data_infers_its_classes_from_the_labels():
    data = tiny_digits()
    binary = tuple(
        t if i % 2 == 0 else t % 2 for i, t in enumerate((data.train_x, data.train_y, data.val_x, data.val_y))
    )
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 2))
    history = polytrain.fit(model, binary, epochs=1, batch_size=32, verbose=False)
    assert history.last["val_acc"] > 0.5


@pytest.mark.parametrize(
    "keyword, words",
    [
        ({"epoch": 1}, "fit() has no keyword epoch=; did you mean epochs=?"),
        ({"loss_fn": None}, "fit() has no keyword loss_fn=; did you mean loss=?"),
        ({"zzz": None}, "fit() has no keyword zzz=; it takes "),
        ({"batchsize": 32}, "did you mean batch_size=?"),
    ],
)
def test_an_unknown_keyword_names_the_nearest_one(keyword, words):
    with pytest.raises(ConfigError) as refused:
        polytrain.fit("lenet", "synthetic", verbose=False, **keyword)
    assert words in str(refused.value)


@pytest.mark.parametrize(
    "settings, words",
    [
        (dict(lr=-1), "lr= must be a finite number >= 0, got -1"),
        (
            dict(batch_size=63, devices=2),
            "batch_size=63 (the global batch) does not divide evenly across devices=2",
        ),
        (dict(optimizer="lion"), "unknown optimizer='lion'"),
        (dict(schedule="steplr"), "StepLR needs step_size: pass schedule_args='step_size=...'"),
    ],
)
def test_errors_from_python_speak_of_keywords_not_flags(settings, words):
    with pytest.raises(UserError) as refused:
        polytrain.fit("lenet", "synthetic", verbose=False, **settings)
    assert words in str(refused.value) and "--" not in str(refused.value)


def test_dataset_options_the_dataset_does_not_read_are_refused(capsys):
    err = one_line_error(capsys, ["train", "--data-dir", "/data/mnist"])
    assert err == (
        "polytrain: error: --data-dir is not used by --dataset mnist-sample; drop it, or choose a "
        "dataset that uses it (mnist, fashion-mnist, cifar10, folder, text, tokens, hf)\n"
    )
    err = one_line_error(capsys, ["train", "--dataset", "mnist", "--synthetic-size", "10", "--download"])
    assert "--synthetic-size is not used by --dataset mnist" in err
    with pytest.raises(UserError, match="data_dir= is not used with dataset 'synthetic'"):
        polytrain.fit("lenet", "synthetic", data_dir="/data", verbose=False)


@pytest.mark.parametrize(
    "argv, start, hint",
    [
        (
            ["train", "--epoch", "3"],
            "polytrain train: error:",
            "unrecognized argument --epoch; did you mean --epochs?",
        ),
        (["train", "--batch", "32"], "polytrain train: error:", "did you mean --batch-size?"),
        (["verify", "--step", "3"], "polytrain verify: error:", "did you mean --steps?"),
        (["predict", "runs/x", "--shw", "3"], "polytrain predict: error:", "did you mean --show?"),
    ],
)
def test_flags_match_exactly_and_unknown_ones_get_a_suggestion(capsys, argv, start, hint):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.startswith(start) and hint in err and "Traceback" not in err
    assert err.count("\n") == 1 and "usage:" not in err, err


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["train", "--epochs", "three"],
            "polytrain train: error: argument --epochs: expected a number of epochs such "
            "as 3 or 1.5, got 'three'; see polytrain train --help",
        ),
        (
            ["evaluate", "runs/x", "--device", "gpu"],
            "polytrain evaluate: error: argument --device: invalid choice: "
            "'gpu' (choose from 'auto', 'cpu', 'cuda'); see polytrain evaluate "
            "--help",
        ),
        (
            ["evaluate"],
            "polytrain evaluate: error: the following arguments are required: RUN_DIR; see polytrain "
            "evaluate --help",
        ),
        (
            ["bench", "--steps", "x"],
            "polytrain bench: error: argument --steps: invalid int value: 'x'; see polytrain bench --help",
        ),
    ],
)
def test_argparse_mistakes_are_one_line_without_the_usage_block(capsys, argv, line):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2 and capsys.readouterr().err == line + "\n"


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--gpus", "2"], "--gpus: polytrain calls it --devices N (with --device cuda)"),
        (["--num-gpus", "2"], "--num-gpus: polytrain calls it --devices N (with --device cuda)"),
        (
            ["--grad-accum", "4"],
            "--grad-accum: polytrain calls it --accumulate K (polytrain's batch size is the batch "
            "per optimizer step",
        ),
        (
            ["--lr-scheduler", "cosine"],
            "--lr-scheduler: polytrain calls it --schedule NAME (constant, cosine, onecycle, "
            "or any torch.optim.lr_scheduler class by name with --schedule-args K=V,...)",
        ),
        (["--learning-rate", "0.1"], "--learning-rate: polytrain calls it --lr X"),
        (
            ["--accelerator", "gpu"],
            "--accelerator: polytrain calls it --device cuda (or cpu, or auto; the count is --devices N)",
        ),
        (
            ["--num-workers", "2"],
            "--num-workers: num_workers= is a setting of polytrain.fit() only (loader processes "
            "per rank for train=/val= Datasets); the command line does not take it",
        ),
    ],
)
def test_other_trainers_flags_get_polytrains_names(capsys, flags, said):
    with pytest.raises(SystemExit) as stopped:
        main(["train", *flags])
    err = capsys.readouterr().err
    assert (
        stopped.value.code == 2
        and err.startswith("polytrain train: error: unrecognized argument ")
        and said in err
    )
    assert err.count("\n") == 1 and "no such setting" not in err, err


@pytest.mark.parametrize(
    "keyword, said",
    [
        ({"gpus": 2}, "fit() has no keyword gpus=; polytrain calls it devices=N (with device='cuda')"),
        (
            {"accelerator": "gpu"},
            "fit() has no keyword accelerator=; polytrain calls it device='cuda' (or cpu, or auto; "
            "the count is devices=N)",
        ),
        ({"num_train_epochs": 3}, "fit() has no keyword num_train_epochs=; polytrain calls it epochs=N"),
        ({"learning_rate": 0.1}, "fit() has no keyword learning_rate=; polytrain calls it lr=X"),
    ],
)
def test_other_trainers_keywords_get_polytrains_names(keyword, said):
    with pytest.raises(ConfigError) as refused:
        polytrain.fit("lenet", "synthetic", verbose=False, **keyword)
    assert str(refused.value) == said


def test_help_says_what_models_and_data_must_be_and_its_paths_work(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "runs/LATEST" in text and "integer labels" in text and "(N, classes)" in text


SCRIPT = """\
import polytrain
from polytrain.runtime.launch import unguarded_main_call


def where():
    return unguarded_main_call()


print("top level:", where())
if __name__ == "__main__":
    print("guarded:", where())
if __name__ != "__main__":
    pass
else:
    print("not a guard:", where())
polytrain.fit("mlp", "synthetic", devices=DEVICES, strategy="data", epochs=1, batch_size=32, verbose=False, out=OUT)
"""


@pytest.mark.parametrize("devices", [2, 1])
def test_an_unguarded_script_is_refused_before_any_worker_starts(tmp_path, devices):
    """Workers are spawned: they import the user's script again, and a top-level fit() would train again in
    each of them. The call is refused in the script's own process, naming its line, before any worker starts.
    One device, whatever the strategy, trains in the script's own process: nothing to guard."""
    import sys

    from processes import finish, start

    script = tmp_path / "train_me.py"
    script.write_text(SCRIPT.replace("DEVICES", str(devices)).replace("OUT", repr(str(tmp_path / "run"))))
    done = finish(start([sys.executable, str(script)]), timeout=120)
    if devices == 1:
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "run" / "model.pt").exists()
        return
    assert done.returncode == 1
    assert "top level: train_me.py:9\nguarded: None\nnot a guard: train_me.py:15\n" in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "run").exists()
    assert last == (
        f"polytrain.errors.UserError: polytrain trains on devices={devices} in worker processes that "
        "import your script again, and train_me.py:16 would start training again in each of them; put "
        'the code that trains under `if __name__ == "__main__":`'
    )
    assert "bootstrapping phase" not in done.stderr and "worker rank" not in done.stderr


class Squares(torch.utils.data.Dataset):
    """A small Dataset of (image, label) pairs whose `classes` is whatever the test gives."""

    def __init__(self, classes, n=64):
        self.data, self.classes = tiny_digits(n_train=n, n_val=4), classes

    def __len__(self):
        return len(self.data.train_y)

    def __getitem__(self, i):
        return self.data.train_x[i].float() / 255, int(self.data.train_y[i])


def test_a_dataset_may_give_its_classes_as_a_count():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
    history = polytrain.fit(
        model, train=Squares(10), val=Squares(10), epochs=1, batch_size=32, num_workers=0, verbose=False
    )
    assert history.last["val_acc"] >= 0
    with pytest.raises(
        UserError, match="train.classes is a float; give a list of class names or their count"
    ):
        polytrain.fit(
            model, train=Squares(3.0), val=Squares(3.0), epochs=1, batch_size=32, num_workers=0, verbose=False
        )


def test_a_batch_larger_than_the_training_set_is_said_in_one_line(capsys, tmp_path):
    assert main(["train", "--batch-size", "100000", "--max-steps", "1", "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "note: --batch-size 100000 is larger than the 8,000 training samples, so each epoch is one "
        "step of 8,000; give --batch-size 8000 or less to train as asked\n"
    )


def test_more_cpu_processes_than_the_cores_can_take_are_refused(capsys, monkeypatch):
    from polytrain.runtime import hostenv, launch

    for module in (hostenv, launch):
        monkeypatch.setattr(module, "usable_cores", lambda: 2)
    err = one_line_error(capsys, ["train", "--devices", "64", "--device", "cpu"])
    assert err.startswith(
        "polytrain: error: --devices 64: this machine has 2 cores, and more than 8 CPU processes "
        "would only take turns on them; use --devices 8 or fewer"
    )


def test_a_split_point_may_be_a_whole_number():
    assert polytrain.TrainConfig(strategy="pipeline", devices=2, split=3).split == "3"


def test_a_run_that_fails_before_its_first_checkpoint_leaves_nothing_and_can_be_retried(
    tmp_path, monkeypatch
):
    from polytrain.runtime import phases  # train_run's phases: train_in_folder runs the job

    out = tmp_path / "run"

    def fails(job):
        assert (out / "config.json").is_file()  # the folder was written before the workers started
        raise RuntimeError("a worker died before its first step")

    with monkeypatch.context() as patched:
        patched.setattr(phases, "run_job", fails)
        with pytest.raises(RuntimeError):
            polytrain.fit("mlp", tiny_digits(), epochs=1, batch_size=32, out=str(out), verbose=False)
    assert not out.exists()
    kept = tmp_path / "mine"
    kept.mkdir()
    (kept / "notes.txt").write_text("the user's own file")
    with monkeypatch.context() as patched:
        patched.setattr(phases, "run_job", lambda job: (_ for _ in ()).throw(RuntimeError("again")))
        with pytest.raises(RuntimeError):
            polytrain.fit("mlp", tiny_digits(), epochs=1, batch_size=32, out=str(kept), verbose=False)
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]  # a folder it did not make keeps the rest
    history = polytrain.fit("mlp", tiny_digits(), epochs=1, batch_size=32, out=str(out), verbose=False)
    assert len(history.epochs) == 1 and (out / "model.pt").is_file()


def test_evaluate_names_its_data_and_a_module_without_forward_is_told_so():
    class FloatTargets(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return torch.zeros(1, 28, 28), torch.zeros(3)

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
    with pytest.raises(UserError, match=r"^data\[0\]'s target is a float32 tensor of shape \(3,\)"):
        polytrain.evaluate(model, FloatTargets())

    class NoForward(torch.nn.Module):
        pass

    with pytest.raises(UserError, match="^NoForward has no forward method; define forward"):
        polytrain.fit(NoForward(), tiny_digits(), verbose=False)


def test_a_final_softmax_with_the_default_cross_entropy_is_one_line_and_nll_of_the_log_trains():
    """Every Keras translation ends in Softmax; cross-entropy applies softmax again and the loss stalls at 2.30."""
    import torch.nn as nn
    import torch.nn.functional as F
    from conftest import tiny_digits

    import polytrain
    from polytrain.errors import UserError

    data = tiny_digits(n_train=64, n_val=16)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 10), nn.Softmax(dim=1))
    with pytest.raises(
        UserError,
        match=r"outputs are probabilities \(each row of 10 sums to 1: a final Softmax\?\)"
        r".*stall near loss 2.30; drop the final Softmax",
    ):
        polytrain.fit(model, data, epochs=1, verbose=False)
    history = polytrain.fit(
        model, data, epochs=3, batch_size=16, verbose=False, loss=lambda p, y: F.nll_loss(torch.log(p), y)
    )
    assert history["train_loss"][-1] < min(2.0, history["train_loss"][0])


def test_a_model_with_more_outputs_than_the_labels_use_says_so_in_one_line(capsys):
    import torch.nn as nn

    import polytrain

    x = torch.randint(0, 256, (40, 1, 4, 4), dtype=torch.uint8)
    y = torch.arange(40) % 3
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 10))
    polytrain.fit(model, (x[:32], y[:32], x[32:], y[32:]), epochs=1, batch_size=8)
    out = capsys.readouterr().out
    assert (
        out.count(
            "note: the model gives 10 outputs per image, but the labels use only 0..2 (3 classes): "
            "outputs 3..9 are trained never to be chosen"
        )
        == 1
    )


def test_predict_on_a_language_model_points_to_generate(tmp_path, capsys):
    from conftest import polytrain_here

    run = tmp_path / "gpt"
    trained = polytrain_here(
        None,
        "train",
        "--model",
        "gpt",
        "--dataset",
        "shakespeare",
        "--layers",
        1,
        "--width",
        16,
        "--heads",
        2,
        "--context",
        8,
        "--max-steps",
        2,
        "--device",
        "cpu",
        "--out",
        run,
    )
    assert trained.returncode == 0
    capsys.readouterr()
    err = one_line_error(capsys, ["predict", str(run)])
    assert err == (
        f"polytrain: error: predict shows the labels an image classifier gives; {run} is a language model "
        f"(--model gpt on --dataset shakespeare): sample its text with polytrain generate {run}\n"
    )
    with pytest.raises(UserError, match="polytrain generate"):
        polytrain.predict(run)


def test_a_model_class_defined_in_python_c_with_two_devices_is_one_line_before_any_worker():
    """Spawned workers cannot import a __main__ that has no file (python -c, standard input, a notebook): they
    failed with "worker rank 0 failed: To enable traceback see ..."."""
    import subprocess
    import sys

    code = (
        "import torch.nn as nn, polytrain\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.f = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))\n"
        "    def forward(self, x):\n"
        "        return self.f(x)\n"
        "try:\n"
        "    polytrain.fit(Net(), 'mnist-sample', devices=2, epochs=1, max_steps=2, verbose=False)\n"
        "except polytrain.errors.UserError as error:\n"
        "    print('refused:', error)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == (
        "refused: model= uses Net, defined in the code given to python -c or on standard "
        "input, which the worker processes cannot import; put it in a module file (e.g. "
        "mymodel.py) and import it from there, or use devices=1"
    ), result.stderr[-2000:]


def test_metrics_given_as_keras_names_are_one_line():
    from polytrain.objective import Objective

    with pytest.raises(
        UserError,
        match=r"metrics= takes a dict \{name: fn\(outputs, targets\)\}, not names such as "
        r"Keras's metrics=\['accuracy'\] \(\['acc'\]\): classification reports acc",
    ):
        Objective(metrics=["acc"])
    with pytest.raises(UserError, match="a model that returns its loss does not hand over"):
        Objective(metrics={"top": lambda o, y: o.sum()}, kind="model")


def test_hugging_face_gradient_checkpointing_points_to_activation_checkpointing():
    """Its hooks are local functions that no worker can receive; the fix is polytrain's keyword, not a
    module of the user's own."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=50
    )
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 50, (8, 6))
    tokens = torch.utils.data.StackDataset(input_ids=ids, labels=ids)
    with pytest.warns(FutureWarning):  # (transformers 5 renamed it activation_checkpointing_enable)
        model.gradient_checkpointing_enable()
    for disabled in (False, True):
        with pytest.raises(UserError) as error:
            polytrain.fit(model, train=tokens, val=tokens, devices=2, epochs=1, batch_size=4, verbose=False)
        said = str(error.value)
        assert said.startswith("model= holds the hooks of Hugging Face's gradient_checkpointing_enable()")
        assert said.endswith(
            'pass activation_checkpointing="full" to checkpoint each block on any number of devices'
        )
        assert ("activation_checkpointing_disable() and" in said) is not disabled
        assert "model.disable_input_require_grads()" in said and "def/class" not in said
        with pytest.warns(FutureWarning):
            model.gradient_checkpointing_disable()  # (leaves the input hooks)


def test_a_note_written_with_flags_says_fit_keywords_from_python(capsys):
    import functools

    from polytrain.config.keywords import keyword_words

    assert keyword_words("(--schedule-interval step, or --precision fp32)") == (
        '(schedule_interval="step", or precision="fp32")'
    )
    assert keyword_words("--download to fetch it") == "download=True to fetch it"  # not a value
    scheduler = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1)
    polytrain.fit(
        "mlp", tiny_digits(n_train=64), scheduler=scheduler, optimizer="sgd", epochs=0.5, batch_size=16
    )
    out = capsys.readouterr().out
    assert 'never steps; train a whole epoch, or step it per optimizer step (schedule_interval="step"' in out
    assert "--schedule-interval" not in out


def test_a_step_mixing_a_shard_with_a_plain_tensor_is_told_in_one_line(tmp_path):
    """Under FSDP2 a tensor made from a parameter outside forward (an init_hidden's new_zeros) is a DTensor, which
    torch refuses to mix with the batch's plain tensors: the step says so in one line, naming the fix."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from polytrain.objective import Objective

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Linear(3, 2)
        model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Replicate()]))

        def sequence_first_step(model, batch):
            hidden = next(model.parameters()).new_zeros(2, 3)  # as init_hidden does
            x, _ = batch
            return (torch.mm(x, hidden.t()) ** 2).mean()

        objective = Objective(step=sequence_first_step)
        x, y = torch.randn(4, 3), torch.zeros(4)
        with pytest.raises(
            UserError, match=r"^step=sequence_first_step mixed a plain tensor with a DTensor"
        ) as e:
            objective.compute(model, x, y)
        assert "\n" not in str(e.value) and "torch.zeros(..., device=inputs.device)" in str(e.value)
    finally:
        dist.destroy_process_group()
