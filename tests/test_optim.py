import math

import pytest
import torch

from polytrain.optim import lr_factor, make_optimizer, make_scheduler


def test_warmup_rises_linearly_then_onecycle_falls_to_zero():
    factors = [lr_factor(s, total_steps=10, warmup_steps=4, kind="onecycle") for s in range(10)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4:] == pytest.approx([1 - k / 6 for k in range(0, 6)])


def test_cosine_and_constant():
    assert lr_factor(5, total_steps=10, warmup_steps=0, kind="cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_factor(0, total_steps=10, warmup_steps=0, kind="cosine") == 1.0
    assert all(lr_factor(s, total_steps=10, warmup_steps=0, kind="constant") == 1.0 for s in range(10))


def test_scheduler_sets_the_optimizer_learning_rate_per_step():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = make_optimizer([p], name="sgd", lr=0.2, momentum=0.9)
    sched = make_scheduler(opt, kind="onecycle", total_steps=4, warmup_steps=2)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.1, 0.2, 0.2, 0.1])


@pytest.mark.parametrize("name, cls", [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam),
                                       ("rmsprop", torch.optim.RMSprop)])
def test_optimizers_come_from_torch_optim(name, cls):
    opt = make_optimizer([torch.nn.Parameter(torch.zeros(2))], name=name, lr=0.01, weight_decay=1e-4)
    assert isinstance(opt, cls) and opt.defaults["weight_decay"] == 1e-4
