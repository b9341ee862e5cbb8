"""A LoRA run's adapters out (`polytrain export RUN --format peft`), and merged into its base (`--format hf
--merge`).

--format peft writes the folder Hugging Face's `peft` reads, `PeftModel.from_pretrained(base, folder)` with
`base` the Hugging Face model the run started from (--init-from): `adapter_config.json` (peft's own
`LoraConfig.save_pretrained`: rank, alpha, dropout, the adapted modules by their Hugging Face names, GPT-2's
Conv1D layers marked `fan_in_fan_out`) and `adapter_model.safetensors`, each adapter matrix under the name peft
gives it on that model (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`: the layer's Hugging
Face name, models/llama_hf.py and models/gpt.py `hf_names`). The matrices are stored as the run holds them: a
LoRA layer's A and B have the same orientation on a Linear and on GPT-2's Conv1D (peft transposes the product).

--merge (runtime/export.py `export_hf`, `merged_reader`) writes each adapted layer's weight as W + (alpha / R) B A,
the checkpoint `AutoModelForCausalLM` loads without peft.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..errors import UserError
from ..models.classifier import HEAD as CLASSIFIER_HEAD
from ..models.lora import ADAPTER, DEFAULT_ALPHA
from .export import HF_MODELS, _model_of_run, _sources, adapted_layers, default_out

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the base model's own names


def export_peft(
    run_dir, *, out=None, weights: str = "final", merge: bool = False, max_shard_size=None
) -> tuple:
    """The adapters of a --lora run of --model llama or gpt as a peft folder (see the module's docstring), in
    `out` (default RUN/peft, RUN/peft-best); `merge` is refused (it writes --format hf), `max_shard_size`
    unused (the adapters are one small file). Returns (folder, tensors, bytes)."""
    from safetensors.torch import save_file

    from ..models import gpt, llama_hf
    from ..run_dir import read_config
    from .inference import weights_file

    run_dir = Path(run_dir)
    if merge:
        raise UserError("--merge writes a Hugging Face checkpoint; add --format hf (not peft)")
    out = out or default_out(run_dir, weights, "peft")
    settings = read_config(run_dir)
    model = settings.get("model")
    if not settings.get("lora"):
        raise UserError(
            f"--format peft writes the adapters of a --lora run, and {run_dir} trained every parameter; export "
            f"it with --format hf"
        )
    if settings.get("custom_model") or model not in HF_MODELS:
        raise UserError(
            f"--format peft writes the adapters of a --model llama or gpt language model or sequence classifier, "
            f"for peft to load onto its Hugging Face checkpoint; {run_dir} is not one: export it with --format "
            f"safetensors"
        )
    classifier = bool(settings.get("classifies_texts"))
    listing, read = _sources(weights_file(run_dir, weights))
    built = _model_of_run(run_dir, settings, listing)
    names = (llama_hf if model == "llama" else gpt).hf_names(built)
    tensors, modules = {}, []
    for layer in adapted_layers(listing):
        theirs = names[f"{layer}.weight"].removesuffix(".weight")
        modules.append(theirs)
        for part in ("lora_A", "lora_B"):
            tensors[f"{PEFT_PREFIX}{theirs}.{part}.weight"] = read(
                f"{layer}.{part}.{ADAPTER}.weight"
            ).contiguous()
    if classifier:  # its score head, trained whole: peft's modules_to_save, under Hugging Face's name
        tensors[f"{PEFT_PREFIX}{CLASSIFIER_HEAD}"] = read(CLASSIFIER_HEAD).contiguous()
    from peft import LoraConfig

    config = LoraConfig(
        r=settings["lora"],
        lora_alpha=settings.get("lora_alpha") or DEFAULT_ALPHA,
        lora_dropout=settings.get("lora_dropout") or 0.0,
        target_modules=modules,
        bias="none",
        task_type="SEQ_CLS" if classifier else "CAUSAL_LM",
        modules_to_save=[CLASSIFIER_HEAD.removesuffix(".weight")] if classifier else None,
        fan_in_fan_out=model == "gpt",  # (GPT-2's Conv1D layers)
        base_model_name_or_path=settings.get("init_from"),
    )
    out = Path(out)
    if out.exists() and not (
        out.is_dir() and {p.name for p in out.iterdir()} <= {ADAPTER_FILE, ADAPTER_CONFIG}
    ):
        raise UserError(
            f"--out {out} exists and holds more than an adapter export; give a new folder, or remove it"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    try:
        save_file(tensors, str(temporary / ADAPTER_FILE), metadata={"format": "pt"})
        config.save_pretrained(str(temporary))
        json.loads((temporary / ADAPTER_CONFIG).read_text())  # (written whole)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(temporary, out)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return out, len(tensors), sum(t.numel() * t.element_size() for t in tensors.values())
