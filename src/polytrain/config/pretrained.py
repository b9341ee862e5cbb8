"""--init-from DIR: the model settings a Hugging Face checkpoint folder, or a polytrain run folder, implies, read
from its config.json.

A folder as `save_pretrained` writes it: `config.json`, and the weights in `model.safetensors` or in the
shards that `model.safetensors.index.json` lists. Its `architectures` entry names the polytrain model it
loads into (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM and their mixtures of experts: --model llama; GPT2LMHeadModel: --model gpt; their
*ForSequenceClassification too, whose body and score head a sequence classifier loads), and its config gives that model's sizes: they fill the run's settings (config.json of the run records them), and a
flag that says otherwise is refused in one line, as is a folder that lacks a file it names, or a config key
that asks for something the model does not compute (GPT-2's scale_attn_by_inverse_layer_idx, say). A
polytrain run folder (its config.json records polytrain's version) gives its model and the settings that fix
that model's weights (`RUN_MODEL_SETTINGS`); its final weights (model.pt, or the shards it names) start a new
run: step 0, a new optimizer (--resume continues a run instead). Pure: reads JSON, no torch (the weights are
read by each rank: runtime/pretrained.py).

    polytrain train --init-from ./Qwen2-0.5B --dataset shakespeare --strategy sharded --devices 2
    polytrain train --init-from ./gpt2 --dataset text --data-dir notes.txt --context 256
    polytrain train --init-from runs/pretrain --dataset text --data-dir notes.txt
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Tuple

from ..errors import ConfigError
from .declare import flag_name

# a checkpoint's `architectures` entry -> the polytrain model it loads into
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "GPT2LMHeadModel": "gpt",
    # a sequence classifier's: its body, and its score head where the data has as many classes
    "LlamaForSequenceClassification": "llama",
    "Qwen2ForSequenceClassification": "llama",
    "Qwen3ForSequenceClassification": "llama",
    "GPT2ForSequenceClassification": "gpt",
}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def read_json(path: Path, what: str) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(
            f"--init-from: cannot read {path} ({error.strerror}); give a readable folder"
        ) from None
    except ValueError as error:
        raise ConfigError(
            f"--init-from: {path} is not valid JSON ({error}); restore the {what} from its source"
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"--init-from: {path} holds no JSON object; restore the {what} from its source")
    return value


def weight_files(folder: Path) -> Tuple[Path, ...]:
    """The safetensors files of the checkpoint: those the index names (each must be there), else the single
    model.safetensors; one line for a folder that has neither, or lacks a file its index names."""
    index = folder / INDEX
    if index.is_file():
        weight_map = read_json(index, "index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(
                f"--init-from: {index} has no weight_map; restore it from the checkpoint's source"
            )
        files = tuple(folder / name for name in dict.fromkeys(weight_map.values()))
        for path in files:
            if not path.is_file():
                raise ConfigError(
                    f"--init-from: {path.name}, named by {index}, is missing; copy the whole checkpoint "
                    f"(every shard the index lists) into {folder}"
                )
        return files
    if (folder / SINGLE).is_file():
        return (folder / SINGLE,)
    other = sorted(p.name for p in folder.glob("*.bin")) or sorted(p.name for p in folder.glob("*.pt*"))
    raise ConfigError(
        f"--init-from: {folder} has neither {SINGLE} nor {INDEX}"
        + (f" (it has {other[0]}, which polytrain does not read)" if other else "")
        + "; save the model there with transformers' save_pretrained (safetensors is its default)"
    )


def _rope(config: dict, where: str) -> float:
    """rope_theta, at the top level (transformers 4) or in rope_parameters (5); only unscaled rotary angles."""
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    kind = parameters.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ConfigError(
            f"--init-from: {where} scales its rotary embedding ({kind!r}); polytrain's llama turns the "
            f"positions unscaled (rope_type 'default') only"
        )
    theta = config.get("rope_theta", parameters.get("rope_theta", 10000.0))
    return float(theta)


def _need(config: dict, key: str, where: str):
    if key not in config:
        raise ConfigError(f"--init-from: {where} has no {key!r}; restore it from the checkpoint's source")
    return config[key]


def llama_settings(config: dict, architecture: str, where: str) -> dict:
    """polytrain's llama settings for a LlamaForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM config (Qwen3's
    attention normalises each query and key head: --qk-norm); a head_dim other than hidden_size over the heads
    is --head-dim."""
    heads, width = _need(config, "num_attention_heads", where), _need(config, "hidden_size", where)
    head_dim = config.get("head_dim")
    if head_dim is not None and isinstance(heads, int) and heads > 0 and head_dim * heads == width:
        head_dim = None  # the llama's own default
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"--init-from: {where} has hidden_act {config['hidden_act']!r}; polytrain's llama has a SwiGLU "
            f"MLP (silu)"
        )
    qwen2, qwen3 = architecture.startswith("Qwen2"), architecture.startswith("Qwen3")
    if not qwen2 and (config.get("attention_bias") or config.get("mlp_bias")):
        which = "attention_bias" if config.get("attention_bias") else "mlp_bias"
        raise ConfigError(
            f"--init-from: {where} has {which} true; polytrain's llama has biases only on q/k/v (as Qwen2's)"
        )
    if (qwen2 or qwen3) and config.get("use_sliding_window"):
        raise ConfigError(
            f"--init-from: {where} has use_sliding_window true; polytrain's llama attends to the whole context"
        )
    return dict(
        model="llama",
        layers=_need(config, "num_hidden_layers", where),
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        width=width,
        ffn_width=_need(config, "intermediate_size", where),
        vocab_size=_need(config, "vocab_size", where),
        rope_theta=_rope(config, where),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=qwen2,
        head_dim=head_dim,
        qk_norm=qwen3,
        positions=config.get("max_position_embeddings"),
    )


# mixtures of experts polytrain's llama computes (models/moe.py): loaded by --init-from, planned from their
# config.json (`polytrain plan --hf-config`)
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


def moe_settings(config: dict, architecture: str, where: str) -> dict:
    """polytrain's llama settings with `--experts` for a MixtralForCausalLM, Qwen2MoeForCausalLM or
    Qwen3MoeForCausalLM config; one line for what the llama's mixture does not compute."""
    qwen = architecture != "MixtralForCausalLM"
    dense_form = {"Qwen2MoeForCausalLM": "Qwen2ForCausalLM", "Qwen3MoeForCausalLM": "Qwen3ForCausalLM"}
    # Qwen2-MoE's q/k/v biases are fixed; Qwen3-MoE's attention_bias is its config's
    dense = (
        dict(config, mlp_bias=False)
        if architecture == "Qwen3MoeForCausalLM"
        else dict(config, attention_bias=False, mlp_bias=False)
    )
    settings = llama_settings(dense, dense_form.get(architecture, "LlamaForCausalLM"), where)
    if config.get("sliding_window") is not None and (not qwen or config.get("use_sliding_window")):
        raise ConfigError(
            f"--init-from: {where} has sliding_window {config['sliding_window']}; polytrain's llama attends to "
            f"the whole context"
        )
    # Hugging Face's models add their load-balancing loss where output_router_logits is set, weighed by
    # router_aux_loss_coef (polytrain's --router-aux-loss)
    if config.get("output_router_logits"):
        settings["router_aux_loss"] = float(config.get("router_aux_loss_coef", 0.001))
    if not qwen:
        return dict(
            settings,
            experts=_need(config, "num_local_experts", where),
            experts_per_token=_need(config, "num_experts_per_tok", where),
        )
    width, every = _need(config, "moe_intermediate_size", where), config.get("decoder_sparse_step", 1)
    if config.get("mlp_only_layers"):
        raise ConfigError(
            f"--init-from: {where} has mlp_only_layers {config['mlp_only_layers']}; polytrain's llama places its "
            f"mixtures every --moe-every blocks only"
        )
    if every > 1 and settings["ffn_width"] != width:
        raise ConfigError(
            f"--init-from: {where} has dense blocks of intermediate_size {settings['ffn_width']} beside experts of "
            f"{width}; polytrain's llama gives both --ffn-width"
        )
    shared = config.get("shared_expert_intermediate_size") or 0
    if shared % width:
        raise ConfigError(
            f"--init-from: {where} has a shared expert of {shared}, not a multiple of the experts' {width} "
            f"(polytrain's --shared-experts S is S times their width)"
        )
    return dict(
        settings,
        ffn_width=width,
        # Qwen3-MoE's hub configs say num_experts, and transformers 5 writes it as num_local_experts
        experts=config["num_experts"]
        if "num_experts" in config
        else _need(config, "num_local_experts", where),
        experts_per_token=_need(config, "num_experts_per_tok", where),
        shared_experts=shared // width,
        moe_every=every,
        experts_renormalise=bool(config.get("norm_topk_prob", False)),
    )


def gpt2_settings(config: dict, where: str) -> dict:
    """polytrain's gpt settings for a GPT2LMHeadModel config: its sizes, n_positions as the table of positions
    (--positions; the run's --context may be shorter), layer_norm_epsilon, and the GELU its activation_function
    names. A key that asks for what the GPT does not compute is refused, naming the key."""
    width = _need(config, "n_embd", where)
    inner = config.get("n_inner")
    if inner is not None and isinstance(width, int) and inner != 4 * width:
        raise ConfigError(
            f"--init-from: {where} has n_inner {inner}; polytrain's gpt has an MLP 4 times its width "
            f"(n_inner {4 * width} or null)"
        )
    activation = config.get("activation_function", "gelu_new")
    if activation not in GPT2_GELUS:
        raise ConfigError(
            f"--init-from: {where} has activation_function {activation!r}; polytrain's gpt computes "
            f"{', '.join(GPT2_GELUS)}"
        )
    for key, value in GPT2_FIXED.items():
        if bool(config.get(key, value)) != value:
            raise ConfigError(
                f"--init-from: {where} has {key} {str(not value).lower()}; polytrain's gpt is built with "
                f"{key} {str(value).lower()} only"
            )
    return dict(
        model="gpt",
        layers=_need(config, "n_layer", where),
        heads=_need(config, "n_head", where),
        width=width,
        vocab_size=_need(config, "vocab_size", where),
        positions=_need(config, "n_positions", where),
        norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        gelu=GPT2_GELUS[activation],
    )


# GPT-2's activation_function values polytrain's gpt computes -> its --gelu (transformers' "gelu" is exact,
# "gelu_new" and "gelu_pytorch_tanh" the tanh approximation)
GPT2_GELUS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "exact"}
# GPT-2 config keys whose other value polytrain's gpt does not compute -> the value it does
GPT2_FIXED = dict(
    scale_attn_weights=True,
    scale_attn_by_inverse_layer_idx=False,
    reorder_and_upcast_attn=False,
    add_cross_attention=False,
    tie_word_embeddings=True,
)


# the config.json key each setting comes from, for the words of a refusal
CONFIG_KEYS = dict(
    layers="num_hidden_layers",
    heads="num_attention_heads",
    kv_heads="num_key_value_heads",
    width="hidden_size",
    ffn_width="intermediate_size",
    vocab_size="vocab_size",
    rope_theta="rope_theta",
    norm_eps="rms_norm_eps",
    tie_embeddings="tie_word_embeddings",
    qkv_bias="q/k/v biases",
    head_dim="head_dim",
    qk_norm="q/k norms",
    positions="max_position_embeddings",
)
GPT2_CONFIG_KEYS = dict(
    layers="n_layer",
    heads="n_head",
    width="n_embd",
    vocab_size="vocab_size",
    positions="n_positions",
    norm_eps="layer_norm_epsilon",
    gelu="activation_function, as --gelu",
)


# the settings of a polytrain run that fix its model's weights and what they compute (--init-from RUN): those a
# Hugging Face config gives; the GPT's table of positions is --positions, or --context where that was not given
RUN_MODEL_SETTINGS = {"llama": tuple(CONFIG_KEYS), "gpt": tuple(GPT2_CONFIG_KEYS)}


def is_run_folder(folder) -> bool:
    """Whether `folder` holds a polytrain run (its config.json records polytrain's version), not a checkpoint
    of Hugging Face's."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "polytrain" in (config.get("versions") or {})


def run_settings(folder: Path) -> dict:
    """The model and its weight-fixing settings of the polytrain run in `folder`, as its config.json records
    them; one line for a run of a model of the user's, or one that has saved no weights."""
    config = read_json(folder / "config.json", "run's config")
    model = config.get("model")
    if config.get("custom_model") or not isinstance(model, str):
        raise ConfigError(
            f"--init-from: {folder} trained a model of its own ({model}); load its model.pt into that module "
            f"in Python (torch.load, load_state_dict) before fit"
        )
    if not (folder / "model.pt").is_file():
        raise ConfigError(
            f"--init-from: {folder} has no model.pt (it saved no weights); give a run that has trained, or "
            f"continue this one with --resume {folder}"
        )
    settings = dict(model=model, **{key: config.get(key) for key in RUN_MODEL_SETTINGS.get(model, ())})
    if model == "gpt" and settings["positions"] is None:
        settings["positions"] = config.get("context")
    return settings


def checkpoint_settings(folder) -> dict:
    """The run settings the checkpoint folder implies (`model` and its sizes), after checking that the files
    it names are there; one line for anything missing or not a model polytrain has."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(
            f"--init-from: {folder} is not a folder; give the folder that holds the checkpoint's "
            f"config.json and model.safetensors"
        )
    if is_run_folder(folder):
        return run_settings(folder)
    where = folder / "config.json"
    if not where.is_file():
        raise ConfigError(f"--init-from: {folder} has no config.json; give a folder save_pretrained wrote")
    config = read_json(where, "config")
    named = config.get("architectures") or []
    if not any(name in ARCHITECTURES or name in MOE_ARCHITECTURES for name in named):
        raise ConfigError(
            f"--init-from: {where} names architecture {', '.join(map(str, named)) or '(none)'}, which polytrain "
            f"cannot load; it loads {', '.join([*ARCHITECTURES, *MOE_ARCHITECTURES])}"
        )
    weight_files(folder)
    return architecture_settings(config, where)


def architecture_settings(config: dict, where) -> dict:
    """polytrain's model and sizes for a Hugging Face config.json of an architecture it builds (`ARCHITECTURES`,
    `MOE_ARCHITECTURES`; the first its `architectures` names); one line, naming `where`, for what it does not
    compute."""
    known = [
        name
        for name in config.get("architectures") or []
        if name in ARCHITECTURES or name in MOE_ARCHITECTURES
    ]
    if known[0] in MOE_ARCHITECTURES:
        return moe_settings(config, known[0], where)
    if ARCHITECTURES[known[0]] == "gpt":
        return gpt2_settings(config, where)
    return llama_settings(config, known[0], where)


def apply_checkpoint(values: dict, given, model: Optional[str] = None) -> Tuple[str, set]:
    """With `init_from` in `values`: fill them with the checkpoint's model and sizes; returns (the model's
    name, the names now set). A setting in `given` (or `model`, the model named) that contradicts the
    checkpoint is one line. Without `init_from`, (`model`, `given`) as they were."""
    folder = values.get("init_from")
    given = set(given)
    if folder is None:
        return model, given
    settings = checkpoint_settings(folder)
    run = is_run_folder(folder)
    fix = (
        f"drop it: --init-from takes the model and its sizes from the {'run' if run else 'checkpoint'}'s "
        f"config.json"
    )
    if model is not None and model != settings["model"]:
        raise ConfigError(f"--model {model}: {folder} holds a {settings['model']} model; {fix}")
    if values.get("size") is not None:
        raise ConfigError(f"--size {values['size']} names a shape of its own; {fix}")
    for key, value in settings.items():
        if key != "model" and key in given and values.get(key) is not None and values[key] != value:
            source = (
                f"{key}: {'null, the default' if value is None else value}"
                if run
                else (f"{(GPT2_CONFIG_KEYS if settings['model'] == 'gpt' else CONFIG_KEYS)[key]}: {value}")
            )
            grow = (
                "polytrain does not grow a checkpoint's vocabulary for added tokens (their embedding and head "
                "rows would start untrained); tokenize with the checkpoint's own tokenizer (polytrain tokenize "
                f"FILES --tokenizer {folder} --out DIR) and drop --vocab-size"
                if key == "vocab_size" and value is not None and values[key] > value
                else fix
            )
            raise ConfigError(
                f"{flag_name(key)} {values[key]} contradicts {Path(folder) / 'config.json'} ({source}); {grow}"
            )
    values.update(settings)
    return settings["model"], given | set(settings)
