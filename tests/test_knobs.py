"""Accumulation, clipping and fp16 loss scaling on one device, against a hand-written PyTorch loop; the
settings' checks; the loss scaler's agreement on overflow."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_digits

import polytrain
from polytrain.config import TrainConfig
from polytrain.config.train import apply_micro_batch_size
from polytrain.errors import ConfigError, UserError
from polytrain.models import build_model
from polytrain.strategies.gradients import Gradients, total_norm


def hand_written(model, data, *, batch_size, lr, clip_norm=None, clip_value=None, fp16=False):
    """One epoch of the loop a user writes: one pass per batch, `clip_grad_norm_` on the whole model, and
    for fp16 autocast with `torch.amp.GradScaler`. Returns each step's norm before clipping and whether
    the scaler skipped it."""
    pixels = data.train_x.double() / 255
    mean, std = pixels.mean().float(), pixels.std().float()
    # (x/255 - mean) / std as one multiply-add, rounded as the loader rounds it: a ReLU or a max-pool tie that a
    # last-bit difference in a pixel flips moves a gradient by far more than rounding (seen on AMD EPYC's oneDNN)
    x_all = torch.addcmul(-mean / std, data.train_x.float(), 1.0 / (255.0 * std))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    scaler = torch.amp.GradScaler("cpu") if fp16 else None
    order = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(0))
    norms, skipped = [], []
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = F.cross_entropy(model(x_all[idx]).float(), data.train_y[idx])
        (scaler.scale(loss) if fp16 else loss).backward()
        if fp16:
            scaler.unscale_(opt)
        if clip_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)))
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        if fp16:
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.get_scale() < scale)
        else:
            opt.step()
    return norms, skipped


def fit_and_reference(data, **knobs):
    torch.manual_seed(0)
    model = build_model("lenet", data.input_shape, 10)
    reference = copy.deepcopy(model)
    hand = {k: v for k, v in knobs.items() if k in ("clip_norm", "clip_value", "fp16")}
    norms, skipped = hand_written(reference, data, batch_size=32, lr=0.05, **hand)
    ours = {
        "clip_grad_norm": knobs.get("clip_norm"),
        "clip_grad_value": knobs.get("clip_value"),
        "precision": "fp16" if knobs.get("fp16") else "fp32",
        "accumulate": knobs.get("accumulate", 1),
    }
    # channels_last=False: the hand-written loop runs the default memory format, and fp16 rounds the two apart
    history = polytrain.fit(
        model,
        data,
        epochs=1,
        batch_size=32,
        lr=0.05,
        schedule="constant",
        warmup_epochs=0,
        device="cpu",
        verbose=False,
        channels_last=False,
        **{k: v for k, v in ours.items() if v is not None},
    )
    return model, reference, history, norms, skipped


def assert_same_weights(model, reference, atol):
    for (name, ours), theirs in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(ours, theirs, atol=atol, rtol=0, msg=name)


def test_accumulating_four_passes_trains_the_weights_of_one_pass():
    data = tiny_digits(n_train=160)
    model, reference, history, _, _ = fit_and_reference(data, accumulate=4)
    assert_same_weights(model, reference, 1e-6)


def test_clipping_by_norm_equals_clip_grad_norm_on_the_whole_model_and_reports_its_figures():
    data = tiny_digits(n_train=160)
    model, reference, history, norms, _ = fit_and_reference(data, clip_norm=0.5, accumulate=2)
    assert_same_weights(model, reference, 1e-6)
    record = history.last
    assert record["grad_norm_mean"] == pytest.approx(sum(norms) / len(norms), rel=1e-5)
    assert record["grad_norm_max"] == pytest.approx(max(norms), rel=1e-5)
    assert record["clipped_steps"] == sum(n > 0.5 for n in norms) > 0
    assert "clipped" in record["note"]


def test_clipping_by_value_equals_clip_grad_value():
    data = tiny_digits(n_train=96)
    model, reference, _, _, _ = fit_and_reference(data, clip_value=0.01)
    assert_same_weights(model, reference, 1e-6)


def test_fp16_loss_scaling_equals_autocast_with_grad_scaler_and_counts_skipped_steps():
    data = tiny_digits(n_train=160)
    model, reference, history, _, skipped = fit_and_reference(data, fp16=True)
    assert_same_weights(model, reference, 1e-5)
    assert history.last["skipped_steps"] == sum(skipped)
    assert history.last["loss_scale"] > 0


def test_an_overflow_skips_the_step_and_halves_the_scale():
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    gradients = Gradients(device=torch.device("cpu"), fp16=True, clip_norm=1.0)
    scale = gradients.scaler.get_scale()
    weight.grad = torch.tensor([1.0, float("inf"), 0.0])
    gradients.step(optimizer, [weight])
    assert torch.equal(weight.detach(), torch.ones(3))
    assert gradients.scaler.get_scale() == scale / 2
    weight.grad = torch.tensor([3.0, 4.0, 0.0]) * gradients.scaler.get_scale()  # a scaled gradient
    gradients.step(optimizer, [weight])
    torch.testing.assert_close(
        weight.detach(), torch.ones(3) - 0.1 * torch.tensor([0.6, 0.8, 0.0]), atol=1e-5, rtol=0
    )
    figures = gradients.epoch_figures()
    assert figures["skipped_steps"] == 1 and figures["clipped_steps"] == 1
    assert figures["grad_norm_mean"] == pytest.approx(5.0) and figures["grad_norm_max"] == pytest.approx(5.0)


def test_the_global_norm_of_parts_is_the_norm_of_the_whole():
    grads = [torch.randn(5), torch.randn(3, 2), torch.randn(7)]
    parts = [total_norm(grads[:1]), total_norm(grads[1:])]
    whole = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    torch.testing.assert_close(torch.stack(parts).square().sum().sqrt(), whole)
    # clipping each part by its own norm (stage-locally) is not clipping the whole
    assert not torch.allclose(torch.stack(parts).clamp(max=1.0).square().sum().sqrt(), whole.clamp(max=1.0))


@pytest.mark.parametrize(
    "values, micro, expected",
    [
        ({}, 16, {"accumulate": 4}),
        ({"devices": 2, "strategy": "data"}, 8, {"accumulate": 4}),
        ({"devices": 2, "strategy": "pipeline"}, 16, {"microbatches": 4}),
        ({"devices": 2, "strategy": "pipeline", "microbatches": 2}, 16, {"accumulate": 2}),
    ],
)
def test_micro_batch_size_is_another_way_to_say_accumulate(values, micro, expected):
    values = dict(values)
    apply_micro_batch_size(values, micro)
    assert {key: values[key] for key in expected} == expected


@pytest.mark.parametrize(
    "values, micro, words",
    [
        ({}, 48, "does not divide the 64 samples"),
        ({"accumulate": 2}, 16, "means --accumulate 4"),
        ({}, 0, "must be a positive whole number"),
    ],
)
def test_micro_batch_sizes_that_do_not_multiply_out_are_one_line(values, micro, words):
    with pytest.raises(ConfigError, match=words):
        apply_micro_batch_size(dict(values), micro)


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"accumulate": 65}, "more passes than the 64 samples"),
        ({"clip_grad_norm": 1.0, "clip_grad_value": 1.0}, "not both"),
        ({"clip_grad_norm": 0.0}, "would zero every gradient"),
        ({"clip_grad_norm": -1.0}, "--clip-grad-norm must be a finite number >= 0"),
        (
            {"strategy": "parameter-server", "devices": 2, "staleness": 1, "precision": "fp16"},
            "drop --staleness",
        ),
    ],
)
def test_knob_mistakes_are_one_line(settings, words):
    with pytest.raises(ConfigError, match=words):
        TrainConfig(**settings)


def test_fit_names_lightning_and_hugging_face_spellings():
    for foreign, ours in (
        ("accumulate_grad_batches", "accumulate="),
        ("gradient_accumulation_steps", "accumulate="),
        ("gradient_clip_val", "clip_grad_norm="),
        ("max_grad_norm", "clip_grad_norm="),
    ):
        with pytest.raises(UserError) as error:
            polytrain.fit("lenet", "mnist-sample", **{foreign: 2})
        assert ours in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(UserError, match="batch per optimizer step"):
        polytrain.fit("lenet", "mnist-sample", accumulate_grad_batches=2)


def test_a_resume_may_change_the_accumulation_and_continues_the_same_training(tmp_path):
    data = tiny_digits(n_train=160)
    settings = dict(
        epochs=2, batch_size=32, lr=0.05, clip_grad_norm=0.5, precision="fp16", device="cpu", verbose=False
    )
    torch.manual_seed(0)
    straight = build_model("lenet", data.input_shape, 10)
    stopped, resumed = copy.deepcopy(straight), copy.deepcopy(straight)
    polytrain.fit(straight, data, **settings)
    polytrain.fit(stopped, data, out=str(tmp_path / "run"), max_steps=7, **settings)  # epoch 2, step 2
    polytrain.fit(resumed, data, resume=str(tmp_path / "run"), accumulate=4, **settings)
    assert_same_weights(resumed, straight, 1e-5)


def test_fp16_with_parameters_that_got_no_gradient_steps_without_them():
    frozen, used = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([frozen], lr=0.1)  # e.g. a pipeline stage of frozen layers
    gradients = Gradients(device=torch.device("cpu"), fp16=True, clip_norm=1.0)
    scale = gradients.scaler.get_scale()
    gradients.step(optimizer, [frozen])
    assert torch.equal(frozen.detach(), torch.ones(2)) and gradients.scaler.get_scale() == scale
    assert used.grad is None


def test_the_epochs_figures_and_the_scale_survive_a_checkpoint():
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    before = Gradients(device=torch.device("cpu"), fp16=True, clip_norm=0.1)
    for grad in ([float("inf"), 1.0], [3.0, 4.0]):
        weight.grad = torch.tensor(grad) * before.scaler.get_scale()
        before.step(optimizer, [weight])
    after = Gradients(device=torch.device("cpu"), fp16=True, clip_norm=0.1)
    after.load_state_dict(before.state_dict())
    assert after.scaler.get_scale() == before.scaler.get_scale()
    assert after.epoch_figures() == before.epoch_figures()


@pytest.mark.parametrize(
    "metric, mode",
    [
        ("val_loss", "min"),
        ("val_mae", "min"),
        ("val_rmse", "min"),
        ("val_perplexity", "min"),
        ("val_acc", "max"),
        ("val_f1", "max"),
    ],
)
def test_the_monitor_minimises_losses_and_errors_and_maximises_scores(metric, mode):
    from polytrain.callbacks import monitor_mode

    assert monitor_mode(metric) == mode


@pytest.mark.parametrize(
    "settings, words",
    [
        (dict(optimizer="adamw", momentum=0.5), "momentum= does not apply to AdamW"),
        (
            dict(schedule="steplr", schedule_args="step_size=1", warmup_epochs=1.0),
            "warmup_epochs= belongs to",
        ),
        (dict(strategy="pipeline", devices=2, accumulate=3), "accumulate=3 runs 8 x 3 = 24 micro-batches"),
    ],
)
def test_settings_the_optimizer_schedule_or_pipeline_would_not_honour_are_one_line(settings, words):
    with pytest.raises(UserError, match=words) as error:
        polytrain.fit("lenet", "mnist-sample", verbose=False, **settings)
    assert "\n" not in str(error.value)
