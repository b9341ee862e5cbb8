"""Settings that belong to one model: its own sizes (`--layers`, ... of --model gpt), refused for the others,
and the training recipe a model brings when the user does not give a setting (a transformer wants AdamW and a
cosine schedule, not the image models' SGD). Pure: no torch."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from ..errors import ConfigError

# model -> the model settings its builder reads
MODEL_OPTIONS: Dict[str, Tuple[str, ...]] = {"gpt": ("layers", "heads", "width", "context")}
MODEL_SETTINGS = ("layers", "heads", "width", "context")

# model -> the settings it trains with unless given: recorded in config.json and printed at the start
MODEL_DEFAULTS: Dict[str, dict] = {
    "gpt": dict(
        layers=4,
        heads=4,
        width=128,
        context=64,
        batch_size=8,
        epochs=1,
        optimizer="adamw",
        lr=3e-3,
        betas=(0.9, 0.99),
        weight_decay=0.1,
        no_decay_norms_and_biases=True,
        schedule="cosine",
        warmup_epochs=0.05,
        clip_grad_norm=1.0,
    ),
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def model_options_of(name: str, options) -> dict:
    """The settings of `options` (a TrainConfig, a dict or None) that model `name`'s builder reads; one line
    for a model setting given to a model that does not read it."""
    if options is None:
        return {}
    get = options.get if isinstance(options, dict) else lambda key: getattr(options, key, None)
    values = {key: get(key) for key in MODEL_SETTINGS if get(key) is not None}
    check_model_settings(name, values)
    return {key: value for key, value in values.items() if key in MODEL_OPTIONS.get(name, ())}


def check_model_settings(name: Optional[str], given) -> None:
    """Refuse model settings in `given` (names) that model `name` does not read (`name` None: the user's own
    module, where --context still sets the length of the text windows)."""
    reads = MODEL_OPTIONS.get(name, ()) if name is not None else ("context",)
    unused = [key for key in MODEL_SETTINGS if key in given and key not in reads]
    if unused:
        readers = ", ".join(model for model, keys in MODEL_OPTIONS.items() if unused[0] in keys)
        them = "it" if len(unused) == 1 else "them"
        raise ConfigError(
            f"{', '.join(map(_flag, unused))} {'applies' if len(unused) == 1 else 'apply'} to the "
            f"{readers} model only, not {name or 'your own module'}; drop {them}"
        )


# polytrain's own recipe for its default optimizer (SGD with momentum and weight decay, the settings' defaults):
# an optimizer the user names takes torch's defaults for these instead, wherever they are not given
OWN_OPTIMIZER_SETTINGS = ("lr", "momentum", "weight_decay")


def apply_model_defaults(values: dict, given, model: Optional[str]) -> dict:
    """Fill `values` with model `model`'s own defaults for the settings not in `given`; return what was filled
    (to say so). An optimizer the user names keeps torch's defaults for what is not given (None here: the
    optimizer's own). A model setting given for another model is refused."""
    check_model_settings(model, {key for key in given if values.get(key) is not None})
    # a recipe's optimizer settings belong to its optimizer, its warm-up to its schedule: another one given
    # takes its own defaults
    tied = {
        "optimizer": ("optimizer", "lr", "betas", "weight_decay", "no_decay_norms_and_biases"),
        "schedule": ("schedule", "warmup_epochs"),
    }
    skipped = {key for given_key, keys in tied.items() if given_key in given for key in keys}
    applied = {
        key: value
        for key, value in MODEL_DEFAULTS.get(model, {}).items()
        if key not in given and key not in skipped
    }
    values.update(applied)
    if "optimizer" in given or "optimizer" in applied:  # not polytrain's SGD: its settings do not apply
        for key in OWN_OPTIMIZER_SETTINGS:
            if key not in given and key not in applied:
                values[key] = None
    return applied


def defaults_words(model: str, applied: dict) -> str:
    """The line that says which of a model's own defaults a run uses."""

    def word(key, value):
        if value is True:
            return _flag(key)
        return f"{_flag(key)} {','.join(map(str, value)) if isinstance(value, tuple) else value}"

    return (
        f"--model {model} defaults: {' '.join(word(k, v) for k, v in applied.items())} (give a flag to "
        f"change one)"
    )
