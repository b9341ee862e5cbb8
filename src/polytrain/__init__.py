"""polytrain: train PyTorch models on every device you have, with results proven equal to one device.

The names below are imported from their modules when first used, so that the command line's help and
`polytrain.config` (neither needs torch) do not wait for torch to import."""

from importlib import import_module

from .version import __version__

# name -> the module that defines it
_EXPORTS = {
    "ArrayDataset": ".data",
    "TrainConfig": ".config",
    "UserError": ".errors",
    "build_model": ".models",
    "evaluate": ".api",
    "fit": ".api",
    "load_dataset": ".data",
    "plan": ".runtime.plan_report",
    "predict": ".api",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'polytrain' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # the next use finds it without this function
    return value


def __dir__():
    return sorted({*globals(), *_EXPORTS})
