"""--split-at: a model that is not an nn.Sequential (a GPT written the nanoGPT way, forward(idx, targets=None)
returning (logits, loss)) cut into pipeline stages by torch's tracer, against one device as `polytrain verify`
compares them; and the mistakes refused in one line in the launching process, before any worker starts."""

import copy
import json
import random

import pytest
import torch
from conftest import assert_refused_in_one_line, assert_same_weights
from nanogpt_model import Branchy, NanoGPT, NanoGPTWithAux

import polytrain
from polytrain.config import TrainConfig
from polytrain.data.text import tokenise
from polytrain.errors import ConfigError, UserError
from polytrain.objective import Objective
from polytrain.parallel.presets import layout_of
from polytrain.pipeline.layers import flatten_layers
from polytrain.pipeline.strategy import Pipeline
from polytrain.pipeline.traced import TracedStages, micro_batch_sizes, trace
from polytrain.runtime.launch import run_job
from polytrain.runtime.worker import Job

CONTEXT = 8
TOLERANCE = 1e-5  # polytrain verify's default
CPU = torch.device("cpu")


def tiny_text(characters: int = 260):
    """28 training windows of 8 characters: 3 batches of 8, then a short last batch of 4."""
    chooser = random.Random(0)
    return tokenise(
        "".join(chooser.choice("abcdefghij\n") for _ in range(characters)), name="tiny", context=CONTEXT
    )


def config(**settings) -> TrainConfig:
    values = dict(
        devices=2,
        strategy="pipeline",
        split_at="transformer.h.1",
        microbatches=2,
        batch_size=8,
        epochs=1,
        context=CONTEXT,
        device="cpu",
        seed=0,
        optimizer="sgd",
        lr=0.1,
        schedule="constant",
    )
    return TrainConfig(**dict(values, **settings))


def plan_of(model, **settings):
    return Pipeline.make_plan(config(**settings), model, tiny_text(), device=CPU)


@pytest.mark.multiprocess
def test_a_nanogpt_style_model_split_at_a_block_takes_the_one_device_steps_with_a_short_last_batch():
    """Micro-batches of 4, then the last batch's of 2 (a second trace sharing the first's parameters): every
    step's loss and parameters within verify's tolerance, the weights by the model's own names."""
    data = tiny_text()
    assert data.num_train % 8 == 4
    model = NanoGPT(data.num_classes, CONTEXT)
    settings = config()
    plan = Pipeline.make_plan(settings, model, data, device=CPU)
    assert plan.split_at == ("transformer.h.1",) and plan.micro_batch == 4
    assert plan.record()["stages"][1]["layers"] == ["transformer.h.1", "transformer.ln_f", "lm_head"]
    reference = copy.deepcopy(model)
    reference.pair = False  # the logits alone: what the one-device objective takes
    common = dict(verbose=False, record_steps=True, objective=Objective(kind="language"))
    one = run_job(Job(settings.with_strategy("single", devices=1), "single", data, reference, **common))
    many = run_job(Job(settings, "pipeline", data, copy.deepcopy(model), plan=plan, **common))
    assert len(one.steps) == len(many.steps) == 4
    for (loss_one, params_one), (loss_many, params_many) in zip(one.steps, many.steps):
        assert abs(loss_one - loss_many) <= TOLERANCE
        assert float((params_one - params_many).abs().max()) <= TOLERANCE
    assert list(many.weights) == list(model.state_dict())
    assert_same_weights(many.weights, one.weights, atol=TOLERANCE)
    moved = max(float((many.weights[k] - v).abs().max()) for k, v in model.state_dict().items())
    assert moved > 1e-3
    assert abs(one.history.epochs[0]["val_loss"] - many.history.epochs[0]["val_loss"]) <= TOLERANCE


@pytest.mark.multiprocess
def test_a_traced_run_checkpoints_the_whole_model_and_resumes_on_one_device_as_if_never_stopped(tmp_path):
    """fit(split_at=...) records the split; its checkpoint holds every weight and optimizer slot by the
    model's names, so the run continues on one device (here from step 2 of 4) as one device would have run."""
    text = tmp_path / "tiny.txt"
    chooser = random.Random(0)
    text.write_text("".join(chooser.choice("abcdefghij\n") for _ in range(260)))
    common = dict(
        data_dir=str(text),
        context=CONTEXT,
        epochs=1,
        batch_size=8,
        optimizer="sgd",
        lr=0.1,
        schedule="constant",
        warmup_epochs=0.0,
        device="cpu",
        verbose=False,
    )
    vocab = tiny_text().num_classes
    straight = NanoGPT(vocab, CONTEXT)  # forward(idx) returns (logits, None): fit takes the logits
    polytrain.fit(straight, "text", **common)
    run = tmp_path / "run"
    polytrain.fit(
        NanoGPT(vocab, CONTEXT),
        "text",
        devices=2,
        strategy="pipeline",
        split_at="transformer.h.1",
        microbatches=2,
        max_steps=2,
        out=str(run),
        **common,
    )
    recorded = json.loads((run / "config.json").read_text())
    assert recorded["split_at"] == "transformer.h.1"
    assert recorded["strategy_plan"]["stages"][0]["layers"] == [
        "transformer.wte",
        "transformer.wpe",
        "transformer.h.0",
    ]
    saved = torch.load(run / "checkpoint.pt", weights_only=True)
    assert list(saved["model"]) == list(straight.state_dict()) and saved["position"]["step"] == 2
    resumed = NanoGPT(vocab, CONTEXT)
    polytrain.fit(resumed, "text", resume=str(run), **common)
    assert_same_weights(resumed.state_dict(), straight.state_dict(), atol=TOLERANCE)


def test_an_unknown_module_name_is_refused_with_the_nearest_and_the_valid_names():
    with pytest.raises(ConfigError) as error:
        plan_of(NanoGPT(11, CONTEXT), split_at="blocks.1")
    message = str(error.value)
    assert "\n" not in message
    assert "'blocks.1' is not a module of NanoGPT; did you mean 'transformer.h.1'?" in message
    assert all(name in message for name in ("transformer", "lm_head", "transformer.h.0"))


def test_the_command_line_refuses_an_unknown_name_in_one_line_before_any_worker(capsys, tmp_path):
    argv = [
        "--dataset",
        "synthetic",
        "--synthetic-size",
        "64",
        "--device",
        "cpu",
        "--epochs",
        "1",
        "--model",
        "lenet",
        "--strategy",
        "pipeline",
        "--devices",
        "2",
        "--split-at",
        "12",
    ]
    assert_refused_in_one_line(
        capsys, tmp_path / "run", argv, ["--split-at '12' is not a module of LeNet", "0, 1, 2, 3"]
    )


def test_a_model_with_control_flow_on_tensor_values_is_refused_with_how_to_write_it():
    with pytest.raises(ConfigError) as error:
        plan_of(Branchy(11), split_at="head")
    message = str(error.value)
    assert "\n" not in message and "cannot follow Branchy.forward" in message
    assert "without Python control flow on tensor values" in message and "nn.Sequential" in message


@pytest.mark.parametrize(
    "settings, words",
    [
        (
            dict(split_at="transformer.h.0,transformer.h.1"),
            "names 2 module(s), which makes 3 stages, and the pipeline has 2; name 1 module(s)",
        ),
        (dict(split="1"), "give either --split"),
        (dict(split_at="transformer.h.1,"), "module names separated by commas"),
    ],
)
def test_a_split_that_does_not_fit_the_pipeline_is_refused(settings, words):
    with pytest.raises(ConfigError, match=None) as error:
        plan_of(NanoGPT(11, CONTEXT), **settings)
    assert words in str(error.value)


def test_tied_weights_which_the_tracer_would_copy_per_stage_are_refused():
    with pytest.raises(ConfigError, match=r"transformer.wte.weight and lm_head.weight are one tensor \(tied"):
        plan_of(NanoGPT(11, CONTEXT, tied=True))


def test_the_plan_traces_the_runtime_micro_batch_and_leaves_the_model_as_it_was():
    model = NanoGPT(11, CONTEXT)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = plan_of(model, microbatches=4, batch_size=16)
    assert plan.micro_batch == 4 and plan.input_dtype == "int64" and plan.points == (3,)
    layout = layout_of(
        "pipeline", 2, pipeline_stages=2
    )  # 28 windows: batches of 8 in micro-batches of 4, then 4 in two of 2
    assert micro_batch_sizes(config(), tiny_text(), layout, "1f1b", 2, 8) == [4, 2]
    # a run that stops (--max-steps) within the 3 whole batches never traces the short last one
    assert micro_batch_sizes(config(max_steps=3), tiny_text(), layout, "1f1b", 2, 8) == [4]
    assert micro_batch_sizes(config(max_steps=4), tiny_text(), layout, "1f1b", 2, 8) == [4, 2]
    assert micro_batch_sizes(config(batch_size=7, microbatches=7), tiny_text(), layout, "1f1b", 7, 7) == [1]
    assert "traced, split before modules transformer.h.1" in plan.describe(layout)
    assert "forward" not in vars(model.transformer.h[1])  # the tracer's wrapper is gone
    assert_same_weights(model.state_dict(), before, atol=0)
    out = model(torch.zeros(3, CONTEXT, dtype=torch.long))  # another batch size still runs eagerly
    assert out[0].shape == (3, CONTEXT, 11) and out[1] is None


def test_a_model_that_is_not_sequential_is_pointed_to_split_at():
    with pytest.raises(UserError, match="--split-at"):
        flatten_layers(NanoGPT(11, CONTEXT))


def test_each_micro_batch_size_gets_its_own_trace_over_the_same_parameters():
    """The graph keeps the traced batch size; the short batch's trace runs the very same parameter objects."""
    model = NanoGPT(11, CONTEXT)
    traces = TracedStages(model, plan_of(model), held=(1,), device=CPU)
    four, two = traces.modules(4)[0], traces.modules(2)[0]
    assert four is not two and traces.modules(4)[0] is four
    assert [(n, id(p)) for n, p in four.named_parameters()] == [(n, id(p)) for n, p in two.named_parameters()]
    assert dict(four.named_parameters())["lm_head.weight"] is model.lm_head.weight
    hidden = torch.randn(2, CONTEXT, 16)
    with pytest.raises(RuntimeError):
        four(hidden)
    expected = model.lm_head(model.transformer.ln_f(model.transformer.h[1](hidden)))
    torch.testing.assert_close(two(hidden), expected)


def test_the_last_stage_of_a_model_returning_a_tuple_gives_its_first_element_the_logits():
    model = NanoGPTWithAux(11, CONTEXT)
    pipe = trace(model, ("transformer.h.1",), torch.zeros(2, CONTEXT, dtype=torch.long))
    idx = torch.randint(0, 11, (2, CONTEXT))
    logits = pipe.get_stage_module(1)(pipe.get_stage_module(0)(idx))
    torch.testing.assert_close(logits, model(idx)[0])
