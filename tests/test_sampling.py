"""`polytrain generate` keeps a key/value cache (models/kv_cache.py) and reads the model's own window: the cached
logits are the whole sequence's (float64), greedy text from a Hugging Face Llama or GPT-2 started with
--init-from equals transformers' `generate(do_sample=False)` up to the checkpoint's window (longer than the
run's --context), past the window each token comes from the last `window` ids, and a seed gives the same
sample again."""

import pytest
import torch
from test_init_from import save_gpt2, save_llama
from transformers import AutoModelForCausalLM

import polytrain
from polytrain.commands import generate_text
from polytrain.models import kv_cache
from polytrain.models.gpt import GPT, generate
from polytrain.models.kv_cache import cached
from polytrain.models.llama import Llama
from polytrain.run_dir import read_config
from polytrain.runtime.inference import load_run
from polytrain.runtime.sampling import model_window

VOCAB = 65  # shakespeare's characters
WINDOW = 64  # the checkpoints' max_position_embeddings and n_positions
CONTEXT = 16  # the runs' --context


def sharp_model(name: str) -> torch.nn.Module:
    """A small float64 llama (grouped-query attention, q/k/v biases) or GPT with weights of std 0.3: attention
    sharp enough that a key at a wrong position or a missing one shows in the logits."""
    torch.manual_seed(0)
    if name == "llama":
        model = Llama(
            VOCAB, context=32, layers=2, heads=4, kv_heads=2, width=32, rope_theta=100.0, qkv_bias=True
        )
    else:
        model = GPT(VOCAB, context=32, layers=2, heads=4, width=32)
    model = model.double().eval()
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if not parameter_name.endswith(("norm.weight", "norm1.weight", "norm2.weight")):
                parameter.normal_(0.0, 0.3)
    return model


def cached_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The logits of `ids` read as generate reads them, through the cache: a prompt of 7, then 3 tokens at
    once (queries behind cached keys), then one token at a time."""
    pieces = [ids[:, :7], ids[:, 7:10], *ids[:, 10:].split(1, dim=1)]
    with torch.no_grad(), cached(model):
        return torch.cat([model(piece) for piece in pieces], dim=1)


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_cached_logits_equal_the_whole_sequences(name):
    model = sharp_model(name)
    ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(ids)
    assert (cached_logits(model, ids) - whole).abs().max().item() < 1e-10
    with torch.no_grad():
        assert (model(ids) - whole).abs().max().item() == 0  # the cache is gone after its `with` block


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_the_comparison_sees_tokens_at_wrong_positions(name, monkeypatch):
    """A cache that turned (llama) or placed (GPT) every new token at position 0 onwards, not after the tokens
    read before, gives other logits."""
    model = sharp_model(name)
    ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(ids)
    monkeypatch.setattr(
        kv_cache.KVCache, "positions", lambda self, count, *, device: torch.arange(count, device=device)
    )
    assert (cached_logits(model, ids) - whole).abs().max().item() > 1e-2


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_past_the_window_each_token_comes_from_the_last_window_ids(name):
    """Up to the window the tokens are drawn through the cache, then from the last `window` ids run anew: the
    greedy ids of a loop that reruns the last 12 ids for every token (float64: no tie turns on rounding)."""
    model = sharp_model(name)
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    expected = prompt
    for _ in range(20):
        with torch.no_grad():
            following = model(expected[:, -12:])[:, -1].argmax(-1, keepdim=True)
        expected = torch.cat([expected, following], dim=1)
    assert torch.equal(generate(model, prompt, 20, temperature=0, window=12), expected)
    prompt = expected[:, :14]  # a prompt longer than the window
    assert torch.equal(generate(model, prompt, 11, temperature=0, window=12), expected)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """family -> (its Hugging Face checkpoint, a run started from it with --context 16 and trained one step at
    a rate too small to move a float32 weight)."""
    folder = tmp_path_factory.mktemp("sampling")
    checkpoints = {"llama": save_llama(folder / "llama", shard=False), "gpt2": save_gpt2(folder / "gpt2")}
    settings = dict(context=CONTEXT, batch_size=4, max_steps=1, lr=1e-30, verbose=False)
    made = {}
    for family, checkpoint in checkpoints.items():
        run = folder / f"run-{family}"
        polytrain.fit(None, "shakespeare", init_from=str(checkpoint), out=str(run), **settings)
        made[family] = (checkpoint, run)
    return made


def transformers_greedy(checkpoint, ids: list, tokens: int) -> list:
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    # (no end-of-text id: transformers would stop at one, and generate_text goes on)
    model.generation_config.eos_token_id = model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = 0
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens, do_sample=False
        )
    return out[0].tolist()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_text_equals_transformers_up_to_the_checkpoints_window(runs, family):
    """WINDOW + 1 characters in all (the last drawn from WINDOW), four times the run's --context."""
    checkpoint, run = runs[family]
    vocab = read_config(run)["vocab"]
    prompt = "ROMEO:"
    tokens = WINDOW + 1 - len(prompt)
    expected = transformers_greedy(checkpoint, [vocab.index(char) for char in prompt], tokens)
    text = generate_text(run, prompt=prompt, tokens=tokens, temperature=0, device="cpu")
    assert len(text) == WINDOW + 1 > 4 * CONTEXT
    assert text == "".join(vocab[i] for i in expected)
    if family == "llama":  # reading only the run's --context, as generate did, goes another way
        _, _, model = load_run(run)
        narrow = generate(
            model, torch.tensor([expected[: len(prompt)]]), tokens, temperature=0, window=CONTEXT
        )
        assert narrow[0].tolist() != expected


def test_the_window_is_the_checkpoints_or_the_models_context(runs, tmp_path):
    checkpoint, run = runs["llama"]
    settings = read_config(run)
    assert settings["positions"] == WINDOW  # the checkpoint's max_position_embeddings, recorded by the run
    built = Llama(VOCAB, context=CONTEXT, layers=1, heads=2, width=8, positions=settings["positions"])
    assert model_window(settings, built) == WINDOW
    # a run made before the llama recorded --positions: the checkpoint that its --init-from (a run) started from
    model = Llama(VOCAB, context=CONTEXT, layers=1, heads=2, width=8)
    assert model_window({"model": "llama", "init_from": str(run)}, model) == WINDOW
    assert model_window({"model": "llama", "init_from": None}, model) == CONTEXT  # trained from scratch
    moved = {"model": "llama", "init_from": str(tmp_path / "gone")}
    assert model_window(moved, model) == CONTEXT
    _, gpt_run = runs["gpt2"]
    gpt = GPT(VOCAB, context=WINDOW, layers=1, heads=2, width=8)  # a table of n_positions rows
    assert model_window(read_config(gpt_run), gpt) == WINDOW


def test_a_seed_gives_the_same_sample(runs):
    _, run = runs["llama"]
    draw = lambda seed: generate_text(run, prompt="ROMEO:", tokens=80, top_k=10, seed=seed, device="cpu")  # noqa: E731
    first = draw(3)
    assert len(first) == 86 and draw(3) == first != draw(4)
