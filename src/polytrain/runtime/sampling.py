"""`polytrain generate`: text sampled from a language model run, decoded with what the run kept: the characters
of a character-level run (`vocab` in its config.json), or the tokenizer of a run on token shards (its
`tokenizer.json`, named under `kept_tokenizer`).

The model reads at most its own window (`model_window`), as transformers' `generate` does on the same weights
(polytrain export --format hf): the GPT's table of positions, or for a llama that started from a Hugging Face
checkpoint (--init-from) that checkpoint's max_position_embeddings, not the --context it was trained on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from ..config import STRATEGY_FLAGS, TrainConfig
from ..errors import UserError
from ..models import build_model
from ..models.gpt import generate
from ..run_dir import read_config
from .checkpoint import load_weights
from .inference import weights_file
from .launch import check_devices
from .worker import choose_device


def generate_text(
    run_dir,
    *,
    prompt: str = "\n",
    tokens: int = 300,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    seed: int = 0,
    device: str = "auto",
    weights: str = "final",
) -> str:
    """The prompt followed by `tokens` characters sampled from the run's model (`temperature` 0: always the
    likeliest; `top_k`: only from the k likeliest), reproducible from `seed`."""
    settings = read_config(run_dir)
    vocab = settings.get("vocab")
    if settings.get("classifies_texts"):
        raise UserError(
            f"{run_dir} is a sequence classifier (--model {settings.get('model')} with a score head), which gives "
            f"a class per text, not text; see its classes with polytrain predict {run_dir}"
        )
    if settings.get("kept_tokenizer") and not settings.get("custom_model"):
        return _generate_tokens(
            run_dir, settings, prompt, tokens, temperature=temperature, top_k=top_k, seed=seed, device=device,
            weights=weights,
        )  # fmt: skip
    if not vocab or settings.get("custom_model"):
        raise UserError(
            f"{run_dir} is a run of --model {settings.get('model')} on --dataset "
            f"{settings.get('dataset')}, not a language model; generate reads runs of --model gpt on "
            f"--dataset shakespeare, text, tokens or hf (with a tokenizer)"
        )
    check_sampling(tokens, temperature, top_k)
    unknown = sorted(set(prompt) - set(vocab))
    if unknown:
        raise UserError(
            f"the prompt holds {''.join(unknown)!r}, not in the {len(vocab)} characters this run "
            f"learnt; use only those (its config.json lists them under 'vocab')"
        )
    if not prompt:
        prompt = "\n" if "\n" in vocab else vocab[0]
    model, dev = _sampling_model(run_dir, settings, len(vocab), device=device, weights=weights)
    window = model_window(settings, model)
    index = {char: i for i, char in enumerate(vocab)}
    idx = torch.tensor([[index[char] for char in prompt]], dtype=torch.long, device=dev)
    generator = torch.Generator(device=dev).manual_seed(seed)
    out = generate(
        model, idx, tokens, temperature=temperature, top_k=top_k, generator=generator, vocabulary=len(vocab),
        window=window,
    )  # fmt: skip
    return prompt + "".join(vocab[i] for i in out[0, idx.shape[1] :].tolist())


def _sampling_model(run_dir, settings, vocabulary: int, *, device: str, weights: str):
    how = ("strategy", *STRATEGY_FLAGS, "logger")
    config = TrainConfig.from_dict({k: v for k, v in settings.items() if k not in how})
    check_devices(1, device)
    dev = choose_device(device, 0)
    model = build_model(config.model, (config.context or 64,), vocabulary, config)
    load_weights(weights_file(run_dir, weights), model)
    return model.to(dev), dev


def _generate_tokens(run_dir, settings, prompt, tokens, *, temperature, top_k, seed, device, weights) -> str:
    """generate for a run on token shards: the prompt encoded and the sample decoded by the run's tokenizer
    (kept in its folder); the default prompt is the end-of-text token, the start of a new document."""
    from ..data import tokenizer as tokenizers_file

    check_sampling(tokens, temperature, top_k)
    tokenizer = tokenizers_file.load(run_dir / settings["kept_tokenizer"]["file"])
    vocabulary = tokenizer.get_vocab_size(with_added_tokens=True)
    model, dev = _sampling_model(run_dir, settings, vocabulary, device=device, weights=weights)
    window = model_window(settings, model)
    ids = (
        [int(settings["kept_tokenizer"]["end_of_text_id"])]
        if prompt in ("", "\n")
        else tokenizer.encode(prompt, add_special_tokens=False).ids
    )
    idx = torch.tensor([ids], dtype=torch.long, device=dev)
    generator = torch.Generator(device=dev).manual_seed(seed)
    out = generate(
        model, idx, tokens, temperature=temperature, top_k=top_k, generator=generator, vocabulary=vocabulary,
        window=window,
    )  # fmt: skip
    return tokenizer.decode(out[0].tolist(), skip_special_tokens=False)


# how many runs of --init-from RUN `model_window` follows back to a Hugging Face checkpoint (a guard against a
# loop of folders that name each other)
SOURCE_HOPS = 16


def model_window(settings: dict, model) -> int:
    """The longest sequence the run's model reads: its `context` (the GPT's table of positions: a GPT-2's
    n_positions, or a llama's --context), or for a llama that started from a Hugging Face checkpoint the
    larger of that and the checkpoint's max_position_embeddings, the window polytrain export --format hf
    writes for it: recorded as the run's --positions, or, for a run made before the llama had them, found
    through --init-from (and the runs it names, for --init-from RUN) where it still is; a checkpoint moved away
    leaves the model's context."""
    window = int(getattr(model, "positions", None) or model.context)
    if settings.get("model") != "llama" or settings.get("positions") is not None:
        return window  # (a llama run records its checkpoint's max_position_embeddings as --positions)
    folder = settings.get("init_from")
    for _ in range(SOURCE_HOPS):
        source = _read_source_config(folder)
        if source is None:
            break
        if not (source.get("versions") or {}).get("polytrain"):
            positions = source.get("max_position_embeddings")
            return max(window, positions) if isinstance(positions, int) and positions > 0 else window
        folder = source.get("init_from")  # a run that started from another run or checkpoint
    return window


def _read_source_config(folder) -> Optional[dict]:
    """The config.json in `folder` (a Hugging Face checkpoint's or a polytrain run's), or None where there is
    none to read."""
    if not folder:
        return None
    try:
        config = json.loads((Path(folder).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def check_sampling(tokens: int, temperature: float, top_k: Optional[int]) -> None:
    if tokens < 0 or temperature < 0 or (top_k is not None and top_k < 1):
        raise UserError(
            f"--tokens and --temperature must be 0 or more and --top-k 1 or more; got --tokens "
            f"{tokens}, --temperature {temperature}, --top-k {top_k}"
        )
