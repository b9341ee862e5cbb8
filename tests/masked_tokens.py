"""Token windows whose labels are -100 at random positions (Hugging Face's masked labels), a float64 model
that scores every position, and SGD on them by hand (importable: worker processes unpickle them)."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

VOCAB, LENGTH, MASKED = 11, 8, -100


class MaskedWindows(Dataset):
    """(input ids (T,), next-token labels (T,)) pairs; about `share` of the labels are -100, some windows
    entirely, so ranks and passes hold very different numbers of trained tokens."""

    def __init__(self, count: int, seed: int = 0, share: float = 0.4):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (count, LENGTH + 1), generator=generator)
        self.masked = torch.rand(count, LENGTH, generator=generator) < share
        self.masked[::5] = True  # every fifth window trains nothing

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i, 1:].clone()
        labels[self.masked[i]] = MASKED
        return self.ids[i, :-1], labels


def token_model() -> nn.Sequential:
    """Scores (N, T, VOCAB) in float64: an embedding, a nonlinearity and a head (a Sequential, so a pipeline
    splits it too)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, VOCAB)).double()


def reference_weights(
    data: MaskedWindows, *, batch_size: int, steps: int, lr: float, frozen=(), per_part_mean: int = 0
) -> dict:
    """SGD by hand on the global batches polytrain cuts (epoch 0's seeded order): each step minimises
    F.cross_entropy(ignore_index=-100) summed over the batch's tokens over the count of its labels that are
    not -100; or, with `per_part_mean` P, the mean of P parts' own token means (what averaging each rank's
    mean would train). Parameters named in `frozen` are not trained."""
    from polytrain.data.order import global_batch_order

    model = token_model()
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    order = global_batch_order(len(data), epoch=0, seed=0)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step in range(steps):
        index = order[step * batch_size : (step + 1) * batch_size]
        x = torch.stack([data[int(i)][0] for i in index])
        y = torch.stack([data[int(i)][1] for i in index])
        optimizer.zero_grad()
        if per_part_mean:
            parts = zip(torch.tensor_split(x, per_part_mean), torch.tensor_split(y, per_part_mean))
            loss = sum(
                F.cross_entropy(model(a).flatten(0, 1), b.flatten(), ignore_index=MASKED) for a, b in parts
            )
            loss = loss / per_part_mean
        else:
            total = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=MASKED, reduction="sum")
            loss = total / (y != MASKED).sum()
        losses.append((loss.item(), int((y != MASKED).sum())))
        loss.backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}, losses
