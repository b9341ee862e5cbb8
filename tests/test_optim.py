import copy
import math
from functools import partial

import pytest
import torch
import torch.nn as nn

from polytrain.config import TrainConfig
from polytrain.errors import ConfigError, UserError
from polytrain.optim import (
    Recipe,
    lr_factor,
    make_optimizer,
    make_recipe,
    make_scheduler,
    parse_args,
    plan_groups,
    step_per_epoch,
    take_objects,
)
from polytrain.strategies.optimizer_state import (
    load_part,
    numbered_part,
    positions,
    state_slots,
    whole_state,
)


def test_warmup_rises_linearly_then_onecycle_falls_to_zero():
    factors = [lr_factor(s, total_steps=10, warmup_steps=4, kind="onecycle") for s in range(10)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4:] == pytest.approx([1 - k / 6 for k in range(0, 6)])


def test_cosine_and_constant():
    assert lr_factor(5, total_steps=10, warmup_steps=0, kind="cosine") == pytest.approx(
        0.5 * (1 + math.cos(math.pi / 2))
    )
    assert lr_factor(0, total_steps=10, warmup_steps=0, kind="cosine") == 1.0
    assert all(lr_factor(s, total_steps=10, warmup_steps=0, kind="constant") == 1.0 for s in range(10))


def test_scheduler_sets_the_optimizer_learning_rate_per_step():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = make_optimizer([("p", p)], name="sgd", lr=0.2, momentum=0.9)
    sched = make_scheduler(opt, kind="onecycle", total_steps=4, warmup_steps=2)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.1, 0.2, 0.2, 0.1])


@pytest.mark.parametrize(
    "name, cls", [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam), ("rmsprop", torch.optim.RMSprop)]
)
def test_optimizers_come_from_torch_optim(name, cls):
    opt = make_optimizer([("w", torch.nn.Parameter(torch.zeros(2)))], name=name, lr=0.01, weight_decay=1e-4)
    assert isinstance(opt, cls) and opt.defaults["weight_decay"] == 1e-4


# -- any torch.optim class by name, its keyword arguments ---------------------------------------------------


class Small(nn.Module):
    """Weights of 2 and 4 dimensions, biases and a norm's weight and bias (one dimension)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.norm(self.conv(x).flatten(1)[:, :8]))


def small(seed=0) -> Small:
    torch.manual_seed(seed)
    return Small()


def train_steps(model, optimizer, steps=3, seed=1):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(4, 1, 4, 4, generator=generator), torch.randint(0, 3, (4,), generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


@pytest.mark.parametrize(
    "name, cls",
    [
        ("AdamW", torch.optim.AdamW),
        ("ADADELTA", torch.optim.Adadelta),
        ("nadam", torch.optim.NAdam),
        ("r-adam", torch.optim.RAdam),
        ("adagrad", torch.optim.Adagrad),
        ("RMSprop", torch.optim.RMSprop),
    ],
)
def test_any_torch_optimizer_by_name_in_any_case(name, cls):
    config = TrainConfig(optimizer=name, lr=0.01, weight_decay=0.001)
    opt = make_optimizer(
        [("w", nn.Parameter(torch.zeros(2)))],
        name=config.optimizer,
        lr=0.01,
        weight_decay=0.001,
        momentum=config.momentum,
    )
    assert type(opt) is cls and opt.defaults["lr"] == 0.01 and opt.defaults["weight_decay"] == 0.001
    assert opt.defaults.get("foreach") is True  # the multi-tensor kernels on the CPU
    assert ("momentum" in opt.defaults) == (
        cls is torch.optim.RMSprop
    )  # passed only where the class takes it


def test_an_unknown_or_unsuitable_optimizer_is_one_line_with_the_nearest_name():
    with pytest.raises(ConfigError) as error:
        TrainConfig(optimizer="adamx")
    message = str(error.value)
    assert message.startswith("unknown --optimizer 'adamx' (did you mean adam?); choose one of ")
    assert "adamw" in message and "nadam" in message and "\n" not in message
    with pytest.raises(ConfigError, match="LBFGS calls the model again inside step"):
        TrainConfig(optimizer="lbfgs")


def test_keyword_arguments_parse_as_bool_int_float_str_and_tuples():
    assert parse_args("nesterov=true,dampening=0, eps=1e-6,name=abc,betas=0.9,0.95,x=none", "--a") == dict(
        nesterov=True, dampening=0, eps=1e-6, name="abc", betas=(0.9, 0.95), x=None
    )
    assert parse_args({"a": 1}, "--a") == {"a": 1} and parse_args(None, "--a") == {}
    with pytest.raises(ConfigError, match="'oops' is not key=value"):
        parse_args("oops", "--optimizer-args")


def test_betas_eps_and_more_arguments_reach_the_optimizer_or_are_refused_in_one_line():
    config = TrainConfig(optimizer="adamw", betas=(0.8, 0.95), eps=1e-6, optimizer_args="amsgrad=true")
    opt = make_recipe(config).optimizer_factory()([("w", nn.Parameter(torch.zeros(2)))])
    assert (
        opt.defaults["betas"] == (0.8, 0.95)
        and opt.defaults["eps"] == 1e-6
        and opt.defaults["amsgrad"] is True
    )
    sgd = make_recipe(TrainConfig(optimizer="sgd", optimizer_args="nesterov=true")).optimizer_factory()(
        [("w", nn.Parameter(torch.zeros(2)))]
    )
    assert sgd.defaults["nesterov"] is True and sgd.defaults["momentum"] == 0.9
    with pytest.raises(
        ConfigError, match="^--betas does not apply to SGD, which takes no betas; drop --betas$"
    ):
        TrainConfig(optimizer="sgd", betas=(0.9, 0.99))
    with pytest.raises(ConfigError) as error:
        TrainConfig(optimizer="sgd", optimizer_args="nesterof=true")
    assert str(error.value).startswith(
        "--optimizer-args: SGD takes no keyword 'nesterof'; its keywords: lr, "
    )


# -- parameter groups against hand-built torch optimizers -----------------------------------------------------


def test_no_decay_groups_update_like_a_hand_built_adamw():
    ours, theirs = small(), small()
    groups = plan_groups(ours.named_parameters(), no_decay=True)
    assert groups[0] == [{}, {"weight_decay": 0.0}]
    assert [name for name, g in groups[1].items() if g == 1] == [
        "conv.bias",
        "norm.weight",
        "norm.bias",
        "fc.bias",
    ]
    mine = make_optimizer(
        list(ours.named_parameters()), name="adamw", lr=0.01, weight_decay=0.1, groups=groups
    )
    decay = [p for p in theirs.parameters() if p.dim() > 1]
    rest = [p for p in theirs.parameters() if p.dim() <= 1]
    reference = torch.optim.AdamW(
        [{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=0.01, weight_decay=0.1
    )
    train_steps(ours, mine)
    train_steps(theirs, reference)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_adamw_over_fsdp2_shards_on_cpu_is_one_dtensor_operation_per_group(tmp_path):
    """Each DTensor operation works out where its results live, once per operation and list of shards (the first
    step of a 2-rank llama-small spent 200 ms of CPU on it with foreach's ten operations per group, 58 fused, 84
    in torch's own loop over the parameters): the update over FSDP2's shards is one fused operation per group,
    the same AdamW update as the multi-tensor kernels' but for rounding."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    from polytrain.models import build_model
    from polytrain.parallel.fsdp import shard_model

    class DTensorOperations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(kind, DTensor) for kind in types):
                self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    options = dict(layers=2, width=32, heads=4, kv_heads=2, context=8)
    torch.manual_seed(0)
    sharded = build_model("llama", (8,), 65, options)
    whole = copy.deepcopy(sharded)
    shard_model(sharded, mesh=init_device_mesh("cpu", (1,)))
    settings = dict(name="adamw", lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)
    mine = make_optimizer(
        list(sharded.named_parameters()),
        groups=plan_groups(sharded.named_parameters(), no_decay=True),
        **settings,
    )
    reference = make_optimizer(
        list(whole.named_parameters()),
        groups=plan_groups(whole.named_parameters(), no_decay=True),
        **settings,
    )
    assert reference.defaults.get("foreach") is True  # plain tensors on the CPU: the multi-tensor kernels
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        for a, b in zip(sharded.parameters(), whole.parameters()):
            b.grad = torch.randn(b.shape, generator=generator)
            a.grad = DTensor.from_local(b.grad.clone(), a.device_mesh, a.placements)
        counted = DTensorOperations()
        with counted:
            mine.step()
        reference.step()
        update = [name for name in counted.names if name != "zeros_like.default"]  # (the first step's state)
        assert update == ["_fused_adamw_.default"] * 2, counted.names
    for a, b in zip(sharded.parameters(), whole.parameters()):
        torch.testing.assert_close(a.full_tensor(), b, atol=1e-6, rtol=0)


def test_a_param_groups_function_shares_groups_of_equal_options():
    ours, theirs = small(), small()

    def options(name, parameter):
        return (
            {"lr": 0.001}
            if name.startswith("norm")
            else {"weight_decay": 0.0}
            if name.endswith("bias")
            else None
        )

    groups = plan_groups(ours.named_parameters(), options_of=options)
    assert groups[0] == [{}, {"weight_decay": 0.0}, {"lr": 0.001}]
    mine = make_optimizer(
        list(ours.named_parameters()), name="sgd", lr=0.1, momentum=0.9, weight_decay=0.01, groups=groups
    )
    named = dict(theirs.named_parameters())
    reference = torch.optim.SGD(
        [
            {"params": [named["conv.weight"], named["fc.weight"]]},
            {"params": [named["conv.bias"], named["fc.bias"]], "weight_decay": 0.0},
            {"params": [named["norm.weight"], named["norm.bias"]], "lr": 0.001},
        ],
        lr=0.1,
        momentum=0.9,
        weight_decay=0.01,
    )
    train_steps(ours, mine)
    train_steps(theirs, reference)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_a_group_a_rank_does_not_hold_gets_a_placeholder_so_every_rank_has_the_same_groups():
    model = small()
    groups = plan_groups(model.named_parameters(), no_decay=True)
    weights_only = [(n, p) for n, p in model.named_parameters() if p.dim() > 1]
    opt = make_optimizer(weights_only, name="adamw", lr=0.01, groups=groups)
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["weight_decay"] == 0.0
    assert [p.numel() for p in opt.param_groups[1]["params"]] == [0]
    nothing = make_optimizer([("", nn.Parameter(torch.zeros(0)))], name="adamw", lr=0.01, groups=groups)
    assert [[p.numel() for p in g["params"]] for g in nothing.param_groups] == [[0], [0]]


# -- the whole-model numbering of the optimizer state --------------------------------------------------------


def test_state_is_numbered_by_model_position_and_moves_between_splits_of_the_model():
    """One device with two groups -> two 'ranks' (halves of the model, placeholders where a group is missing)
    -> back: the numbering round-trips, and every layout continues with the same updates."""
    one, split, reference = small(), small(), small()
    groups = plan_groups(one.named_parameters(), no_decay=True)
    build = partial(make_optimizer, name="adamw", lr=0.01, weight_decay=0.1, groups=groups)
    whole_opt, ref_opt = build(list(one.named_parameters())), build(list(reference.named_parameters()))
    train_steps(one, whole_opt, steps=2)
    train_steps(reference, ref_opt, steps=2)
    saved = whole_state(whole_opt, [numbered_part(whole_opt, positions(one.parameters()))])
    assert sorted(saved["state"]) == list(range(6))
    assert [g["params"] for g in saved["param_groups"]] == [[0, 4], [1, 2, 3, 5]]  # model order, by group
    assert [g["weight_decay"] for g in saved["param_groups"]] == [0.1, 0.0]
    split.load_state_dict(one.state_dict())
    named = list(split.named_parameters())
    halves = [[0, 1, 2], [3, 4, 5]]  # rank 1 holds norm.bias, fc.weight, fc.bias
    ranks = [build([named[i] for i in half]) for half in halves]
    for opt, half in zip(ranks, halves):
        load_part(opt, saved, positions([named[i][1] for i in half], half))
    parts = [
        numbered_part(opt, positions([named[i][1] for i in half], half)) for opt, half in zip(ranks, halves)
    ]
    merged = whole_state(ranks[0], parts)
    assert [g["params"] for g in merged["param_groups"]] == [[0, 4], [1, 2, 3, 5]]
    for key, state in saved["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(merged["state"][key][name], value, atol=0, rtol=0)

    class Both(torch.optim.Optimizer):  # the two ranks stepping as one
        def __init__(self):
            self.param_groups = []

        def zero_grad(self):
            for opt in ranks:
                opt.zero_grad()

        def step(self):
            for opt in ranks:
                opt.step()

    train_steps(split, Both(), steps=2, seed=5)
    train_steps(reference, ref_opt, steps=2, seed=5)
    for a, b in zip(split.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_one_group_is_numbered_as_torch_numbers_it_so_earlier_checkpoints_load():
    model = small()
    opt = make_optimizer(list(model.named_parameters()), name="adam", lr=0.01)
    train_steps(model, opt, steps=1)
    ours = whole_state(opt, [numbered_part(opt, positions(model.parameters()))])
    torchs = opt.state_dict()
    assert (
        [g["params"] for g in torchs["param_groups"]]
        == [g["params"] for g in ours["param_groups"]]
        == [list(range(6))]
    )
    fresh = small()
    again = make_optimizer(list(fresh.named_parameters()), name="adam", lr=0.01)
    load_part(again, torchs, positions(fresh.parameters()))  # a checkpoint written before groups
    assert again.state_dict()["state"].keys() == torchs["state"].keys()
    with pytest.raises(ValueError, match="1 parameter group"):
        grouped = make_optimizer(
            list(fresh.named_parameters()),
            name="adam",
            lr=0.01,
            groups=plan_groups(fresh.named_parameters(), no_decay=True),
        )
        load_part(grouped, torchs, positions(fresh.parameters()))


@pytest.mark.parametrize(
    "cls, kwargs, slots",
    [
        (torch.optim.SGD, dict(lr=0.1), 0),
        (torch.optim.SGD, dict(lr=0.1, momentum=0.9), 1),
        (torch.optim.AdamW, dict(lr=0.1), 2),
        (torch.optim.RMSprop, dict(lr=0.1, momentum=0.9), 2),
    ],
)
def test_optimizer_state_slots_are_counted_on_a_probe(cls, kwargs, slots):
    assert state_slots(cls, kwargs) == slots


# -- schedules: polytrain's, any lr_scheduler, factories, per step or per epoch ------------------------------


def test_a_torch_scheduler_by_name_with_arguments_steps_per_epoch_by_default():
    recipe = make_recipe(TrainConfig(schedule="StepLR", schedule_args="step_size=1,gamma=0.5", lr=0.2))
    assert recipe.interval == "epoch" and not recipe.per_step
    opt = recipe.optimizer_factory()([("w", nn.Parameter(torch.zeros(2)))])
    scheduler = recipe.scheduler_factory(10)(opt)
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    for _ in range(2):
        opt.step()  # an epoch of steps (no gradients: no change)
        step_per_epoch(scheduler, {"val_loss": 1.0})
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert make_recipe(TrainConfig(schedule="cosine")).interval == "step"
    with pytest.raises(ConfigError, match="^StepLR needs step_size: pass --schedule-args 'step_size=...'$"):
        TrainConfig(schedule="steplr")


def test_reduce_on_plateau_steps_on_the_epochs_validation_loss_and_never_per_step():
    recipe = make_recipe(
        TrainConfig(schedule="reducelronplateau", schedule_args="patience=0,factor=0.5", lr=0.2)
    )
    opt = recipe.optimizer_factory()([("w", nn.Parameter(torch.zeros(2)))])
    scheduler = recipe.scheduler_factory(10)(opt)
    for loss in (1.0, 0.5, 0.7):  # the third epoch is worse: halve
        step_per_epoch(scheduler, {"val_loss": loss})
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="^ReduceLROnPlateau steps once per epoch"):
        TrainConfig(schedule="reducelronplateau", schedule_interval="step")


def lightning_style(optimizer):
    return {"scheduler": torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9), "interval": "step"}


def test_python_objects_are_labelled_checked_and_a_factory_says_its_interval():
    settings = {}
    optimizer, scheduler = take_objects(settings, torch.optim.AdamW, lightning_style)
    assert settings == {"optimizer": "AdamW (from Python)", "schedule": "lightning_style (from Python)"}
    config = TrainConfig(**settings)
    recipe = make_recipe(config, optimizer=optimizer, scheduler=scheduler).checked(small())
    assert recipe.interval == "step" and recipe.optimizer is torch.optim.AdamW
    assert isinstance(
        recipe.scheduler_factory(5)(recipe.optimizer_factory()([("w", nn.Parameter(torch.zeros(2)))])),
        torch.optim.lr_scheduler.ExponentialLR,
    )
    with pytest.raises(UserError, match="pass optimizer= to fit\\(\\) again"):
        make_recipe(config)  # a replayed config.json without the object
    with pytest.raises(
        ConfigError, match="functools.partial\\(torch.optim.lr_scheduler.StepLR, step_size=...\\)"
    ):
        make_recipe(TrainConfig(), scheduler=torch.optim.lr_scheduler.StepLR)
    with pytest.raises(ConfigError, match="^--staleness: "):
        TrainConfig(
            strategy="parameter-server", staleness=1, schedule="exponentiallr", schedule_args="gamma=0.5"
        )
    with pytest.raises(ConfigError, match="^--staleness: "):  # a factory's interval, learnt: epoch
        make_recipe(
            TrainConfig(strategy="parameter-server", staleness=1),
            scheduler=partial(torch.optim.lr_scheduler.ExponentialLR, gamma=0.5),
        ).checked(small(), staleness=1)
    with pytest.raises(UserError, match="^param_groups=: AdamW has no group option 'weight_decy'"):
        make_recipe(
            TrainConfig(), optimizer=torch.optim.AdamW, param_groups=lambda n, p: {"weight_decy": 0}
        ).checked(small())
    factory = Recipe(
        optimizer=lambda params: torch.optim.SGD(params, lr=0.3), schedule="constant", interval="step"
    )
    assert (
        factory.checked(small()).optimizer_factory()([("w", nn.Parameter(torch.zeros(1)))]).defaults["lr"]
        == 0.3
    )


def _built(**settings):
    """The optimizer polytrain builds for a run with these settings (as fit() and the command line resolve
    them), over one parameter."""
    from polytrain.config import TrainConfig
    from polytrain.config.model_defaults import apply_model_defaults
    from polytrain.optim import make_recipe

    values = dict(settings)
    given_object = values.pop("object", None)
    apply_model_defaults(values, set(values), None)
    recipe = make_recipe(TrainConfig(**values), optimizer=given_object)
    return recipe.optimizer_factory()([("w", torch.nn.Parameter(torch.zeros(3)))])


def _defaults(optimizer):
    return {k: v for k, v in optimizer.defaults.items() if k not in ("foreach", "fused")}


@pytest.mark.parametrize(
    "settings, reference",
    [
        # what torch builds from the same words: the user's settings, torch's defaults for the rest
        (dict(optimizer="adamw", lr=1e-3), lambda p: torch.optim.AdamW(p, lr=1e-3)),  # weight decay 0.01
        (dict(optimizer="adadelta"), lambda p: torch.optim.Adadelta(p)),  # weight decay 0
        (dict(optimizer="sgd", lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),  # momentum 0
        (dict(optimizer="rmsprop", weight_decay=0.1), lambda p: torch.optim.RMSprop(p, weight_decay=0.1)),
        # polytrain's own recipe only where no optimizer is named
        (dict(), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=5e-4)),
        (dict(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=5e-4)),
    ],
)
def test_a_named_optimizer_gets_torchs_defaults_for_what_the_user_did_not_give(settings, reference):
    assert _defaults(_built(**settings)) == _defaults(reference([torch.nn.Parameter(torch.zeros(3))]))


def test_an_optimizer_class_from_python_gets_torchs_defaults_too():
    from polytrain.optim import FROM_PYTHON

    built = _built(optimizer="AdamW" + FROM_PYTHON, lr=1e-3, object=torch.optim.AdamW)
    assert built.defaults["weight_decay"] == 0.01 and built.defaults["lr"] == 1e-3


def test_linear_lr_scaling_of_an_optimizers_own_default_lr_is_refused_in_one_line():
    from polytrain.errors import ConfigError

    with pytest.raises(ConfigError, match="--lr-scale linear multiplies --lr by the replicas; give --lr"):
        _built(optimizer="adam", lr_scale="linear")


def test_an_optimizer_factory_over_the_users_own_model_object_is_refused_in_one_line():
    """Each worker trains a copy: an optimizer built over the original object would step nothing that trains
    (the loss stayed flat with no word)."""
    from conftest import tiny_digits

    import polytrain
    from polytrain.errors import UserError

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
    data = tiny_digits(n_train=32, n_val=8)
    with pytest.raises(
        UserError,
        match=r"built its optimizer over 2 tensor\(s\) other than the parameters it was "
        r"given .*optimizer=lambda params: torch.optim.SGD\(params, lr=0.1\)",
    ):
        polytrain.fit(
            model,
            data,
            epochs=1,
            verbose=False,
            optimizer=lambda params: torch.optim.SGD(model.parameters(), lr=0.1),
        )
    before = model[1].weight.detach().clone()
    polytrain.fit(
        model, data, epochs=1, verbose=False, optimizer=lambda params: torch.optim.SGD(params, lr=0.1)
    )
    assert not torch.equal(model[1].weight, before)  # built over its argument, the model trains
