"""Models built without storage, and initial weights that do not depend on how the model is split.

A model is built under `torch.device("meta")` (shapes and dtypes, no memory), and each rank later gives
storage to what it holds and fills it from `full_values`: the one-device value of every parameter and buffer,
made one module at a time from a seed derived from the run's seed and the module's name in the whole model.
Any layout (shards, slices, stages, one device) then starts from the same weights, and no process ever holds
more than one module's tensors whole while initialising.

A module is initialised by its model's `init_module(name, module)` where the model has one (polytrain's GPT
and Llama), else by its own `reset_parameters()` (torch's layers); a module built on the meta device that
holds tensors and has neither is refused in one line.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Callable, Iterator, Optional, Tuple

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from ..errors import UserError


class _NoValues(TorchFunctionMode):
    """The in-place fills of initialisation (`nn.init`'s normal_, uniform_, zeros_, ...) do nothing to a tensor on
    the meta device: it has no values to fill, and its values come module by module later (`full_values`). On the
    meta device torch runs them as Python decompositions: building Llama 3 8B took 1 s, most of it there."""

    FILLS = frozenset(
        [getattr(torch.Tensor, name)
         for name in ("normal_", "uniform_", "zero_", "fill_", "random_", "bernoulli_", "exponential_",
                      "log_normal_", "cauchy_", "geometric_")]
        # nn.init's own (normal_, kaiming_uniform_, ...), which torch hands to a mode before their fills
        + [getattr(nn.init, name) for name in dir(nn.init) if name.endswith("_") and not name.startswith("_")]
    )  # fmt: skip

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0] if args else kwargs.get("tensor")
        if func in self.FILLS and isinstance(tensor, torch.Tensor) and tensor.is_meta:
            return tensor
        return func(*args, **kwargs)


def on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """`build()` with every tensor it creates on the meta device: the model's shapes, no storage (and no
    initialisation run: `_NoValues`)."""
    with torch.device("meta"), _NoValues():
        return build()


def from_factory(model):
    """`model` built on the meta device where it is a function that builds one (`fit(model=fn)`); a module, a
    registry name or None as it is."""
    if model is None or isinstance(model, (str, nn.Module)) or not callable(model):
        return model
    built = on_meta(model)
    if not isinstance(built, nn.Module):
        raise UserError(
            f"model= {getattr(model, '__name__', model)!r} returned {type(built).__name__}, not an nn.Module; "
            f"pass a function that returns the model (it is called with no arguments)"
        )
    return built


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of `module` is on the meta device (it has no values yet)."""
    tensors = [*module.parameters(), *module.buffers()]
    return any(_local_part(t).is_meta for t in tensors)


def _local_part(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


# what a layer that wraps another inserts in the wrapped one's name (peft's LoRA layers keep the layer they adapt
# as `base_layer`: models/lora.py): the wrapped layer keeps the seed and initialisation of its own name
WRAPPED = ".base_layer"


def unwrapped(name: str) -> str:
    """`name` as it was before a layer on its path was wrapped: `1.attention.wq.base_layer` -> `1.attention.wq`."""
    return name.replace(WRAPPED, "")


def base_of(module: nn.Module) -> Optional[nn.Module]:
    """The layer `module` wraps (peft's LoRA layer's `base_layer`), or None for a layer that wraps none."""
    return module._modules.get(WRAPPED[1:])


def module_seed(seed: int, name: str) -> int:
    """The seed of module `name` (its dotted name in the one-device model) in a run seeded `seed`."""
    digest = hashlib.sha256(f"{int(seed)}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _own(module: nn.Module) -> list:
    """(key, tensor, is_parameter) of `module`'s own parameters and buffers."""
    own = [(k, p, True) for k, p in module._parameters.items() if p is not None]
    return own + [(k, b, False) for k, b in module._buffers.items() if b is not None]


def _held(module: nn.Module, key: str, is_parameter: bool) -> torch.Tensor:
    """`module`'s own parameter or buffer `key` as it holds it now (to_empty gives it a new tensor)."""
    return (module._parameters if is_parameter else module._buffers)[key]


# the attribute by which a module says how its own tensors start, in place of the model's initialisation: a
# function of the module (an adapter's, models/lora.py)
INIT_VALUES = "init_values"


def _initialiser(model: nn.Module, name: str, module: nn.Module) -> Optional[Callable[[], None]]:
    own = module.__dict__.get(INIT_VALUES)
    if own is not None:
        return lambda: own(module)
    if hasattr(model, "init_module"):
        return lambda: model.init_module(name, module)
    if callable(getattr(module, "reset_parameters", None)):
        return module.reset_parameters
    return None


@torch.no_grad()
def full_values(
    blueprint: nn.Module, seed: int, *, wanted=None
) -> Iterator[Tuple[Tuple[str, ...], torch.Tensor]]:
    """(names, value) for every parameter and buffer of the meta-device model `blueprint`, one module at a
    time: `names` are all the names the tensor has in the whole model (tied weights have several), `value` its
    one-device initial value on the CPU. Modules none of whose tensors' names are in `wanted` (None: all) are
    skipped. The blueprint is left as it was (on the meta device)."""
    aliases = {}
    for name, tensor in [
        *blueprint.named_parameters(remove_duplicate=False),
        *blueprint.named_buffers(remove_duplicate=False),
    ]:
        aliases.setdefault(id(tensor), []).append(name)
    done = set()
    for name, module in blueprint.named_modules():
        own = [(k, t, is_p) for k, t, is_p in _own(module) if id(t) not in done]
        if not own:
            continue
        done.update(id(t) for _, t, _ in own)
        names = {id(t): tuple(aliases[id(t)]) for _, t, _ in own}
        if wanted is not None and not any(n in wanted for ns in names.values() for n in ns):
            continue
        init = _initialiser(blueprint, unwrapped(name), module)
        if init is None:
            raise UserError(
                f"{name or 'the model'} ({type(module).__name__}) was built on the meta device and has no "
                f"reset_parameters() to give its tensors values; define reset_parameters() for it, or "
                f"build the model on the CPU"
            )
        module.to_empty(device="cpu", recurse=False)
        # a module's own reset_parameters() (a user's) may leave a tensor as to_empty left it, uninitialised
        # memory that would train: each floating tensor starts as NaN, and one still NaN after it is refused
        by_reset = init == getattr(module, "reset_parameters", None)
        if by_reset:
            for key, _, is_parameter in own:
                value = _held(module, key, is_parameter)
                if value.is_floating_point():
                    value.detach().fill_(float("nan"))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(module_seed(seed, unwrapped(name)))
            init()
        for key, tensor, is_parameter in own:
            value = _held(module, key, is_parameter)
            if by_reset and value.is_floating_point() and bool(value.isnan().any()):
                kind = "parameter" if is_parameter else "buffer"
                raise UserError(
                    f"{name or 'the model'} ({type(module).__name__}) was built on the meta device, and its "
                    f"reset_parameters() gives its {kind} {key!r} no value; set it there, or build the model on "
                    f"the CPU"
                )
            yield names[id(tensor)], value.detach()
        module.to_empty(device="meta", recurse=False)


def to_empty(module: nn.Module, *, device) -> nn.Module:
    """`module.to_empty(device=device)` with tied tensors still tied (torch's gives each holder its own)."""
    holders = {}
    for owner in module.modules():
        for kind in ("_parameters", "_buffers"):
            for key, tensor in getattr(owner, kind).items():
                if tensor is not None:
                    holders.setdefault(id(tensor), []).append((getattr(owner, kind), key))
    module.to_empty(device=device)
    for (table, key), *others in holders.values():
        for other, other_key in others:
            other[other_key] = table[key]
    return module


@torch.no_grad()
def give_values(module: nn.Module, *, device, seed: int) -> nn.Module:
    """`module`, built on the meta device, in place with storage on `device` and its initial values (those
    every layout starts from); a module with values is returned as it is."""
    if not is_meta(module):
        return module
    blueprint = copy.deepcopy(module)
    to_empty(module, device=device)
    targets = dict(module.named_parameters(remove_duplicate=False))
    targets.update(module.named_buffers(remove_duplicate=False))
    for names, value in full_values(blueprint, seed):
        for name in names:
            targets[name].copy_(value)
    return module


def materialised_copy(module: nn.Module, *, device, seed: int = 0) -> nn.Module:
    """A copy of `module` on `device` with values (initial ones where it was built on the meta device): for
    the launching process's measurements, which need numbers. The whole model: planning a large one takes
    `one_by_one` instead."""
    copied = copy.deepcopy(module)
    return give_values(copied, device=device, seed=seed) if is_meta(module) else copied.to(device)


def one_by_one(model: nn.Module, parts, *, device, seed: int = 0) -> Iterator[Tuple[str, nn.Module]]:
    """(name, copy) for each (name, module) of `parts`, modules of `model`, one at a time: a copy on `device`
    with the values it has in `model`, or, built on the meta device, its initial values in the whole model
    (tied weights included). Each copy is made only when the previous one is asked past, so a caller that
    drops it holds one module's tensors at a time, however large the model."""
    for name, module in parts:
        if not is_meta(module):
            yield name, copy.deepcopy(module).to(device)
            continue
        copied = to_empty(copy.deepcopy(module), device=device)
        prefix = f"{name}." if name else ""
        targets = {
            prefix + key: tensor
            for key, tensor in [
                *copied.named_parameters(remove_duplicate=False),
                *copied.named_buffers(remove_duplicate=False),
            ]
        }
        # a fresh blueprint each time: full_values gives a module storage and takes it back, which unties
        # the blueprint's tied tensors
        for names, value in full_values(copy.deepcopy(model), seed, wanted=targets):
            for target in names:
                if target in targets:
                    with torch.no_grad():
                        targets[target].copy_(value)
        yield name, copied
        del copied, targets
