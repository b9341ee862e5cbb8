"""The weights of a Hugging Face checkpoint folder (--init-from), read by each rank into what it holds.

`Pretrained(folder, model)` pairs each parameter of polytrain's model (its one-device name) with the
checkpoint's tensor (models/llama.py `hf_names`). In the launching process `check` compares their shapes
against the model built on the meta device, reading only the files' headers. On every rank, the model's
tensors are given storage (strategies/materialise.py) and `read_into` fills them through
torch.distributed.checkpoint's `HuggingFaceStorageReader`: DCP plans, for each tensor this rank holds (an
FSDP2 shard, a tensor-parallel slice, a whole tensor of its pipeline stage), the piece of the stored tensor
it covers, and the reader reads that piece alone through safetensors' lazy slices; the checkpoint's dtype
(bfloat16, say) is converted into the model's as it is copied. No rank reads the whole model; each reads on
its own (no collective), so any layout loads alike.

`RunWeights(folder)` does the same for a polytrain run folder (--init-from RUN): its model.pt names the shard
folder its ranks wrote, read through DCP's own reader into the pieces this rank holds, or is one state dict,
mapped from the disk, each rank cutting its part (only the pages it touches are read). `initial_weights` picks
the one a folder needs.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from ..checkpoint import shard_folder
from ..config.pretrained import is_run_folder, weight_files
from ..errors import CheckpointError, ConfigError, first_line
from .llama import Llama, hf_names


def names_of(model: nn.Module) -> dict:
    """One-device parameter name -> the checkpoint's name, for a model polytrain can load into."""
    if isinstance(model, Llama):
        return hf_names(model)
    raise ConfigError(
        f"--init-from loads into --model llama, not {type(model).__name__}; drop --model, or --init-from"
    )


@contextlib.contextmanager
def _quiet():
    """DCP warns that it runs without a process group when asked to (no_dist): each rank reads on its own."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*assuming the intent.*")
        yield


class Pretrained:
    """A checkpoint folder and the names of `model`'s parameters in it (picklable: sent to each worker)."""

    def __init__(self, folder, model: nn.Module):
        self.folder = Path(folder)
        self.names = names_of(model)

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
            theirs = self.names.get(name)
            if theirs not in stored:
                raise ConfigError(
                    f"--init-from: {self.folder} has no tensor {theirs or name!r}, which its config.json "
                    f"implies; the weights and the config disagree: save them again with save_pretrained"
                )
            if stored[theirs] != tuple(parameter.shape):
                raise ConfigError(
                    f"--init-from: {theirs} in {self.folder} has shape {list(stored[theirs])}, and its "
                    f"config.json implies {list(parameter.shape)}; the weights and the config disagree: save "
                    f"them again with save_pretrained"
                )

    @torch.no_grad()
    def read_into(self, targets: dict, *, whole=()) -> tuple:
        """Fill `targets` (one-device name -> this rank's tensor: a DTensor's part, or all of a plain tensor)
        from the checkpoint, each with the piece it holds; the names in `whole` are read whole instead and
        returned (a caller cuts them: rows in another order). Returns (names filled, {name: whole value})."""
        import torch.distributed.checkpoint as dcp

        # a tensor the checkpoint has under one name may be held here under several (a tied head): one load
        # per holder, so that each template names each stored tensor once
        templates, filled, wholes = [], set(), {}
        for name, tensor in targets.items():
            theirs = self.names.get(name)
            if theirs is None:
                continue
            if name in whole:
                tensor = wholes[name] = torch.empty(tensor.shape, dtype=tensor.dtype)
            for template in templates:
                if theirs not in template or template[theirs] is tensor:
                    break
            else:
                template = {}
                templates.append(template)
            template[theirs] = tensor
            filled.add(name)
        for template in templates:
            with _quiet():
                dcp.load(
                    template, storage_reader=dcp.HuggingFaceStorageReader(str(self.folder)), no_dist=True
                )
        return filled - set(wholes), wholes


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
        from ..runtime import shards

        folder, state = self._open()
        if folder is not None:
            return {name: shape for name, (shape, _) in shards.model_entries(shards.check(folder)).items()}
        return {name: tuple(t.shape) for name, t in state.items() if isinstance(t, torch.Tensor)}

    def check(self, model: nn.Module) -> None:
        """One line where the run lacks a tensor `model` has, or holds one of another shape (the launching
        process, before any worker starts)."""
        stored = self.shapes()
        fix = "start from a run of the same model and dataset (its vocabulary), or drop --init-from"
        for name, tensor in model.state_dict(keep_vars=True).items():
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
    def read_into(self, targets: dict, *, whole=()) -> tuple:
        """As `Pretrained.read_into`: a shard folder fills each target with the piece it holds (DCP, without a
        process group), the names in `whole` read whole and returned; a one-file state dict returns every
        tensor, mapped from the disk, for the caller to cut its part from."""
        from ..runtime import shards

        folder, state = self._open()
        if folder is None:
            return set(), {name: state[name] for name in targets if isinstance(state.get(name), torch.Tensor)}
        entries = shards.model_entries(shards.check(folder))
        template, wholes = {}, {}
        for name, tensor in targets.items():
            if name in entries:
                if name in whole:
                    tensor = wholes[name] = torch.empty(entries[name][0], dtype=entries[name][1])
                template[name] = tensor
        shards.read_pieces(folder, {"model": template})
        loaded = {id(tensor) for name, tensor in template.items() if name not in wholes}
        return {name for name, tensor in targets.items() if id(tensor) in loaded}, wholes


def initial_weights(folder, model: nn.Module):
    """The weights --init-from FOLDER starts `model` from: a polytrain run's, or a Hugging Face checkpoint's."""
    return RunWeights(folder) if is_run_folder(folder) else Pretrained(folder, model)


def check_vocabulary(config, dataset) -> None:
    """One line where the data's token ids reach beyond the checkpoint's vocabulary (the launching process,
    before the model is built)."""
    tokens = getattr(dataset, "num_classes", None)
    if getattr(dataset, "kind", None) == "classification" or tokens is None or config.vocab_size is None:
        return
    if tokens > config.vocab_size:
        raise ConfigError(
            f"--init-from: {config.init_from} has a vocabulary of {config.vocab_size} tokens, and the dataset "
            f"{getattr(dataset, 'name', '')} has {tokens}; train on data whose token ids are below "
            f"{config.vocab_size}, or start from a checkpoint with {tokens} tokens or more"
        )
