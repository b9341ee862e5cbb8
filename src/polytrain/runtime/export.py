"""`polytrain export RUN`: a run's weights as one file (safetensors or torch's .pt) by the one-device names, or
as a Hugging Face checkpoint folder (--format hf: config.json and safetensors files, for a --model llama or gpt
run).

Weights kept as shards (runtime/shards.py) are read one tensor at a time, from the checkpoint's index. Each
tensor is copied into a scratch file beside the output before the next is read, and the writer (the
safetensors library's `save_file`, or torch.save) is handed views of that file mapped into memory, whose pages
the system can drop at any time: the export holds at most the largest tensor, however large the model, and
polytrain writes no file format of its own. A file or folder appears only when complete.

--format hf names each tensor as transformers' LlamaForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM (or their
mixtures of experts: Mixtral, Qwen2-MoE, Qwen3-MoE) does (models/llama_hf.py
`hf_names`), or GPT2LMHeadModel (models/gpt.py `hf_names`: its Conv1D weights are the transpose of the GPT's
nn.Linear weights, each transposed as it is copied into the scratch file, so that one tensor and its transpose
are the most held; c_attn is the GPT's fused qkv as it is; transformers 5 keeps its causal mask out of the
checkpoint, so no attn.bias is written), writes config.json from the model's own sizes (`hf_config`), and cuts
the weights into files of at most --max-shard-size listed in model.safetensors.index.json, as
`save_pretrained` does. The run's tokenizer goes with it where it has one (a run on token shards, or on text a
tokenizer encodes): tokenizer.json and the checkpoint's tokenizer_config.json, special tokens and chat template,
or a tokenizer_config.json of its own for one trained here; shakespeare's characters have none.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional

import torch

from ..data.tokenizer import COMPANIONS
from ..data.tokenizer import FILE as TOKENIZER
from ..errors import ConfigError, UserError
from ..models.classifier import HEAD as CLASSIFIER_HEAD
from ..models.lora import ADAPTER, DEFAULT_ALPHA, is_adapter, one_device_name
from . import shards
from .checkpoint import safe_load, shard_folder

FORMATS = ("safetensors", "pt")  # one file; "hf" writes a folder (export_hf)
TOKENIZER_CONFIG = "tokenizer_config.json"
# the files of an --format hf folder besides the weights (model*): an export there may be replaced
EXPORTED = ("config.json", TOKENIZER, *COMPANIONS)
# the dtypes of polytrain's weights that safetensors stores
SAFETENSORS_DTYPES = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


def _raw(tensor: torch.Tensor):
    """The tensor's bytes in memory order, without a copy where it is contiguous."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def _sources(path: Path):
    """[(name, shape, dtype)] and a function reading one tensor by name, of a weights file or its shards; a LoRA
    run's base tensors, which its files leave out, read from the base it started from (base_apart.py)."""
    from .base_apart import base_listing, check_base, read_base, read_record

    listing, read = _stored(path)
    record = read_record(Path(path).parent)
    if record is None:
        return listing, read
    check_base(record, Path(path).parent)
    stored = {name for name, _, _ in listing}

    def read_either(name: str) -> torch.Tensor:
        return read(name) if name in stored else read_base(record, {name})[name]

    return base_listing(record) + listing, read_either


def _stored(path: Path):
    """_sources' listing and reader of the tensors a weights file or its shards hold."""
    state = safe_load(path)
    folder = shard_folder(state, path)
    if folder is None:  # a one-file state dict: already whole, read it mapped from the disk
        whole = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        listing = [
            (name, tuple(t.shape), t.dtype) for name, t in whole.items() if isinstance(t, torch.Tensor)
        ]
        return listing, whole.__getitem__
    entries = shards.model_entries(shards.check(folder))
    order = [name for name in state.get("names") or entries if name in entries]
    order += [name for name in entries if name not in order]
    listing = [(name, *entries[name]) for name in order]
    return listing, lambda name: shards.read_tensor(folder, name, *entries[name])


def _aligned(offset: int) -> int:
    return (offset + 7) // 8 * 8


def _layout(listing) -> tuple:
    """Byte ranges of the tensors laid end to end (each start aligned to 8 bytes), and the total."""
    ranges, offset = {}, 0
    for name, shape, dtype in listing:
        size = int(torch.Size(shape).numel()) * dtype.itemsize
        offset = _aligned(offset)
        ranges[name] = (offset, offset + size)
        offset += size
    return ranges, offset


def _write_tensors(handle, listing, read, ranges, start: int) -> None:
    """Each tensor's bytes at its range of the scratch file, read one at a time."""
    for name, shape, dtype in listing:
        begin, end = ranges[name]
        handle.seek(start + begin)
        tensor = read(name)
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise UserError(f"{name}: read {tuple(tensor.shape)} {tensor.dtype}, listed {shape} {dtype}")
        handle.write(_raw(tensor))
        del tensor  # the next tensor is read only after this one is written
    handle.truncate(start + max((end for _, end in ranges.values()), default=0))


@contextlib.contextmanager
def _staged(listing, read, folder: Path):
    """{name: tensor} of `listing`, each read by `read` one at a time and copied into a scratch file beside the
    output before the next is read; the tensors handed out are views of that file mapped into memory, whose
    pages the system can drop at any time. A writer that needs every tensor at hand (the safetensors library,
    torch.save) then holds none of them in memory of its own."""
    ranges, total = _layout(listing)
    staged = folder / f".export-staged-{os.getpid()}"
    try:
        with open(staged, "wb") as handle:
            _write_tensors(handle, listing, read, ranges, 0)
        storage = torch.UntypedStorage.from_file(str(staged), shared=False, nbytes=max(total, 1))
        views = {}
        for name, shape, dtype in listing:
            view = torch.empty(0, dtype=dtype).set_(storage, ranges[name][0] // dtype.itemsize, shape)
            views[name] = view.clone() if view.numel() == 0 else view
        yield views
    finally:
        staged.unlink(missing_ok=True)


def _check_safetensors_dtypes(listing) -> None:
    for _, _, dtype in listing:
        if dtype not in SAFETENSORS_DTYPES:
            raise UserError(f"safetensors has no {dtype}; export with --format pt")


def _safetensors(listing, read, temporary: Path) -> None:
    from safetensors.torch import save_file

    _check_safetensors_dtypes(listing)
    with _staged(listing, read, temporary.parent) as views:
        save_file(views, str(temporary), metadata={"format": "pt"})


def _torch_save(listing, read, temporary: Path) -> None:
    with _staged(listing, read, temporary.parent) as views:
        torch.save(views, temporary)


def export_weights(path: Path, out: Path, *, format: str = "safetensors") -> tuple:
    """Write the weights of `path` (model.pt or best.pt: a state dict or a pointer to shards) to `out` as one
    file; (tensors, bytes) written."""
    if format not in FORMATS:
        raise UserError(f"unknown export format {format!r}; choose safetensors or pt")
    listing, read = _sources(Path(path))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        (_safetensors if format == "safetensors" else _torch_save)(listing, read, temporary)
        os.replace(temporary, out)
    finally:
        temporary.unlink(missing_ok=True)
    return len(listing), _layout(listing)[1]


def parse_size(text) -> int:
    """Bytes of a size as Hugging Face writes it ("5GB" = 5 * 10**9, "500MiB" = 500 * 2**20, "20KB"), or of a
    number of bytes; one line for anything else."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b)?\s*", str(text), re.IGNORECASE)
    if match is None or float(match[1]) <= 0:
        raise UserError(f"--max-shard-size {text}: give a size such as 5GB, 500MiB or 20KB")
    unit = (match[2] or "b").lower()
    scale = 1 if unit == "b" else (1024 if "i" in unit else 1000) ** ("kmgt".index(unit[0]) + 1)
    return int(float(match[1]) * scale)


def _shards(entries, limit: int) -> list:
    """The entries [(name, shape, dtype)] in order, cut into files of at most `limit` bytes each where a tensor
    fits (a larger tensor has a file of its own), as transformers' save_pretrained cuts them."""
    files, size = [[]], 0
    for entry in entries:
        nbytes = int(torch.Size(entry[1]).numel()) * entry[2].itemsize
        if files[-1] and size + nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += nbytes
    return files


# model -> the name of its token embedding (whose rows are the vocabulary); models/llama.py and models/gpt.py
# name its tensors and write its config.json as Hugging Face's
HF_MODELS = {"llama": "0.weight", "gpt": "0.token.weight"}


def _model_of_run(run_dir: Path, settings: dict, listing):
    """The run's model built on the meta device (its sizes from config.json, its vocabulary from the stored
    embedding), after checking that the stored tensors are its own; one line where they are not."""
    from ..config import STRATEGY_FLAGS, TrainConfig
    from ..models import build_model_on_meta

    how = ("strategy", *STRATEGY_FLAGS, "logger")
    config = TrainConfig.from_dict({k: v for k, v in settings.items() if k not in how})
    stored = {name: shape for name, shape, _ in listing}
    name, embedding = settings["model"], HF_MODELS[settings["model"]]
    if embedding not in stored:
        raise UserError(
            f"{run_dir}: the weights hold no token embedding ({embedding}); is it a --model {name} run?"
        )
    vocab = stored[embedding][0]
    if settings.get("classifies_texts"):  # a sequence classifier: its score head's classes
        classes = stored.get(CLASSIFIER_HEAD, (len(settings.get("classes") or ()),))[0]
        model = build_model_on_meta(name, (config.context or 1,), classes, config, vocabulary=vocab)
    else:
        model = build_model_on_meta(name, (config.context or 1,), vocab, config)
    for name, tensor in model.state_dict().items():
        if tuple(tensor.shape) != stored.get(name):
            raise UserError(
                f"{run_dir}: the stored {name} ({stored.get(name, 'missing')}) is not what its config.json "
                f"builds ({tuple(tensor.shape)}); the run folder is damaged"
            )
    return model


def _source_config(settings: dict) -> Optional[dict]:
    """The config.json of the Hugging Face checkpoint the run started from (--init-from), where it still is."""
    folder = settings.get("init_from")
    path = Path(folder) / "config.json" if folder else None
    if path is None or not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) and config.get("architectures") else None


def _write_tokenizer(run_dir: Path, settings: dict, folder: Path, *, window) -> None:
    """The run's tokenizer into the export, as AutoTokenizer reads it: tokenizer.json and the files of the
    checkpoint it came from (its tokenizer_config.json with the special tokens, its chat template); a tokenizer
    trained here gets a tokenizer_config.json of its own, its end-of-text token as GPT-2's is (bos and eos).
    Nothing for a run without one (shakespeare's characters are its vocabulary)."""
    kept = settings.get("kept_tokenizer")
    if not kept:
        return
    shutil.copyfile(run_dir / kept["file"], folder / TOKENIZER)
    names = [name for name in kept.get("companions", ()) if (run_dir / name).is_file()]
    for name in names:
        shutil.copyfile(run_dir / name, folder / name)
    if TOKENIZER_CONFIG not in names:
        from ..data import tokenizer as tokenizers_file

        end = tokenizers_file.load(run_dir / kept["file"]).id_to_token(int(kept["end_of_text_id"]))
        config = dict(
            tokenizer_class="PreTrainedTokenizerFast",
            bos_token=end,
            eos_token=end,
            model_max_length=window,
            clean_up_tokenization_spaces=False,
        )
        (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def _replace_folder(temporary: Path, out: Path) -> None:
    """`temporary` renamed to `out`; an earlier export there is replaced, a folder holding anything else is not."""
    if out.exists():
        ours = lambda path: path.name in EXPORTED or path.name.startswith("model")  # noqa: E731
        if not out.is_dir() or not all(path.is_file() and ours(path) for path in out.iterdir()):
            raise UserError(
                f"--out {out} exists and holds more than an export; give a new folder, or remove it"
            )
        shutil.rmtree(out)
    os.replace(temporary, out)


def export_hf(run_dir, out, *, weights: str = "final", max_shard_size="5GB", merge: bool = False) -> tuple:
    """A Hugging Face checkpoint folder of a --model llama or gpt run (config.json, and model.safetensors or
    shards with model.safetensors.index.json), which transformers' AutoModelForCausalLM.from_pretrained loads;
    each file is written by the safetensors library from tensors read one at a time (`_staged`); a --lora run's
    adapters merged into their layers with `merge` (runtime/export_peft.py). Returns (folder, tensors, bytes)."""
    from ..models import gpt, llama_hf
    from ..run_dir import read_config
    from .inference import weights_file

    run_dir, limit = Path(run_dir), parse_size(max_shard_size)
    settings = read_config(run_dir)
    model = settings.get("model")
    if settings.get("custom_model") or model not in HF_MODELS:
        raise UserError(
            f"--format hf writes --model llama runs (as LlamaForCausalLM or Qwen2ForCausalLM) and --model gpt "
            f"runs (as GPT2LMHeadModel); {run_dir} is a --model {model} run: export it with --format "
            f"safetensors or pt"
        )
    if settings.get("classifies_texts"):
        raise UserError(
            f"--format hf writes language models, and {run_dir} is a sequence classifier (a score head in place "
            f"of the language-model head); export it with --format safetensors or pt"
        )
    family = {"llama": llama_hf, "gpt": gpt}[model]
    listing, read_stored = _sources(weights_file(run_dir, weights))
    built = _model_of_run(run_dir, settings, listing)
    if bool(merge) != bool(settings.get("lora")):
        raise UserError(
            f"{run_dir} trained LoRA adapters: give --merge to write its base with them merged, or --format peft "
            f"for the adapters alone"
            if settings.get("lora")
            else f"--merge merges a --lora run's adapters into its layers, and {run_dir} has none; drop --merge"
        )
    if merge:
        listing, read_stored = merged_reader(listing, read_stored, lora_scale(settings))
    _check_safetensors_dtypes(listing)
    try:
        config = family.hf_config(built, _source_config(settings))
    except ConfigError as error:
        raise UserError(f"--format hf: {error}") from None
    names, seen, entries = family.hf_names(built), set(), []
    transposed = gpt.hf_transposed(names) if model == "gpt" else set()
    for name, shape, dtype in listing:
        theirs = names.get(name)
        if isinstance(theirs, tuple):  # a mixture's stacked experts: each expert a tensor of its own
            for e, expert in enumerate(theirs):
                names[f"{name}#{e}"] = expert
                entries.append((f"{name}#{e}", shape[1:], dtype))
        elif theirs is not None and theirs not in seen:  # a tied head is stored once, as the embedding
            seen.add(theirs)
            entries.append((name, shape[::-1] if name in transposed else shape, dtype))
    last = {}  # the stacked weight whose experts are being written (read once for all of them)

    def read(name: str) -> torch.Tensor:  # (GPT-2's Conv1D weights: the transpose of the GPT's)
        stacked, _, expert = name.partition("#")
        if expert:
            if last.get("name") != stacked:
                last.update(name=stacked, value=read_stored(stacked))
            return last["value"][int(expert)]
        return read_stored(name).t().contiguous() if name in transposed else read_stored(name)

    files = _shards(entries, limit)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    try:
        from safetensors.torch import save_file

        weight_map = {}
        for number, part in enumerate(files, start=1):
            file = (
                "model.safetensors"
                if len(files) == 1
                else f"model-{number:05d}-of-{len(files):05d}.safetensors"
            )
            with _staged(part, read, temporary) as views:
                save_file(
                    {names[n]: views[n] for n, _, _ in part}, str(temporary / file), metadata={"format": "pt"}
                )
            weight_map.update({names[n]: file for n, _, _ in part})
        total = sum(int(torch.Size(shape).numel()) * dtype.itemsize for _, shape, dtype in entries)
        if len(files) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (temporary / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        (temporary / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _write_tokenizer(run_dir, settings, temporary, window=config.get("max_position_embeddings"))
        _replace_folder(temporary, out)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return out, len(entries), total


def lora_scale(settings: dict) -> float:
    """alpha / R of a run's settings (its config.json)."""
    alpha = settings.get("lora_alpha")
    return (DEFAULT_ALPHA if alpha is None else alpha) / settings["lora"]


def adapted_layers(listing) -> list:
    """The one-device names of the layers a run's stored tensors (`listing`: (name, shape, dtype)) adapt,
    in order: `1.attention.wq` for `1.attention.wq.lora_A.default.weight`."""
    layers = [name.split(".lora_A.")[0] for name, _, _ in listing if ".lora_A." in name]
    return list(dict.fromkeys(layers))


def merged_reader(listing, read, scale: float):
    """`read(name)` for a run's stored tensors with each adapted layer's weight merged (W + scale B A, computed
    in float32 and stored in W's dtype): (the listing without the adapters, under the one-device names, and the
    reader by those names)."""
    layers = set(adapted_layers(listing))
    stored = {one_device_name(name): name for name, _, _ in listing if not is_adapter(name)}

    def merged(name: str) -> torch.Tensor:
        weight = read(stored[name])
        layer = name.removesuffix(".weight")
        if layer not in layers or not name.endswith(".weight"):
            return weight
        a = read(f"{layer}.lora_A.{ADAPTER}.weight").float()
        b = read(f"{layer}.lora_B.{ADAPTER}.weight").float()
        return (weight.float() + scale * (b @ a)).to(weight.dtype)

    kept = [(one_device_name(name), shape, dtype) for name, shape, dtype in listing if not is_adapter(name)]
    return kept, merged


def default_out(run_dir: Path, weights: str, format: str) -> Path:
    stem = "model" if weights == "final" else "best"
    if format in ("hf", "peft"):
        return Path(run_dir) / (format if weights == "final" else f"{format}-best")
    return Path(run_dir) / f"{stem}.{format}" if format != "pt" else Path(run_dir) / f"{stem}-export.pt"


def export_run(
    run_dir,
    *,
    weights: str = "final",
    format: str = "safetensors",
    out: Optional[str] = None,
    max_shard_size="5GB",
    merge: bool = False,
):
    """Export a run folder's final or best weights; (file or folder, tensors, bytes)."""
    from .inference import weights_file

    target = Path(out) if out else default_out(Path(run_dir), weights, format)
    if merge and format != "hf":
        raise UserError(f"--merge writes a Hugging Face checkpoint; add --format hf (not {format})")
    if format == "hf":
        return export_hf(run_dir, target, weights=weights, max_shard_size=max_shard_size, merge=merge)
    path = weights_file(run_dir, weights)
    count, size = export_weights(path, target, format=format)
    return target, count, size
