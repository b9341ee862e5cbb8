"""Rows of token ids as a Hugging Face causal LM is trained on them, and a tiny transformers Llama over them,
for the tests of a model that returns its own loss (importable: worker processes unpickle them).

Each row is a dict of `input_ids`, `attention_mask` and `labels` as Hugging Face's collators make them: the
labels are the inputs themselves (the model shifts them), -100 over a prompt of 0 to 3 tokens and over the
right padding; rows hold 2 to LENGTH tokens, so the parts of a batch hold different numbers of trained labels.
"""

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

VOCAB, LENGTH, IGNORED = 16, 12, -100


class LabelledRows(Dataset):
    def __init__(self, count: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (count, LENGTH), generator=generator)
        self.lengths = torch.randint(2, LENGTH + 1, (count,), generator=generator)
        self.prompts = torch.randint(0, 4, (count,), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        length, prompt = int(self.lengths[i]), int(self.prompts[i])
        ids = self.ids[i].clone()
        ids[length:] = 0
        labels = ids.clone()
        labels[length:] = IGNORED
        labels[:prompt] = IGNORED
        mask = torch.zeros(LENGTH, dtype=torch.long)
        mask[:length] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def tiny_llama():
    """A transformers LlamaForCausalLM of one layer, in float64, without dropout, the same at every call."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2 * LENGTH,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).double()


def global_token_mean(model, batch: dict) -> torch.Tensor:
    """What one device minimises on a whole batch: the next-token cross-entropy (float64) summed over every
    label that is not -100 after the shift, over their number."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    total = F.cross_entropy(
        logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=IGNORED, reduction="sum"
    )
    return total / (targets != IGNORED).sum()


def stacked(data: Dataset, index) -> dict:
    items = [data[int(i)] for i in index]
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def hand_trained(data: Dataset, *, batch_size: int, steps: int, lr: float) -> dict:
    """Plain SGD by hand on the global batches polytrain cuts (epoch 0's seeded order), each step minimising
    `global_token_mean` of its whole batch: the weights one device must train."""
    from polytrain.data.order import global_batch_order

    model = tiny_llama()
    order = global_batch_order(len(data), epoch=0, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        optimizer.zero_grad()
        global_token_mean(model, stacked(data, order[step * batch_size : (step + 1) * batch_size])).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}
