"""Sequence classifiers: polytrain's GPT and Llama with a `score` head in place of the language-model head, as
Hugging Face's `GPT2ForSequenceClassification` and `LlamaForSequenceClassification` are.

    polytrain train --model gpt --dataset hf --data-dir ./sentiment --tokenizer ./tokenizer.json
    polytrain train --init-from ./my-llama --dataset hf --data-dir ./sentiment    (the body loads, a new head)

The model reads token ids (B, T), each row its tokens then `PAD` (-1; data/text_classes.py), runs the
language model's body (embeddings, blocks, final norm) and applies `score`, a Linear(width, K, bias=False), to
the hidden state of each row's last real token; a row without tokens pools position 0, as Hugging Face's do.
Padding is on the right and attention causal, so the pads never reach that token: the result is the
classifier's on the row alone. Out come K class scores per row (B, K), which polytrain's classification
objective trains (cross-entropy, accuracy).

The classifier keeps the language model's layers and their names (`0.token.weight`, `1.attention.qkv.weight`,
...), with `score.weight` for the head (Hugging Face's name), so a language model's weights load into its body
(`--init-from` a checkpoint or a run; runtime/pretrained.py) and the head takes its seeded initial value,
N(0, 0.02) as Hugging Face's `_init_weights`. Its `forward` is its own, so the pipeline, which splits an
nn.Sequential by its layers, refuses it; FSDP2 and DDP wrap it as they wrap the language model.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..data.text_classes import PAD
from ..errors import ConfigError
from .gpt import GPT
from .llama import Llama

HEAD = "score.weight"  # the score head's weight, by its name in Hugging Face's classifiers too
INIT_STD = 0.02  # the score head's initial standard deviation (Hugging Face's initializer_range)


class SequenceClassifier:
    """What a GPT or Llama becomes as a sequence classifier (mixed in before its class): the last layer is
    `score`, and `forward` pools each row's last real token before it."""

    score: nn.Linear
    pools_last_token = True  # (context parallelism, which splits a row over ranks, refuses it)
    LORA_TRAINED = ("score",)  # trained whole beside LoRA adapters (peft's modules_to_save for SEQ_CLS)

    def replace_head(self, classes: int) -> None:
        """The language-model head (the last layer) replaced by `score`, `classes` outputs, no bias."""
        width = self[len(self) - 1].in_features
        del self[len(self) - 1]
        self.score = nn.Linear(width, classes, bias=False)
        self.classes = classes
        nn.init.normal_(self.score.weight, mean=0.0, std=INIT_STD)

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module) -> None:
        if name == "score":
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
        else:
            super().init_module(name, module)

    def start_line(self, weights) -> str:
        """What a run started from `weights` (runtime/pretrained.py: a checkpoint or a run folder) says of its
        heads."""
        if loads_head(self, HEAD, weights.shapes(), weights.folder):
            return f"--init-from {weights.folder}: the body and the score head ({self.classes} classes) load"
        return (
            f"--init-from {weights.folder}: the body loads; the language-model head is left out, and the score "
            f"head ({self.classes} classes) starts from the run's seed (N(0, {INIT_STD}))"
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        real = ids != PAD
        last = (real.sum(1) - 1).clamp(min=0)  # right padding: a row's length less one
        x = ids.masked_fill(~real, 0)
        for layer in list(self._modules.values())[:-1]:
            x = layer(x)
        pooled = x[torch.arange(x.shape[0], device=x.device), last]
        return self.score(pooled)


class GPTClassifier(SequenceClassifier, GPT):
    """polytrain's GPT with a score head (GPT2ForSequenceClassification)."""


class LlamaClassifier(SequenceClassifier, Llama):
    """polytrain's Llama with a score head (LlamaForSequenceClassification)."""


CLASSIFIERS = {GPT: GPTClassifier, Llama: LlamaClassifier}


def sequence_classifier(model: nn.Module, classes: int) -> SequenceClassifier:
    """`model`, a GPT or Llama just built, made its sequence classifier of `classes` classes: the same layers
    and initial values, the head replaced by `score`."""
    model.__class__ = CLASSIFIERS[type(model)]
    model.replace_head(classes)
    return model


def loads_head(model: nn.Module, name: str, stored: dict, folder) -> bool:
    """Whether `model`'s tensor `name` is to be read from a checkpoint of the tensors `stored` (name -> shape):
    every tensor but a sequence classifier's score head, which a language model's checkpoint lacks (it keeps
    its seeded value), and which a classifier's loads where its classes are as many as the data's (else one
    line)."""
    if name != HEAD or not isinstance(model, SequenceClassifier):
        return True
    if HEAD not in stored:
        return False
    if tuple(stored[HEAD]) != tuple(model.score.weight.shape):
        raise ConfigError(
            f"--init-from: {folder} is a classifier of {stored[HEAD][0]} classes (its {HEAD} has shape "
            f"{list(stored[HEAD])}), and the data has {model.classes}; start from its language model, or train on "
            f"data of its classes"
        )
    return True
