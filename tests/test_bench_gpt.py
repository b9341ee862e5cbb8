"""The cost model's inputs for the GPT (token windows of shape (N, T), not images), against counts worked out by
hand from its sizes, and `polytrain bench --model gpt` on a tiny GPT."""

import json

import pytest
import torch
from processes import polytrain

from polytrain.data.text import tokenise
from polytrain.models.gpt import GPT
from polytrain.objective import Objective
from polytrain.parallel.presets import plain_layout
from polytrain.planning.costmodel import Link, Workload, pipeline
from polytrain.planning.memory import memory_per_rank
from polytrain.scaling.workload import activation_bytes, boundary_bytes, parameter_bytes, sample_batch

VOCAB = 65


def gpt_parameters(*, vocab, context, layers, width, tied=True) -> int:
    """By hand: token and position embeddings, per block two LayerNorms (weight, bias), qkv (W x 3W + 3W),
    the projection (W x W + W) and the MLP (W x 4W + 4W, 4W x W + W), the final LayerNorm, the head (tied: none
    of its own)."""
    block = (
        2 * 2 * width
        + (3 * width * width + 3 * width)
        + (width * width + width)
        + (4 * width * width + 4 * width)
        + (4 * width * width + width)
    )
    return vocab * width + context * width + layers * block + 2 * width + (0 if tied else vocab * width)


@pytest.mark.parametrize("context,layers,width,heads", [(16, 1, 32, 2), (32, 2, 32, 4), (16, 2, 64, 4)])
def test_the_gpts_sizes_per_window_of_tokens(context, layers, width, heads):
    torch.manual_seed(0)
    model = GPT(VOCAB, context=context, layers=layers, heads=heads, width=width)
    x = torch.randint(0, VOCAB, (4, context))
    y = torch.randint(0, VOCAB, (4, context))
    # the tied head counts once (an untied one adds vocab x width)
    assert parameter_bytes(model) == 4 * gpt_parameters(
        vocab=VOCAB, context=context, layers=layers, width=width
    )
    untied = GPT(VOCAB, context=context, layers=layers, heads=heads, width=width, tied=False)
    assert parameter_bytes(untied) == 4 * gpt_parameters(
        vocab=VOCAB, context=context, layers=layers, width=width, tied=False
    )
    # a pipeline cut after the embeddings, each block and the final norm: a (T, width) float per window
    assert boundary_bytes(model, x) == (4.0 * context * width,) * (layers + 2)
    # kept for backward, per window: ~16 floats per token and width in each block (norm inputs, q, k, v, the
    # attention's output, the MLP's input, its 4x hidden before and after GELU), the final norm's input and the
    # head's, and the log-softmax of the vocabulary's scores per token
    by_hand = 4 * context * (16 * layers * width + 2 * width + VOCAB)
    kept = activation_bytes(model, Objective(kind="language"), x, y)
    assert kept == pytest.approx(by_hand, rel=0.1)
    # twice the context keeps twice the bytes per window (the attention's T x T scores are not kept on this path
    # or are small beside them)
    longer = GPT(VOCAB, context=2 * context, layers=layers, heads=heads, width=width)
    x2, y2 = torch.randint(0, VOCAB, (2, 2 * context)), torch.randint(0, VOCAB, (2, 2 * context))
    assert activation_bytes(longer, Objective(kind="language"), x2, y2) == pytest.approx(2 * kept, rel=0.05)


def test_sample_batch_of_text_gives_windows_and_their_next_tokens():
    data = tokenise("abcdefghij" * 40, name="text", context=8)
    x, y = sample_batch(data, 5)
    assert x.shape == y.shape == (5, 8) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # each target is the next character


def test_memory_and_pipeline_transfers_of_a_gpt_workload():
    """A default GPT (4 layers, width 128, context 64) at batch 32, sizes per window worked out by hand."""
    context, width, layers, batch = 64, 128, 4, 32
    weights = 4.0 * gpt_parameters(vocab=VOCAB, context=context, layers=layers, width=width)
    kept = 4.0 * context * (16 * layers * width + 2 * width + VOCAB)
    cut = 4.0 * context * width
    work = Workload(
        compute_seconds=0.1,
        parameter_bytes=weights,
        batch_size=batch,
        update_seconds=0.01,
        layers=4 * layers + 3,
        boundary_bytes=(cut,) * (layers + 2),
        activation_bytes=kept,
    )
    # AdamW: two state tensors per weight; every activation kept for backward, not only those at the cuts
    assert memory_per_rank(work, plain_layout("single", 1), optimizer_slots=2) == weights * 4 + kept * batch
    assert memory_per_rank(work, plain_layout("data", 2), optimizer_slots=2) == weights * 4 + kept * batch / 2
    # without the measured activations, the cuts' sum stands in (as for bench files written before them)
    older = Workload(**{**work.__dict__, "activation_bytes": 0.0})
    assert (
        memory_per_rank(older, plain_layout("single", 1), optimizer_slots=2)
        == weights * 4 + cut * (layers + 2) * batch
    )
    # a pipeline of 2 stages, 4 micro-batches of 8 windows: each slot sends one micro-batch's (8, T, width)
    # activations forward and their gradients back
    link = Link(alpha=1e-4, beta=1e9)
    predicted = pipeline(work, 2, link, microbatches=4)
    assert predicted.communication == pytest.approx(5 * 2 * (1e-4 + 8 * cut / 1e9))


@pytest.mark.multiprocess
def test_bench_runs_a_tiny_gpt_and_reports_tokens_per_second(tmp_path):
    result = polytrain(
        "bench",
        "--model",
        "gpt",
        "--dataset",
        "shakespeare",
        "--layers",
        "1",
        "--width",
        "32",
        "--heads",
        "2",
        "--context",
        "16",
        "--devices",
        "1",
        "--strategies",
        "single",
        "--batch-sizes",
        "8",
        "--device",
        "cpu",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--out",
        tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tokens/s" in result.stdout
    document = json.loads((tmp_path / "bench.json").read_text())
    (row,) = document["rows"]
    assert row["skipped"] == "" and row["tokens_per_second"] == pytest.approx(row["samples_per_second"] * 16)
    # its counted FLOPs per second as a share of a float32 matmul's on the same threads, in the table and its row
    lines = result.stdout.splitlines()
    header = next(index for index, text in enumerate(lines) if text.startswith("device "))
    assert "% peak" in lines[header]
    shown = float(lines[header + 2].split()[6])  # device, strategy, n, batch, samples/s, tokens/s, % peak
    assert 0 < row["peak_fraction"] <= 1 and shown == pytest.approx(100 * row["peak_fraction"], abs=0.051)
    work = document["workloads"][0]
    weights = 4 * gpt_parameters(vocab=VOCAB, context=16, layers=1, width=32)
    assert work["parameter_bytes"] == weights and work["boundary_bytes"] == [4.0 * 16 * 32] * 3
    assert work["activation_bytes"] == pytest.approx(4 * 16 * (16 * 32 + 2 * 32 + VOCAB), rel=0.1)
    # the GPT's own recipe, not the image models' SGD: weights, gradients, AdamW's two state tensors per weight
    # and its step count (one float) per parameter tensor, of which 1 layer has 16
    assert row["held_bytes"] == 4 * weights + 4 * 16


def test_bench_refuses_gpt_sizes_for_another_model():
    from polytrain.errors import ConfigError
    from polytrain.runtime.bench import BenchOptions

    with pytest.raises(ConfigError, match="--layers applies to the gpt and llama models only"):
        BenchOptions(model="lenet", layers=2)
    with pytest.raises(ConfigError, match="--kv-heads applies to the llama model only"):
        BenchOptions(model="gpt", kv_heads=2)
    with pytest.raises(ConfigError, match="--kv-heads must be a positive whole number"):
        BenchOptions(model="llama", kv_heads=0)
    assert BenchOptions(model="llama", kv_heads=2, size="tiny").model_options == {
        "size": "tiny",
        "kv_heads": 2,
    }
