"""`polytrain generate` from a model with more vocabulary rows than the data's tokens (--vocab-size): only
the tokens the run's vocabulary can decode are drawn."""

import json

import torch
from test_gpt import _text_file

import polytrain
from polytrain.commands import generate_text
from polytrain.models.gpt import generate


def test_generate_draws_only_ids_the_runs_vocabulary_decodes(tmp_path):
    path, _ = _text_file(tmp_path)
    run = tmp_path / "run"
    sizes = dict(layers=1, width=16, heads=2, context=8)
    polytrain.fit(
        "llama", "text", data_dir=str(path), max_steps=1, verbose=False, out=str(run), vocab_size=64, **sizes
    )
    vocab = json.loads((run / "config.json").read_text())["vocab"]
    weights = torch.load(run / "model.pt")
    head = list(weights)[-1]  # the output layer (the Sequential's last), 64 rows of 16
    assert tuple(weights[head].shape) == (64, 16)
    # the rows the data never uses score far above the others: undrawn only because they are masked
    weights[head][: len(vocab)] = 0.0
    weights[head][len(vocab) :] = 50.0 * torch.randn(
        64 - len(vocab), 16, generator=torch.Generator().manual_seed(0)
    )
    torch.save(weights, run / "model.pt")
    text = generate_text(run, prompt="R", tokens=60, seed=0)
    assert len(text) == 61 and set(text) <= set(vocab)
    assert generate_text(run, prompt="R", tokens=5, temperature=0) != ""  # greedy: the likeliest decodable id


def test_without_a_vocabulary_the_extra_rows_would_be_drawn():
    class Scores(torch.nn.Module):
        context = 4

        def forward(self, idx):
            return torch.tensor([0.0, 0.0, 30.0, 30.0]).expand(*idx.shape, 4)

    drawn = generate(
        Scores(), torch.zeros(1, 1, dtype=torch.long), 20, generator=torch.Generator().manual_seed(0)
    )
    assert drawn[0, 1:].min() >= 2  # the rows past a 2-token vocabulary win
    kept = generate(
        Scores(),
        torch.zeros(1, 1, dtype=torch.long),
        20,
        generator=torch.Generator().manual_seed(0),
        vocabulary=2,
    )
    assert kept[0, 1:].max() <= 1
