"""Map-style Datasets for the tests, defined in a module so that spawned workers can unpickle them."""

import torch
from torch.utils.data import Dataset


class Pairs(Dataset):
    """(x[i], y[i]) from two tensors; `classes` like torchvision's datasets when given."""

    def __init__(self, x, y, classes=None):
        self.x, self.y = x, y
        if classes is not None:
            self.classes = classes

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


class Indices(Dataset):
    """Sample i is (tensor([i.]), i % classes): batches show which samples they hold."""

    def __init__(self, size, classes=3):
        self.size, self.classes = size, [str(c) for c in range(classes)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return torch.tensor([float(index)]), index % len(self.classes)


class BadAt(Pairs):
    """Like Pairs, but sample `index` is replaced by `sample`."""

    def __init__(self, x, y, *, index, sample):
        super().__init__(x, y)
        self.bad_index, self.bad_sample = index, sample

    def __getitem__(self, index):
        return self.bad_sample if index == self.bad_index else super().__getitem__(index)


def regression(n, *, features=6, outputs=2, seed=0):
    """A linear target with noise: inputs (n, features), targets (n, outputs), both float."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator)
    w = torch.randn(features, outputs, generator=generator)
    return x, x @ w + 0.1 * torch.randn(n, outputs, generator=generator)


def mean_absolute_error(outputs, targets):
    """Per-sample mean absolute error, shape (n,)."""
    return (outputs - targets).abs().mean(dim=1)


def batch_rmse(outputs, targets):
    """A scalar batch mean (treated as one value per sample times the count)."""
    return ((outputs - targets) ** 2).mean()


class Regressor(torch.nn.Module):
    def __init__(self, features=6, outputs=2):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(features, 16), torch.nn.Tanh(), torch.nn.Linear(16, outputs)
        )

    def forward(self, x):
        return self.net(x)


class Recorder:
    """A logger object in Lightning's style: log_metrics(metrics, step)."""

    def __init__(self):
        self.calls = []

    def log_metrics(self, metrics, step):
        self.calls.append((dict(metrics), step))


class RaisesAt(Pairs):
    """Like Pairs, but reading sample `index` raises, as a bug in a user's __getitem__ would."""

    def __init__(self, x, y, *, index):
        super().__init__(x, y)
        self.bad_index = index

    def __getitem__(self, index):
        if index == self.bad_index:
            raise KeyError(f"no file for sample {index}")
        return super().__getitem__(index)


class NoisyPairs(Pairs):
    """Like Pairs, with a random transform drawn from torch's, Python's and NumPy's global generators."""

    def __getitem__(self, index):
        import random

        import numpy as np

        x, y = super().__getitem__(index)
        noise = torch.rand(x.shape) * 0.1 + random.random() * 0.01 + float(np.random.rand()) * 0.01
        return x + noise, y
