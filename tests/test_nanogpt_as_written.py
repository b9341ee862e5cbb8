"""nanoGPT's model.py as written: its loss's `targets.view(-1)` on polytrain's token batches, the dataset
`polytrain.load_dataset("shakespeare")` returns given to fit, and a tensor plan its attention cannot run on
(`self.c_attn(x).split(self.n_embd, dim=2)` on a rank's third of q, k and v) refused before any worker."""

import pytest
import torch
from nanogpt_model import NanoGPT

import polytrain
from polytrain.config import TrainConfig
from polytrain.errors import ConfigError
from polytrain.models import build_model
from polytrain.strategy_registry import STRATEGIES

NANOGPT_PLAN = {
    "transformer.h.*.attn.c_attn": "colwise:3",
    "transformer.h.*.attn.c_proj": "rowwise",
    "transformer.h.*.mlp.0": "colwise",
    "transformer.h.*.mlp.2": "rowwise",
}


def nanogpt_step(model, batch):
    idx, targets = batch
    _, loss = model(idx, targets)  # F.cross_entropy(logits.view(-1, V), targets.view(-1))
    return loss


def test_nanogpts_own_loss_trains_on_the_dataset_load_dataset_returns():
    data = polytrain.load_dataset("shakespeare", context=8)
    model = NanoGPT(data.num_classes, 8)
    before = model.lm_head.weight.detach().clone()
    polytrain.fit(
        model, data, epochs=1, max_steps=3, batch_size=8, step=nanogpt_step, device="cpu", verbose=False
    )
    assert not torch.equal(model.lm_head.weight, before)


def _tensor_plan(model, data, plan):
    config = TrainConfig(
        devices=2, strategy="tensor", tensor_plan=plan, context=8, device="cpu", dataset="shakespeare"
    )
    return STRATEGIES["tensor"].make_plan(config, model, data, device=torch.device("cpu"))


def test_a_tensor_plan_that_nanogpts_attention_cannot_run_on_is_one_line_before_any_worker():
    data = polytrain.load_dataset("shakespeare", context=8)
    with pytest.raises(ConfigError) as refused:
        _tensor_plan(NanoGPT(data.num_classes, 8), data, NANOGPT_PLAN)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(
        "tensor_plan: NanoGPT's forward fails on the share each of "
        "the 2 ranks holds of transformer.h.0.attn.c_attn (colwise)"
    )
    assert "q, k, v = self.c_attn(x).chunk(3, dim=-1), then view(B, T, -1, head_dim)" in message
    # polytrain's GPT reshapes by heads: the same kind of plan, given as a dict, passes the check
    gpt = build_model("gpt", (8,), data.num_classes, dict(layers=1, heads=2, width=16, context=8))
    plan = _tensor_plan(
        gpt,
        data,
        {
            "*.attention.qkv": "colwise:3",
            "*.attention.proj": "rowwise",
            "*.mlp.0": "colwise",
            "*.mlp.2": "rowwise",
        },
    )
    assert len(plan.styles) == 4
