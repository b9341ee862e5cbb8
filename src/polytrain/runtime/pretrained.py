"""The weights of a Hugging Face checkpoint folder (--init-from), read by each rank into what it holds.

`Pretrained(folder, model)` pairs each parameter of polytrain's model (its one-device name) with the
checkpoint's tensor (models/llama.py and models/gpt.py `hf_names`). In the launching process `check` compares
their shapes against the model built on the meta device, reading only the files' headers. On every rank, the
model's tensors are given storage (parallel/materialise.py) and `read_into` fills them through
torch.distributed.checkpoint's `HuggingFaceStorageReader`: DCP plans, for each tensor this rank holds (an
FSDP2 shard, a tensor-parallel slice, a whole tensor of its pipeline stage), the piece of the stored tensor
it covers, and the reader reads that piece alone through safetensors' lazy slices; the checkpoint's dtype
(bfloat16, say) is converted into the model's as it is copied. No rank reads the whole model; each reads on
its own (no collective), so any layout loads alike.

Two kinds of tensor are not stored as this rank holds them, and are read through `Pieces`, which tells DCP
which blocks of the stored tensor this rank's tensor covers and hands the reader a view of the rank's tensor
for each: GPT-2's `Conv1D` weights, stored transposed ([in, out]), whose piece is the transposed block (a
rank holding rows r..s of our weight reads columns r..s of theirs, into the transpose of its own tensor:
the copy transposes, no whole tensor is read or made); and a fused layer of a tensor plan (GPT's q/k/v), whose
rows a rank holds in another order than one device (strategies/checkpoint_parts.py `fused_rows`): each run
of consecutive rows is a block of its own. DCP has no transform of its own for either; the planner of
runtime/shards.py looks each block's view up by its offsets.

`RunWeights(folder)` does the same for a polytrain run folder (--init-from RUN): its model.pt names the shard
folder its ranks wrote, read through DCP's own reader into the pieces this rank holds, or is one state dict,
mapped from the disk, each rank cutting its part (only the pages it touches are read). `initial_weights` picks
the one a folder needs.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from ..config.pretrained import is_run_folder, weight_files
from ..errors import CheckpointError, ConfigError, first_line
from ..models import gpt, llama, llama_hf
from ..models.classifier import HEAD, SequenceClassifier, loads_head
from ..models.lora import has_adapters, is_adapter, one_device_name
from . import shards
from .base_apart import RECORD
from .checkpoint import shard_folder


def names_of(model: nn.Module, stored=()) -> tuple:
    """(one-device parameter name -> the checkpoint's name, the names whose stored tensor is the transpose of
    the model's) for a model polytrain can load into; `stored`, the checkpoint's names, tells a GPT-2 saved
    without transformers' "transformer." prefix. A model with LoRA adapters (models/lora.py): its base layers'
    weights by their names there (`...wq.base_layer.weight`), its adapters not at all (they start anew)."""
    names, transposed = _model_names(model, stored)
    if not has_adapters(model):
        return names, transposed
    held = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    keyed = {name: names[one_device_name(name)] for name in held if one_device_name(name) in names}
    return keyed, {name for name in keyed if one_device_name(name) in transposed}


def _model_names(model: nn.Module, stored) -> tuple:
    # a sequence classifier's body has its language model's names; its score head, Hugging Face's name
    head = {HEAD: HEAD} if isinstance(model, SequenceClassifier) and HEAD in stored else {}
    if isinstance(model, llama.Llama):
        return dict(llama_hf.hf_names(model), **head), set()
    if isinstance(model, gpt.GPT):
        bare = gpt.HF_PREFIX + "wte.weight" not in stored and "wte.weight" in stored
        names = gpt.hf_names(model, prefix="" if bare else gpt.HF_PREFIX)
        return dict(names, **head), gpt.hf_transposed(names)
    raise ConfigError(
        f"--init-from loads into --model llama or gpt, not {type(model).__name__}; drop --model, or "
        f"--init-from"
    )


class Pieces:
    """The blocks of a stored tensor (of `size`) that a rank's tensor covers: [(offsets, sizes, view)], each
    view a tensor of `sizes` sharing the rank's storage, which DCP's reader copies its block into (the planner
    of runtime/shards.py finds the view by `piece(offsets)`)."""

    def __init__(self, size, blocks: list):
        self.global_size, self.blocks = torch.Size(size), blocks

    def size(self) -> torch.Size:
        return self.global_size

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s, _ in self.blocks]

    def piece(self, offsets) -> torch.Tensor:
        for block, _, view in self.blocks:
            if tuple(block) == tuple(offsets):
                return view
        raise ValueError(f"no block of this rank begins at {tuple(offsets)}")


def _blocks(tensor: torch.Tensor, order=None) -> list:
    """[(offsets, sizes, view)] of the one-device tensor that `tensor` (a DTensor, or a whole tensor) holds
    here: one block, or the runs of consecutive rows of a fused layer held in `order`."""
    if order is not None and hasattr(tensor, "device_mesh"):
        from ..strategies.checkpoint_parts import fused_rows

        rows = fused_rows(tensor, order)
        return [(o, s, rows.local[first:end]) for o, s, first, end in rows.blocks]
    if hasattr(tensor, "device_mesh"):
        (chunk,) = tensor.__create_chunk_list__()
        return [(tuple(chunk.offsets), tuple(chunk.sizes), tensor.to_local())]
    return [((0,) * tensor.dim(), tuple(tensor.shape), tensor)]


def pieces(tensor: torch.Tensor, *, transposed: bool, order=None) -> Pieces:
    """What `tensor` holds of its one-device value, as blocks of the stored tensor: that value's transpose
    where `transposed` (a 2-D weight), its rows in `order` where given (a fused layer)."""
    blocks = _blocks(tensor, order)
    if transposed:
        size = tuple(reversed(tensor.shape))
        blocks = [(tuple(reversed(o)), tuple(reversed(s)), view.t()) for o, s, view in blocks]
        return Pieces(size, blocks)
    return Pieces(tensor.shape, blocks)


def expert_pieces(tensor: torch.Tensor, names: tuple) -> dict:
    """{stored name: Pieces} of a mixture's stacked weight ([E, ...], a DTensor or a whole tensor) whose expert e
    is stored apart under names[e]: for each expert this rank holds rows of, the block of its stored tensor that
    this rank's rows cover (FSDP2 may cut the experts, or each expert's rows where they are fewer than the
    shards)."""
    found = {}
    for offsets, sizes, view in _blocks(tensor):
        for e in range(offsets[0], offsets[0] + sizes[0]):
            block = (tuple(offsets[1:]), tuple(sizes[1:]), view[e - offsets[0]])
            if names[e] in found:
                found[names[e]].blocks.append(block)
            else:
                found[names[e]] = Pieces(tensor.shape[1:], [block])
    return found


class Pretrained:
    """A checkpoint folder and the names of `model`'s parameters in it (picklable: sent to each worker)."""

    def __init__(self, folder, model: nn.Module):
        self.folder = Path(folder)
        self.names, self.transposed = names_of(model, self.shapes())

    def shapes(self) -> dict:
        """The checkpoint's name -> shape of every tensor, from the files' headers (no tensor is read)."""
        from safetensors import safe_open

        shapes = {}
        for path in weight_files(self.folder):
            try:
                with safe_open(str(path), framework="pt") as handle:
                    for key in handle.keys():
                        shapes[key] = tuple(handle.get_slice(key).get_shape())
            except Exception as error:  # a truncated or foreign file: its header cannot be parsed
                raise ConfigError(
                    f"--init-from: {path} is not a readable safetensors file ({first_line(error)}); copy it "
                    f"again from the checkpoint's source"
                ) from None
        return shapes

    def check(self, model: nn.Module) -> None:
        """One line where the checkpoint lacks a tensor `model` has, or holds one of another shape (the
        launching process, before any worker starts)."""
        stored = self.shapes()
        for name, parameter in model.named_parameters(remove_duplicate=False):
            if not loads_head(model, name, stored, self.folder) or is_adapter(name):
                continue
            theirs = self.names.get(name)
            if isinstance(theirs, tuple):  # a mixture's experts stacked: one stored tensor each
                self._check_stacked(parameter, theirs, stored)
                continue
            if theirs not in stored:
                raise ConfigError(
                    f"--init-from: {self.folder} has no tensor {theirs or name!r}, which its config.json "
                    f"implies; the weights and the config disagree: save them again with save_pretrained"
                )
            shape = tuple(parameter.shape)
            if name in self.transposed:
                shape = shape[::-1]  # (stored [in, out])
            if stored[theirs] != shape:
                raise ConfigError(
                    f"--init-from: {theirs} in {self.folder} has shape {list(stored[theirs])}, and its "
                    f"config.json implies {list(shape)}; the weights and the config disagree: save them again "
                    f"with save_pretrained"
                )

    def _check_stacked(self, parameter: torch.Tensor, theirs: tuple, stored: dict) -> None:
        """One line where a stacked weight's experts are not each stored with its shape."""
        for expert in theirs:
            if stored.get(expert) != tuple(parameter.shape[1:]):
                has = f"has shape {list(stored[expert])}" if expert in stored else "lacks it"
                raise ConfigError(
                    f"--init-from: {self.folder} {has}: {expert}, one of {len(theirs)} experts of "
                    f"{list(parameter.shape[1:])} that its config.json implies; the weights and the config "
                    f"disagree: save them again with save_pretrained"
                )

    @torch.no_grad()
    def read_into(self, targets: dict, *, reorder=None) -> tuple:
        """Fill `targets` (one-device name -> this rank's tensor: a DTensor, or a whole tensor) from the
        checkpoint, each with the piece it holds; `reorder`: name -> the order a fused layer's rows take on the
        ranks, read in that order (`Pieces`); a mixture's stacked experts, each expert's rows that this rank
        holds from the tensor stored for it (`expert_pieces`). Returns (names filled, {}: nothing read
        whole)."""
        import torch.distributed.checkpoint as dcp

        reorder = reorder or {}
        # a tensor the checkpoint has under one name may be held here under several (a tied head): one load
        # per holder, so that each template names each stored tensor once
        templates, filled = [], set()
        stacked = {}
        for name, tensor in targets.items():
            theirs = self.names.get(name)
            if theirs is None:
                continue
            if isinstance(theirs, tuple):
                stacked.update(expert_pieces(tensor, theirs))
                filled.add(name)
                continue
            for template in templates:
                if theirs not in template or template[theirs][0] is tensor:
                    break
            else:
                template = {}
                templates.append(template)
            template[theirs] = (tensor, name)
            filled.add(name)
        if stacked:
            templates.append({theirs: (piece, None) for theirs, piece in stacked.items()})
        for template in templates:
            values = {
                theirs: tensor
                if name not in self.transposed and name not in reorder
                else pieces(tensor, transposed=name in self.transposed, order=reorder.get(name))
                if name is not None
                else tensor  # (an expert's Pieces)
                for theirs, (tensor, name) in template.items()
            }
            with shards.quiet():
                dcp.load(
                    values,
                    storage_reader=dcp.HuggingFaceStorageReader(str(self.folder)),
                    planner=shards.piece_planner(),
                    no_dist=True,
                )
        return filled, {}


class RunWeights:
    """The final weights of a polytrain run folder, by the one-device names (picklable: sent to each worker)."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.path = self.folder / "model.pt"

    def _open(self) -> tuple:
        """(the shard folder model.pt names, or None; the state dict model.pt holds, mapped from the disk)."""
        try:
            state = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as error:  # weights_only loading runs no code; any failure means a damaged file
            raise CheckpointError(
                f"--init-from: {self.path} is not a loadable polytrain checkpoint ({first_line(error)}); give "
                f"another run, or train this one again"
            ) from None
        if not isinstance(state, dict):
            raise CheckpointError(f"--init-from: {self.path} holds no state dict; the file is damaged")
        return shard_folder(state, self.path), state

    def shapes(self) -> dict:
        """name -> shape of every stored model tensor (a shard folder's from its index; no tensor is read)."""
        folder, state = self._open()
        if folder is not None:
            return {name: shape for name, (shape, _) in shards.model_entries(shards.check(folder)).items()}
        return {name: tuple(t.shape) for name, t in state.items() if isinstance(t, torch.Tensor)}

    def check(self, model: nn.Module) -> None:
        """One line where the run lacks a tensor `model` has, or holds one of another shape (the launching
        process, before any worker starts)."""
        if (self.folder / RECORD).is_file():  # (base_apart.py: a LoRA run's files hold no base)
            raise ConfigError(
                f"--init-from: {self.folder} is a LoRA fine-tune whose files hold its adapters only; write it "
                f"whole first (polytrain export {self.folder} --format hf --merge --out FOLDER) and start from FOLDER"
            )
        stored = self.shapes()
        fix = "start from a run of the same model and dataset (its vocabulary), or drop --init-from"
        for name, tensor in model.state_dict(keep_vars=True).items():
            if not loads_head(model, name, stored, self.folder) or (is_adapter(name) and name not in stored):
                continue  # (adapters a run without them lacks start anew)
            name = _stored_name(name, stored)
            if name not in stored:
                raise ConfigError(
                    f"--init-from: {self.folder} holds no {name!r}, which this run's model has; {fix}"
                )
            if stored[name] != tuple(tensor.shape):
                raise ConfigError(
                    f"--init-from: {name} in {self.folder} has shape {list(stored[name])}, and this run's model "
                    f"{list(tensor.shape)}; {fix}"
                )

    @torch.no_grad()
    def read_into(self, targets: dict, *, reorder=None) -> tuple:
        """As `Pretrained.read_into`: a shard folder fills each target with the piece it holds (DCP, without a
        process group), the names in `reorder` (fused layers) read whole and returned for the caller to cut;
        a one-file state dict returns every tensor, mapped from the disk, for the caller to cut its part
        from."""
        whole = set(reorder or ())
        folder, state = self._open()
        if folder is None:
            found = {name: state.get(_stored_name(name, state)) for name in targets}
            return set(), {name: t for name, t in found.items() if isinstance(t, torch.Tensor)}
        entries = shards.model_entries(shards.check(folder))
        template, wholes, mine = {}, {}, {}
        for name, tensor in targets.items():
            theirs = _stored_name(name, entries)
            if theirs in entries:
                if name in whole:
                    tensor = wholes[name] = torch.empty(entries[theirs][0], dtype=entries[theirs][1])
                template[theirs], mine[theirs] = tensor, name
        shards.read_pieces(folder, {"model": template})
        loaded = {id(tensor) for theirs, tensor in template.items() if mine[theirs] not in wholes}
        return {name for name, tensor in targets.items() if id(tensor) in loaded}, wholes


def _stored_name(name: str, stored) -> str:
    """`name` (a tensor of the model) as a run stored it: itself, or, for a base layer of a model with LoRA
    adapters started from a run without them, its name there (`...wq.base_layer.weight` -> `...wq.weight`)."""
    return name if name in stored or one_device_name(name) not in stored else one_device_name(name)


def initial_weights(folder, model: nn.Module):
    """The weights --init-from FOLDER starts `model` from: a polytrain run's, or a Hugging Face checkpoint's."""
    return RunWeights(folder) if is_run_folder(folder) else Pretrained(folder, model)


def check_vocabulary(config, dataset) -> None:
    """One line where the data's token ids reach beyond the checkpoint's vocabulary (the launching process,
    before the model is built): where the checkpoint's own tokenizer wrote the data, it is that tokenizer's
    added tokens, which the checkpoint has no embedding rows for."""
    tokens = getattr(dataset, "num_classes", None)
    if getattr(dataset, "kind", None) == "classification" or tokens is None or config.vocab_size is None:
        return
    if tokens <= config.vocab_size:
        return
    from ..data import tokenizer as tokenizers_file

    kept = getattr(dataset, "tokenizer_file", None)
    own = Path(str(config.init_from)) / tokenizers_file.FILE
    # (the data's tokenizer is named by its hash, as check_same_tokenizer compares it)
    if kept is not None and own.is_file() and tokenizers_file.file_sha256(own) == dataset.tokenizer_sha256:
        added = tokenizers_file.load(Path(kept)).get_added_tokens_decoder()
        beyond = sorted((i, token.content) for i, token in added.items() if i >= config.vocab_size)
        named = ", ".join(f"{content!r} ({i})" for i, content in beyond[:3]) + (
            ", ..." if len(beyond) > 3 else ""
        )
        raise ConfigError(
            f"--init-from: {config.init_from}'s own tokenizer has {tokens} tokens with its added ones ({named}), "
            f"and its model has embedding rows for {config.vocab_size} only, so those ids have no row; give the "
            f"model rows for them in transformers (model.resize_token_embeddings(len(tokenizer)), then "
            f"save_pretrained(DIR) and --init-from DIR), or tokenize the corpus with a tokenizer without those "
            f"added tokens (polytrain does not grow a checkpoint's vocabulary: the new rows would start untrained)"
        )
    raise ConfigError(
        f"--init-from: {config.init_from} has a vocabulary of {config.vocab_size} tokens, and the dataset "
        f"{getattr(dataset, 'name', '')} has {tokens}; train on data whose token ids are below "
        f"{config.vocab_size}, or start from a checkpoint with {tokens} tokens or more"
        + (
            f" (write the corpus with the checkpoint's tokenizer: polytrain tokenize FILES --tokenizer "
            f"{config.init_from} --out DIR)"
            if kept is not None and own.is_file()
            else ""
        )
    )
