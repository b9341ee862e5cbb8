"""The settings of LoRA fine-tuning (`--lora R` and the flags beside it: models/lora.py), in their own group of
--help. Declared as in settings.py; a run without --lora trains every parameter, as before."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .declare import setting


@dataclass
class LoraSettings:
    lora: Optional[int] = setting(
        None,
        "train rank-R LoRA adapters (Hugging Face peft's layers) beside the frozen weights of the model's attention "
        "and feed-forward projections, instead of the whole model: gradients and optimizer state for the adapters "
        "only (default: off, every parameter trains)",
        group="fine-tuning",
        metavar="R",
        check="count",
        example=8,
    )
    lora_alpha: Optional[float] = setting(
        None,
        "with --lora: the adapters' output is scaled by alpha / R (default: 8, peft's)",
        group="fine-tuning",
        metavar="A",
        check="positive",
        example=16,
    )
    lora_dropout: Optional[float] = setting(
        None,
        "with --lora: dropout on each adapter's input (default: 0, peft's)",
        group="fine-tuning",
        metavar="P",
        check="probability",
        example=0.05,
    )
    lora_targets: Optional[str] = setting(
        None,
        "with --lora: the linear layers that get adapters, comma-separated globs over their one-device names "
        "(e.g. '*.attention.wq,*.attention.wv'; default: the llama's and the GPT's attention and feed-forward "
        "projections; a model of your own needs them)",
        group="fine-tuning",
        metavar="GLOBS",
        example="*.attention.wq,*.attention.wv",
    )
