"""Code as pytorch/examples' word_language_model writes it, for the tests: an LSTM on sequence-first `(T, B)`
batches with nn.Dropout between layers, a `forward(input, hidden)` and an `init_hidden` method that a step=
calls, and a positional encoding buffer of shape (max_len, 1, width) made by `unsqueeze(0).transpose(0, 1)`
(its strides are not the default ones)."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, LENGTH = 20, 7


class SequenceFirstLM(nn.Module):
    def __init__(self, width: int = 8, layers: int = 2, dropout: float = 0.3, rnn_dropout: float = 0.0):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(VOCAB, width)
        self.rnn = nn.LSTM(width, width, layers, dropout=rnn_dropout)
        self.decoder = nn.Linear(width, VOCAB)
        self.width, self.layers = width, layers
        position = torch.arange(0, 64, dtype=torch.float).unsqueeze(1)
        scale = torch.exp(torch.arange(0, width, 2).float() * (-math.log(10000.0) / width))
        pe = torch.zeros(64, width)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(position * scale), torch.cos(position * scale)
        self.register_buffer("pe", pe.unsqueeze(0).transpose(0, 1))

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input) + self.pe[: input.size(0)])
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, VOCAB)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, batch: int):
        weight = next(self.parameters())
        shape = (self.layers, batch, self.width)
        return weight.new_zeros(shape), weight.new_zeros(shape)


def sequence_first_step(model, batch):
    """Batches come batch-first as a Dataset gives them; the model takes them sequence-first."""
    x, y = (part.t().contiguous() for part in batch)
    output, _ = model(x, model.init_hidden(x.shape[1]))
    return F.nll_loss(output, y.reshape(-1))


class Windows(torch.utils.data.Dataset):
    def __init__(self, count: int, seed: int):
        self.tokens = torch.randint(
            0, VOCAB, (count, LENGTH + 1), generator=torch.Generator().manual_seed(seed)
        )

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        return self.tokens[index, :-1], self.tokens[index, 1:]
