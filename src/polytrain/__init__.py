"""polytrain: train PyTorch models on every device you have, with results proven equal to one device."""
__version__ = "0.1.0"

from .api import evaluate, fit, predict  # noqa: E402
from .config import TrainConfig  # noqa: E402
from .data import ArrayDataset, load_dataset  # noqa: E402
from .errors import UserError  # noqa: E402
from .models import build_model  # noqa: E402

__all__ = ["ArrayDataset", "TrainConfig", "UserError", "build_model", "evaluate", "fit", "load_dataset",
           "predict", "__version__"]
