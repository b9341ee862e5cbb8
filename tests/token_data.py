"""Variable-length token sequences padded to one length, and small models over them, for the tests of
batches of any structure and of token-exact (sum, count) losses (importable: worker processes unpickle them)."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

VOCAB, LENGTH, PAD = 11, 12, -100


class PaddedTokens(Dataset):
    """Dicts of `input_ids` and `labels` (next tokens; padding is PAD); lengths vary from 1 to LENGTH."""

    def __init__(self, count: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (count, LENGTH + 1), generator=generator)
        self.lengths = torch.randint(1, LENGTH + 1, (count,), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        length = int(self.lengths[i])
        labels = self.ids[i, 1:].clone()
        labels[length:] = PAD
        inputs = self.ids[i, :-1].clone()
        inputs[length:] = 0
        return {"input_ids": inputs, "labels": labels}


class TokenModel(nn.Module):
    """An embedding and a head; forward(input_ids, labels) returns a dict with the logits and, with labels,
    the loss as a (sum over the non-padding tokens, their count) pair."""

    def __init__(self, width: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, input_ids, labels=None):
        logits = self.head(torch.tanh(self.mix(self.embed(input_ids))))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = token_loss(logits, labels)
        return out


def token_loss(logits, labels):
    total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=PAD, reduction="sum")
    return total, (labels != PAD).sum()


class MeanTokenModel(TokenModel):
    """The same model returning its loss as Hugging Face models do: the mean over this batch's tokens."""

    def forward(self, input_ids, labels=None):
        out = super().forward(input_ids, labels)
        if labels is not None:
            total, count = out["loss"]
            out["loss"] = total / count
        return out


def token_step(model, batch):
    """A step function: the same (sum, count) pair from the model's logits."""
    return token_loss(model(batch["input_ids"])["logits"], batch["labels"])


def reference_weights(
    data: PaddedTokens, *, batch_size: int, steps: int, lr: float, parts: int = 1, per_part_mean: bool = False
) -> dict:
    """SGD by hand on the global batches polytrain cuts (epoch 0's seeded order): each step minimises the sum
    of the batch's token losses over its token count; or, with `per_part_mean`, the mean over `parts` parts of
    each part's own token mean (how per-batch means were once averaged over accumulation and devices)."""
    from polytrain.data.order import global_batch_order

    model = TokenModel()
    order = global_batch_order(len(data), epoch=0, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        index = order[step * batch_size : (step + 1) * batch_size]
        items = [data[int(i)] for i in index]
        batch = {key: torch.stack([item[key] for item in items]) for key in items[0]}
        optimizer.zero_grad()
        if per_part_mean:
            loss = 0
            for ids, labels in zip(
                torch.tensor_split(batch["input_ids"], parts), torch.tensor_split(batch["labels"], parts)
            ):
                total, count = model(ids, labels)["loss"]
                loss = loss + total / count / parts
        else:
            total, count = model(**batch)["loss"]
            loss = total / count
        loss.backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


class LitTokens(TokenModel):
    """A LightningModule as its documentation writes one (duck-typed: Lightning is not installed here):
    training_step and validation_step log and return the loss; configure_optimizers returns Lightning's dict
    with a per-step scheduler."""

    def __init__(self, lr: float = 0.5, gamma: float = 0.9):
        super().__init__()
        self.lr, self.gamma = lr, gamma

    def training_step(self, batch, batch_idx):
        total, count = self(**batch)["loss"]
        self.log("train_loss", total / count)
        return {"loss": (total, count)}

    def validation_step(self, batch, batch_idx):
        total, count = self(**batch)["loss"]
        self.log("val_loss", total / count)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=self.gamma)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def lightning_reference(data: PaddedTokens, *, batch_size: int, steps: int, lr: float, gamma: float) -> dict:
    """reference_weights with the learning rate multiplied by gamma after every step."""
    from polytrain.data.order import global_batch_order

    model = TokenModel()
    order = global_batch_order(len(data), epoch=0, seed=0)
    for step in range(steps):
        index = order[step * batch_size : (step + 1) * batch_size]
        items = [data[int(i)] for i in index]
        batch = {key: torch.stack([item[key] for item in items]) for key in items[0]}
        model.zero_grad()
        total, count = model(**batch)["loss"]
        (total / count).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * gamma**step * p.grad
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def sequential_twin():
    """TokenModel's layers as an nn.Sequential (the pipeline splits those), with the same initial weights;
    its parameter names map to TokenModel's by SEQUENTIAL_NAMES."""
    model = TokenModel()
    return nn.Sequential(model.embed, model.mix, nn.Tanh(), model.head)


SEQUENTIAL_NAMES = {"0": "embed", "1": "mix", "3": "head"}


class TokenPairs(Dataset):
    """PaddedTokens as (input_ids, labels) pairs."""

    def __init__(self, data: PaddedTokens):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        item = self.data[i]
        return item["input_ids"], item["labels"]


SEEN = []  # what LitRecorder's copies did, in this process: (what, current_epoch, global_step[, batch_idx])


def token_accuracy(logits, labels):
    mask = labels != PAD
    return (logits.argmax(-1)[mask] == labels[mask]).float().mean()


class Recording:
    """A LightningModule's steps and hooks that write down where the loop stands into SEEN and log the token
    accuracy; the loss is each batch's token mean (a scalar, as Lightning's training_step returns)."""

    def _note(self, what, *batch_idx):
        SEEN.append((what, self.current_epoch, self.global_step, *batch_idx))

    def _loss_and_accuracy(self, batch):
        logits = self(batch["input_ids"])["logits"]
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=PAD
        )
        return loss, token_accuracy(logits, batch["labels"])

    def training_step(self, batch, batch_idx):
        self._note("train", batch_idx)
        loss, accuracy = self._loss_and_accuracy(batch)
        self.log("train_acc", accuracy, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self._note("val", batch_idx)
        loss, accuracy = self._loss_and_accuracy(batch)
        self.log("val_loss", loss)
        self.log("val_acc", accuracy)

    def configure_optimizers(self):
        SEEN.append(
            ("configure_optimizers", self.trainer.max_epochs, self.trainer.estimated_stepping_batches)
        )
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def on_fit_start(self):
        self._note("on_fit_start")

    def on_train_start(self):
        self._note("on_train_start")

    def on_train_epoch_start(self):
        self._note("on_train_epoch_start")

    def on_validation_start(self):
        self._note("on_validation_start")

    def on_validation_epoch_start(self):
        self._note("on_validation_epoch_start")

    def on_validation_epoch_end(self):
        self._note("on_validation_epoch_end")

    def on_validation_end(self):
        self._note("on_validation_end")

    def on_train_epoch_end(self):
        self._note("on_train_epoch_end")

    def on_train_end(self):
        self._note("on_train_end")

    def on_fit_end(self):
        self._note("on_fit_end")


class LitRecorder(Recording, TokenModel):
    """Recording as a LightningModule without Lightning (duck-typed)."""


class LitAccuracy(LitTokens):
    """LitTokens that also logs each batch's token accuracy (train_acc, val_acc)."""

    def training_step(self, batch, batch_idx):
        self.log("train_acc", token_accuracy(self(batch["input_ids"])["logits"].detach(), batch["labels"]))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.log("val_acc", token_accuracy(self(batch["input_ids"])["logits"], batch["labels"]))
        return super().validation_step(batch, batch_idx)
