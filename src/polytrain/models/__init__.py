"""Models by name. Each builder takes the dataset's input shape ((C, H, W) for images, (context,) for text) and
number of classes (the vocabulary size for text), plus the model's own settings (`MODEL_OPTIONS`).

The names are declared in config/registry_names.py (the command line reads them without importing torch);
`MODELS` maps them to builders and is checked against them at import."""

from __future__ import annotations

import copy
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn

from ..config.model_defaults import MODEL_OPTIONS, model_options_of
from ..config.registry_names import MODEL_NAMES, TEXT_MODELS, check_registry
from ..errors import UserError, first_line
from ..parallel.meta import on_meta
from .cifar_cnn import CifarCNN
from .classifier import sequence_classifier
from .gpt import build_gpt
from .lenet import LeNet, LeNet5
from .llama import build_llama
from .lora import adapters_of, add_adapters
from .mlp import MLP
from .resnet import ResNet20

MODELS: Dict[str, Callable[[Tuple[int, int, int], int], nn.Module]] = {
    "lenet": LeNet,
    "lenet5": LeNet5,
    "mlp": MLP,
    "cifar-cnn": CifarCNN,
    "resnet": ResNet20,
    "gpt": build_gpt,
    "llama": build_llama,
}
check_registry("model", MODELS, MODEL_NAMES)
CLASSIFIES_TEXTS = ("gpt", "llama")  # the models that classify whole texts with a score head (classifier.py)


def build_model(
    name: str,
    input_shape: Tuple[int, ...],
    num_classes: int,
    options: Optional[dict] = None,
    *,
    vocabulary: Optional[int] = None,
) -> nn.Module:
    """The registry's model `name`; `options` (a TrainConfig or a dict) gives its own settings (`--layers`, ...
    of --model gpt and llama), refused in one line for a model that does not read them. `vocabulary`: the data
    is texts with a class each (a dataset's `sequence_vocabulary`, its tokens), and the model a sequence
    classifier of `num_classes` classes (models/classifier.py). With --lora in `options` the model gets its LoRA
    adapters (models/lora.py)."""
    model = _build(name, input_shape, num_classes, options, vocabulary=vocabulary)
    adapters = adapters_of(options)  # --lora: the same adapters wherever a run's model is built
    return add_adapters(model, **adapters) if adapters else model


def _build(name, input_shape, num_classes, options, *, vocabulary) -> nn.Module:
    if name not in MODELS:
        raise UserError(f"unknown --model {name!r}; choose one of {', '.join(MODELS)}")
    if vocabulary is not None:
        if name not in CLASSIFIES_TEXTS:
            raise UserError(
                f"--model {name} cannot classify texts, and this dataset is texts with a class each (a sequence "
                f"classifier's data); use --model {' or '.join(CLASSIFIES_TEXTS)}, which then score each text's "
                f"last token"
            )
        body = MODELS[name](tuple(input_shape), vocabulary, **model_options_of(name, options))
        return sequence_classifier(body, num_classes)
    if len(input_shape) == 1 and name not in TEXT_MODELS:
        raise UserError(
            f"--model {name} reads images, and this dataset is text (windows of {input_shape[0]} "
            f"token ids); use --model gpt or llama"
        )
    return MODELS[name](tuple(input_shape), num_classes, **model_options_of(name, options))


def build_model_on_meta(
    name: str,
    input_shape: Tuple[int, ...],
    num_classes: int,
    options: Optional[dict] = None,
    *,
    vocabulary: Optional[int] = None,
) -> nn.Module:
    """`build_model` under `torch.device("meta")`: its shapes without storage (meta.py gives it values)."""
    return on_meta(lambda: build_model(name, input_shape, num_classes, options, vocabulary=vocabulary))


def text_vocabulary(dataset) -> Optional[int]:
    """`build_model`'s `vocabulary` for `dataset`: its tokens where it is texts with a class each, else None."""
    return getattr(dataset, "sequence_vocabulary", None)


def call_model(model, x):
    """The model on a batch's inputs: a dict as keyword arguments, a tuple or list as positional ones."""
    if isinstance(x, dict):
        return model(**x)
    if isinstance(x, (tuple, list)):
        return model(*x)
    return model(x)


def first_output(output):
    """A model's outputs for the loss: a tuple's first tensor (nanoGPT's (logits, loss) called without
    targets, whose loss is None), else the output itself."""
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return output


@torch.no_grad()
def run_on_sample(model: nn.Module, x, what: str):
    """The model on a sample batch `x` (a tensor; a dict as keyword arguments, a tuple as positional ones) in
    eval mode on the model's device (mode restored); one line naming `what` if it fails."""
    from ..data.order import map_tree

    if type(model).forward is nn.Module.forward:
        raise UserError(
            f"{type(model).__name__} has no forward method; define forward(self, x) returning the "
            f"model's outputs"
        )
    if isinstance(x, dict):
        check_keywords(model, x)
    else:
        check_arguments(model, len(x) if isinstance(x, (tuple, list)) else 1)
    first = next(model.parameters(), None)
    if first is not None:
        x = map_tree(
            lambda t: t.to(device=first.device, dtype=first.dtype if t.dtype.is_floating_point else t.dtype),
            x,
        )
    was_training = model.training
    try:
        model.eval()
        return call_model(model, x)
    except Exception as error:  # the user's module on the data: say what went wrong, in one line
        raise UserError(
            f"the model cannot take {what}: {type(error).__name__}: {first_line(error)}; make its "
            f"first layers fit that shape"
        ) from None
    finally:
        model.train(was_training)


def takes_channels_last(model: nn.Module, sample) -> bool:
    """Whether a copy of `model` with channels-last weights gives, on `sample` (4-D images) in channels-last,
    what `model` gives in the default format (to rounding): convolutions run faster so on CPUs and GPUs, and a
    module that flattens with `.view()` fails it and keeps the default format."""
    if not isinstance(sample, torch.Tensor) or sample.dim() != 4 or not sample.is_floating_point():
        return False
    try:
        expected = first_output(run_on_sample(model, sample, "a sample"))
        probe = copy.deepcopy(model).to(memory_format=torch.channels_last).eval()
        first = next(probe.parameters(), None)
        x = sample.to(device=first.device if first is not None else "cpu")
        with torch.no_grad():
            got = first_output(call_model(probe, x.contiguous(memory_format=torch.channels_last)))
        return (
            isinstance(got, torch.Tensor)
            and got.shape == expected.shape
            and torch.allclose(got.float(), expected.float(), rtol=1e-3, atol=1e-4)
        )
    except Exception:  # any failure in either layout: keep the default one
        return False


def check_arguments(model: nn.Module, given: int) -> None:
    """Refuse, in one line, a model whose forward needs more positional arguments than the batch's inputs
    give (`given`): an RNN's `forward(input, hidden)`, called with the input alone."""
    import inspect

    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    needed = [p.name for p in parameters if p.kind in positional and p.default is inspect.Parameter.empty]
    if len(needed) > given:
        raise UserError(
            f"{type(model).__name__}.forward({', '.join(needed)}) needs {len(needed)} arguments and each batch "
            f"gives {given} input{'s' if given > 1 else ''}; pass step=fn(model, batch) that calls the model "
            f"with what it needs and returns the loss"
        )


def check_keywords(model: nn.Module, batch: dict) -> None:
    """Refuse, in one line, a dict batch whose keys the model's forward does not take."""
    import inspect

    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    names = [name for name, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [key for key in batch if key not in names]
    if unknown:
        raise UserError(
            f"the batches are dicts with the key{'s' * (len(unknown) > 1)} {', '.join(unknown)}, which "
            f"{type(model).__name__}.forward({', '.join(names)}) does not take (a dict batch is passed as "
            f"model(**batch)); rename the Dataset's keys to forward's arguments, or pass "
            f"step=fn(model, batch)"
        )


@torch.no_grad()
def check_model_output(model: nn.Module, dataset, *, exact: bool = True) -> Optional[str]:
    """Run `model` on two training images and refuse, in one line, a model that cannot take them or whose
    output does not give one score per class: before any process starts, not as an error deep in a step.
    Returns the line to print where the classes were inferred from the labels and the model gives more."""
    sample = dataset.sample_inputs(2)
    shape = "x".join(map(str, dataset.input_shape))
    output = run_on_sample(model, sample, f"the dataset's {shape} images (C x H x W)")
    needed = int(max(dataset.train_y.max(), dataset.val_y.max())) + 1
    classes = dataset.num_classes if exact else needed
    if not isinstance(output, torch.Tensor) or output.dim() != 2 or output.shape[0] != len(sample):
        got = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise UserError(
            f"the model must return one row of {classes} class scores per image, shape (N, {classes}); "
            f"for {len(sample)} images it returned {got}"
        )
    if output.shape[1] < needed or (exact and output.shape[1] != classes):
        raise UserError(
            f"the model gives {output.shape[1]} outputs per image, but the dataset has {classes} "
            f"classes (labels 0..{classes - 1}); make its last layer give {classes} outputs"
        )
    if output.shape[1] > needed:
        return (
            f"note: the model gives {output.shape[1]} outputs per image, but the labels use only 0..{needed - 1} "
            f"({needed} classes): outputs {needed}..{output.shape[1] - 1} are trained never to be chosen; if the "
            f"data has {needed} classes, make the last layer give {needed} outputs"
        )
    return None


__all__ = [
    "MODEL_OPTIONS",
    "MODELS",
    "build_model",
    "build_model_on_meta",
    "check_model_output",
    "run_on_sample",
    "text_vocabulary",
]
