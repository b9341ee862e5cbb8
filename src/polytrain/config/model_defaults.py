"""Settings that belong to one model: its own sizes (`--layers`, ... of --model gpt and llama), refused for the
others, its named shapes (`--size`), and the training recipe a model brings when the user does not give a
setting (a transformer wants AdamW and a cosine schedule, not the image models' SGD). Pure: no torch."""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple

from ..errors import ConfigError
from .declare import flag_name

# model -> the model settings its builder reads
MODEL_OPTIONS: Dict[str, Tuple[str, ...]] = {
    "gpt": ("layers", "heads", "width", "context", "dropout", "vocab_size", "norm_eps", "gelu", "positions"),
    "llama": (
        "size",
        "layers",
        "heads",
        "kv_heads",
        "width",
        "ffn_width",
        "vocab_size",
        "context",
        "rope_theta",
        "tie_embeddings",
        "norm_eps",
        "qkv_bias",
        "head_dim",
        "qk_norm",
        "positions",
        "experts",
        "experts_per_token",
        "shared_experts",
        "moe_every",
        "experts_renormalise",
        "router_aux_loss",
    ),
}
MODEL_SETTINGS = tuple(dict.fromkeys(key for keys in MODEL_OPTIONS.values() for key in keys))

# model -> its named shapes (--size NAME): the sizes each fills where not given. Llama 3's published shapes are
# for planning (built on the meta device); "tiny" trains on a CPU in seconds and is the default.
PRESETS: Dict[str, Dict[str, dict]] = {
    "llama": {
        "tiny": dict(
            layers=4, heads=4, kv_heads=2, width=128, ffn_width=384, context=64, rope_theta=500000.0
        ),
        "8b": dict(
            layers=32,
            heads=32,
            kv_heads=8,
            width=4096,
            ffn_width=14336,
            vocab_size=128256,
            context=8192,
            rope_theta=500000.0,
        ),
        "70b": dict(
            layers=80,
            heads=64,
            kv_heads=8,
            width=8192,
            ffn_width=28672,
            vocab_size=128256,
            context=8192,
            rope_theta=500000.0,
        ),
        "405b": dict(  # Llama 3.1 405B (its config.json: 126 layers, 16384 wide, 128 heads over 8 key/value heads)
            layers=126,
            heads=128,
            kv_heads=8,
            width=16384,
            ffn_width=53248,
            vocab_size=128256,
            context=8192,
            rope_theta=500000.0,
        ),
    },
}

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
# the Llama's recipe is the GPT's; its shape is the tiny preset's, --kv-heads and --ffn-width following the
# --heads and --width given
MODEL_DEFAULTS["llama"] = dict(
    MODEL_DEFAULTS["gpt"],
    **{k: v for k, v in PRESETS["llama"]["tiny"].items() if k not in ("kv_heads", "ffn_width")},
)


def preset(model: str, size: Optional[str]) -> dict:
    """The sizes of model `model`'s shape named `size` ({} for None); one line for a name it does not have."""
    if size is None:
        return {}
    names = PRESETS.get(model, {})
    if size not in names:
        raise ConfigError(f"unknown --size {size!r} for --model {model}; choose one of {', '.join(names)}")
    return dict(names[size])


def derived_sizes(heads, width) -> dict:
    """The Llama's --kv-heads and --ffn-width where not given: half the heads where even (grouped-query
    attention, two query heads per key/value head), and 8/3 of the width rounded up to a multiple of 64
    (SwiGLU's three matrices then hold about what a 4x MLP's two do). Sizes not yet valid derive nothing."""
    sizes = {}
    if isinstance(heads, int) and heads > 0:
        sizes["kv_heads"] = heads // 2 if heads % 2 == 0 else heads
    if isinstance(width, int) and width > 0:
        sizes["ffn_width"] = 64 * -(-8 * width // (3 * 64))
    return sizes


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
        readers = [model for model, keys in MODEL_OPTIONS.items() if unused[0] in keys]
        them = "it" if len(unused) == 1 else "them"
        raise ConfigError(
            f"{', '.join(map(flag_name, unused))} {'applies' if len(unused) == 1 else 'apply'} to the "
            f"{' and '.join(readers)} model{'s' * (len(readers) > 1)} only, not {name or 'your own module'}; "
            f"drop {them}"
        )


class Mixture(NamedTuple):
    """A llama's mixture of experts as its flags give it (models/moe.py)."""

    experts: int
    per_token: int
    shared: int
    renormalise: bool
    every: int
    balance: float  # the load-balancing loss's weight (0: none)


# the one line for a load-balancing loss on traced stages (pipeline/aux_loss.py adds each stage's part where the
# stages are a Sequential's layers)
BALANCE_IN_TRACED_STAGES = (
    "--router-aux-loss is not taken by traced stages (--split-at) yet; split the model's layers with --split "
    "N,M (or the default), or drop --router-aux-loss"
)


def mixture_of(experts, per_token, shared, every, renormalise, balance=None) -> Optional[Mixture]:
    """The `Mixture` of `--experts E --experts-per-token K --shared-experts S --moe-every N --router-aux-loss W`, or
    None without --experts; one line for what does not make a mixture."""
    given = {
        "experts_per_token": per_token,
        "shared_experts": shared,
        "moe_every": every,
        "router_aux_loss": balance,
    }
    if experts is None:
        named = [flag_name(name) for name, value in given.items() if value is not None]
        if named or renormalise is not None:
            first = named[0] if named else "--experts-renormalise"
            raise ConfigError(f"{first} describes a mixture of experts; add --experts E, or drop {first}")
        return None
    per_token = 2 if per_token is None else per_token
    shared, every = (0 if shared is None else shared), (1 if every is None else every)
    for name, value in (("experts", experts), ("experts_per_token", per_token), ("moe_every", every)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{flag_name(name)} must be a positive whole number, got {value!r}")
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
        raise ConfigError(f"--shared-experts must be 0 or a positive whole number, got {shared!r}")
    balance = 0.0 if balance is None else balance
    if not isinstance(balance, (int, float)) or isinstance(balance, bool) or not 0 <= balance < float("inf"):
        raise ConfigError(
            f"--router-aux-loss must be a number of 0 or more, got {balance!r}; Mixtral's is 0.02, Qwen2-MoE's 0.001"
        )
    if experts < 2:
        raise ConfigError(f"--experts {experts}: a mixture needs 2 experts or more; give --experts 2 or more")
    if per_token > experts:
        raise ConfigError(
            f"--experts-per-token {per_token} is more than the {experts} experts; give at most --experts-per-token "
            f"{experts}"
        )
    return Mixture(
        experts, per_token, shared, True if renormalise is None else bool(renormalise), every, float(balance)
    )


# the learning rate a model's recipe takes when --init-from loads trained weights: the recipe's own (3e-3) is for
# weights drawn at random and would undo what the checkpoint learnt; 5e-5 is Hugging Face Trainer's default
FINE_TUNE_LR = 5e-5

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
    own = dict(MODEL_DEFAULTS.get(model, {}), **preset(model, values.get("size")))
    applied = {key: value for key, value in own.items() if key not in given and key not in skipped}
    if values.get("init_from") is not None and "lr" in applied:
        applied["lr"] = FINE_TUNE_LR
    values.update(applied)
    if model == "llama":
        derived = derived_sizes(values.get("heads"), values.get("width"))
        applied.update({key: value for key, value in derived.items() if values.get(key) is None})
        values.update(applied)
    if "optimizer" in given or "optimizer" in applied:  # not polytrain's SGD: its settings do not apply
        for key in OWN_OPTIMIZER_SETTINGS:
            if key not in given and key not in applied:
                values[key] = None
    return applied


def defaults_words(model: str, applied: dict, *, pretrained: bool = False) -> str:
    """The line that says which of a model's own defaults a run uses (`pretrained`: --init-from loads weights,
    and the line says where the learning rate comes from)."""

    def word(key, value):
        if value is True:
            return flag_name(key)
        return f"{flag_name(key)} {','.join(map(str, value)) if isinstance(value, tuple) else value}"

    why = (
        f"; --lr {FINE_TUNE_LR:g} because --init-from loads trained weights (Hugging Face Trainer's default for "
        f"fine-tuning; the model's recipe for random weights is {MODEL_DEFAULTS[model]['lr']:g})"
        if pretrained and applied.get("lr") == FINE_TUNE_LR and model in MODEL_DEFAULTS
        else ""
    )
    return (
        f"--model {model} defaults: {' '.join(word(k, v) for k, v in applied.items())} (give a flag to "
        f"change one{why})"
    )
