"""Models as users write them with torch alone, for the matrix (tests/test_matrix.py, tests/matrix_runs.py): each
entry of `MODELS` gives the keywords of a `polytrain.fit` call (the model, its data, and the loss or step it
needs), built afresh for every run.

    encoder    a causal language model of nn.TransformerEncoderLayer blocks (nn.MultiheadAttention inside),
               batch-first, with dropout, trained with loss=
    lstm       pytorch/examples' word_language_model RNNModel: an LSTM on sequence-first (T, B) batches with
               nn.Dropout before and after it and dropout between its layers, trained with a step= that
               calls the model's `init_hidden`
    hf-llama   Hugging Face's LlamaForCausalLM from a tiny LlamaConfig, on dict batches whose output carries
               its loss (needs `transformers`)
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, LENGTH, WIDTH = 32, 8, 16


class Tokens(torch.utils.data.Dataset):
    """Windows of random tokens: (input, next tokens) pairs, or {"input_ids", "labels"} dicts (Hugging Face)."""

    def __init__(self, count: int, seed: int, *, as_dict: bool = False):
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (count, LENGTH + 1), generator=generator)
        self.as_dict = as_dict

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        if self.as_dict:
            return {"input_ids": self.tokens[index, :-1], "labels": self.tokens[index, :-1]}
        return self.tokens[index, :-1], self.tokens[index, 1:]


class EncoderLM(nn.Module):
    """Token embedding, learned positions, nn.TransformerEncoderLayer blocks under a causal mask, a head."""

    def __init__(self, layers: int = 2, heads: int = 2, dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Embedding(LENGTH, WIDTH)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, heads, 2 * WIDTH, dropout, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        steps = tokens.shape[1]
        x = self.embed(tokens) + self.position(torch.arange(steps, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(steps, device=tokens.device)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(x)


def next_token_loss(scores, targets):
    return F.cross_entropy(scores.reshape(-1, scores.shape[-1]), targets.reshape(-1))


class RNNModel(nn.Module):
    """pytorch/examples' word_language_model RNNModel (LSTM): forward(input (T, B), hidden) -> (log-probabilities
    (T * B, vocabulary), hidden)."""

    def __init__(self, layers: int = 2, dropout: float = 0.2):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(VOCAB, WIDTH)
        self.rnn = nn.LSTM(WIDTH, WIDTH, layers, dropout=dropout)
        self.decoder = nn.Linear(WIDTH, VOCAB)
        self.layers = layers

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, VOCAB)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, batch: int):
        weight = next(self.parameters())
        shape = (self.layers, batch, WIDTH)
        return weight.new_zeros(shape), weight.new_zeros(shape)


def sequence_first_step(model, batch):
    """The batch comes batch-first, as the Dataset gives it; the model takes it sequence-first."""
    x, y = (part.t().contiguous() for part in batch)
    output, _ = model(x, model.init_hidden(x.shape[1]))
    return F.nll_loss(output, y.reshape(-1))


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=2 * WIDTH,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=LENGTH,
    )
    return LlamaForCausalLM(config)


# the MLPs split between the ranks (gate and up by rows, down by columns), attention whole
HF_LLAMA_PLAN = {
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}


def keywords(name: str, *, strategy: str) -> dict:
    """A fresh model of `MODELS` `name`, its data and, for --strategy tensor, its tensor plan where it has one, as
    `polytrain.fit` keywords. The Datasets are read in the training process (`num_workers=0`): loader processes
    started for every two-step run would cost more than the run."""
    torch.manual_seed(0)
    return dict(_keywords(name, strategy=strategy), num_workers=0)


def _keywords(name: str, *, strategy: str) -> dict:
    if name == "encoder":
        return dict(model=EncoderLM(), train=Tokens(64, 1), val=Tokens(16, 2), loss=next_token_loss)
    if name == "lstm":
        return dict(model=RNNModel(), train=Tokens(64, 1), val=Tokens(16, 2), step=sequence_first_step)
    if name == "hf-llama":
        train, val = Tokens(64, 1, as_dict=True), Tokens(16, 2, as_dict=True)
        plan = dict(tensor_plan=HF_LLAMA_PLAN) if strategy == "tensor" else {}
        return dict(model=hf_llama(), train=train, val=val, **plan)
    raise KeyError(name)


MODELS = ("encoder", "lstm", "hf-llama")
