"""polytrain: train PyTorch models on every device you have, with results proven equal to one device."""

from .api import evaluate, fit, predict
from .config import TrainConfig
from .data import ArrayDataset, load_dataset
from .errors import UserError
from .models import build_model
from .version import __version__

__all__ = [
    "ArrayDataset",
    "TrainConfig",
    "UserError",
    "build_model",
    "evaluate",
    "fit",
    "load_dataset",
    "predict",
    "__version__",
]
