"""A mixture of experts in the llama's blocks (models/moe.py, `--experts E --experts-per-token K`): its logits
against Hugging Face's Mixtral and Qwen2-MoE with the same weights, its grouped computation against the
per-token sum written out, its load-balancing loss against Hugging Face's, training proven equal to one device
on the layouts it takes (the load-balancing loss on), the tokens each expert got in the epoch's record, and what
does not make a mixture refused in one line. The model-by-layout matrix (test_matrix.py, llama-moe) trains it on every layout."""

import pytest
import torch
from conftest import assert_refused_in_one_line, polytrain_here

from polytrain.errors import UserError
from polytrain.models.llama import Llama
from polytrain.models.moe import MixtureOfExperts, balance_loss, mixtures, routed_tokens

SHAPE = dict(layers=2, heads=4, kv_heads=2, width=64, ffn_width=32, rope_theta=10000.0)
VOCAB = 96


def _ours_from_hf(hf_state: dict, ours: Llama, experts_key: str) -> None:
    """Load Hugging Face's tensors (transformers 5's names: fused 3-D experts) into the llama by hand."""
    width, new = SHAPE["ffn_width"], {}
    new["0.weight"] = hf_state["model.embed_tokens.weight"]
    for i in range(SHAPE["layers"]):
        at, theirs = i + 1, f"model.layers.{i}."
        new[f"{at}.attention_norm.weight"] = hf_state[theirs + "input_layernorm.weight"]
        new[f"{at}.ffn_norm.weight"] = hf_state[theirs + "post_attention_layernorm.weight"]
        for a, o in (("q", "wq"), ("k", "wk"), ("v", "wv"), ("o", "wo")):
            new[f"{at}.attention.{o}.weight"] = hf_state[theirs + f"self_attn.{a}_proj.weight"]
            if a != "o" and theirs + f"self_attn.{a}_proj.bias" in hf_state:
                new[f"{at}.attention.{o}.bias"] = hf_state[theirs + f"self_attn.{a}_proj.bias"]
        mlp = theirs + f"{experts_key}."
        new[f"{at}.feed_forward.router.weight"] = hf_state[mlp + "gate.weight"]
        fused = hf_state[mlp + "experts.gate_up_proj"]  # [E, 2F, D]: the gate's rows, then the up's
        new[f"{at}.feed_forward.experts.w1"] = fused[:, :width]
        new[f"{at}.feed_forward.experts.w3"] = fused[:, width:]
        new[f"{at}.feed_forward.experts.w2"] = hf_state[mlp + "experts.down_proj"]
        if mlp + "shared_expert_gate.weight" in hf_state:
            for ours_name, hf_name in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
                new[f"{at}.feed_forward.shared.{ours_name}.weight"] = hf_state[
                    mlp + f"shared_expert.{hf_name}.weight"
                ]
            new[f"{at}.feed_forward.shared.gate.weight"] = hf_state[mlp + "shared_expert_gate.weight"]
    new[f"{SHAPE['layers'] + 1}.weight"] = hf_state["model.norm.weight"]
    new[f"{SHAPE['layers'] + 2}.weight"] = hf_state["lm_head.weight"]
    ours.load_state_dict(new)  # strict: every tensor of ours given, none left over


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe"])
def test_logits_equal_hugging_faces_moe_models_with_the_same_weights(family):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64, num_experts_per_tok=2,
    )  # fmt: skip
    if family == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=32, num_local_experts=4, **common)
        hf, key, options = transformers.MixtralForCausalLM(config), "mlp", {}
    else:  # a shared expert of 2 x 32 behind its gate, q/k/v biases, the kept probabilities not renormalised
        config = transformers.Qwen2MoeConfig(
            intermediate_size=32, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
            decoder_sparse_step=1, norm_topk_prob=False, **common,
        )  # fmt: skip
        hf, key = transformers.Qwen2MoeForCausalLM(config), "mlp"
        options = dict(shared_experts=2, qkv_bias=True, experts_renormalise=False)
    hf.eval()
    for p in hf.parameters():  # Qwen2-MoE's router starts at zero: give every tensor values
        torch.nn.init.normal_(p, std=0.1) if p.dim() > 1 else torch.nn.init.normal_(p, mean=1.0, std=0.1)
    ours = Llama(VOCAB, context=16, **SHAPE, experts=4, experts_per_token=2, **options).eval()
    _ours_from_hf(hf.state_dict(), ours, key)
    ids = torch.randint(0, VOCAB, (3, 16))
    with torch.no_grad():
        expected, got = hf(ids).logits, ours(ids)
    assert (expected - got).abs().max() < 1e-5
    assert expected.std() > 0.1  # (the comparison is not of zeros)


def test_the_grouped_experts_compute_the_weighted_sum_over_each_tokens_experts():
    """Each token's output is sum_k w_k expert_{c_k}(x), its gradients those of that sum, written token by token;
    an expert that gets no token changes nothing."""
    torch.manual_seed(1)
    mixture = MixtureOfExperts(8, 12, 6, 3, shared=1, renormalise=False).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    out = mixture(x)
    chosen, weights, probabilities = mixture.route(x.reshape(-1, 8))
    assert torch.allclose(weights, probabilities.gather(1, chosen))  # not renormalised
    experts = mixture.experts
    expected = []
    for token, row in enumerate(x.reshape(-1, 8)):
        total = mixture.shared(row)
        for k in range(3):
            e = int(chosen[token, k])
            hidden = torch.nn.functional.silu(experts.w1[e] @ row) * (experts.w3[e] @ row)
            total = total + weights[token, k] * (experts.w2[e] @ hidden)
        expected.append(total)
    expected = torch.stack(expected).reshape(2, 5, 8)
    assert torch.allclose(out, expected, atol=1e-14)
    grads = torch.autograd.grad(out.square().sum(), [x, experts.w1, mixture.router.weight])
    references = torch.autograd.grad(expected.square().sum(), [x, experts.w1, mixture.router.weight])
    for grad, reference in zip(grads, references):
        assert torch.allclose(grad, reference, atol=1e-13)
    # renormalised (the default): the kept weights sum to one
    mixture.renormalise = True
    assert torch.allclose(mixture.route(x.reshape(-1, 8))[1].sum(-1), torch.ones(10, dtype=torch.float64))


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe"])
def test_the_balance_loss_is_hugging_faces_per_sequence_and_mixture(family):
    """Hugging Face's load_balancing_loss_func (E sum_e f_e P_e over the router scores it is given) applied to each
    sequence and each mixture alone, weighed and averaged: each sequence's loss, gradients included; K for even
    routing; a sequence's loss the same whatever sequences are beside it."""
    import importlib

    module = "mixtral.modeling_mixtral" if family == "mixtral" else "qwen2_moe.modeling_qwen2_moe"
    hf_loss = importlib.import_module(f"transformers.models.{module}").load_balancing_loss_func
    torch.manual_seed(3)
    mixtures = [MixtureOfExperts(8, 12, 6, 2, balance=0.25, block=b).double() for b in range(2)]
    x = torch.randn(3, 7, 8, dtype=torch.float64, requires_grad=True)
    first = mixtures[0](x)
    hidden = mixtures[1](first)
    model = torch.nn.Sequential(*mixtures)
    ours = balance_loss(model)
    inputs = [x, first]
    expected = torch.stack(
        [
            0.25
            * torch.stack(
                [hf_loss((m.router(h[b]),), num_experts=6, top_k=2) for m, h in zip(mixtures, inputs)]
            ).mean()
            for b in range(3)
        ]
    )
    # (Hugging Face counts the routed shares in float32: f_e = n/7 to float32's precision)
    expected = expected.to(torch.float64)
    assert ours.shape == (3,) and torch.allclose(ours, expected, rtol=1e-6, atol=0), (ours, expected)
    grads = torch.autograd.grad(ours.sum(), [x, mixtures[0].router.weight], retain_graph=True)
    references = torch.autograd.grad(expected.sum(), [x, mixtures[0].router.weight])
    for grad, reference in zip(grads, references):
        assert (grad - reference).abs().max() <= 1e-6 * reference.abs().max(), (grad - reference).abs().max()
    assert balance_loss(model) is None and hidden.shape == x.shape  # taken once per forward
    even = MixtureOfExperts(8, 12, 4, 2, balance=1.0).double()
    torch.nn.init.zeros_(even.router.weight)  # every probability 1/E; top-k picks the first K experts
    even(torch.randn(1, 4, 8, dtype=torch.float64))
    assert torch.allclose(even.balance, torch.tensor([2.0 * 4 / 2 * 0.5], dtype=torch.float64))


def test_each_expert_s_tokens_are_counted_once_with_checkpointed_blocks():
    """Every training forward adds each token's K choices to its mixture's counts (eval ones do not); a block that
    activation checkpointing runs again in the backward pass is not counted twice."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = Llama(VOCAB, context=16, experts=4, experts_per_token=2, moe_every=2, **SHAPE)
    ids = torch.randint(0, VOCAB, (3, 16))
    x = model[0](ids)
    for block in list(model)[1:3]:
        x = checkpoint(block, x, use_reentrant=False)
    x.square().sum().backward()
    counts = routed_tokens(model)
    assert list(counts) == [1] and int(counts[1].sum()) == 3 * 16 * 2, counts  # block 1 alone is a mixture
    assert routed_tokens(model) == {}  # read and reset
    model.eval()
    model(ids)
    assert routed_tokens(model) == {}


def test_where_labels_are_masked_a_sequence_s_balance_counts_by_its_trained_tokens():
    """A (sum, count) token loss is divided by the global batch's trained tokens: each sequence's balance is
    weighed by its share of them, so that the step minimises sum_b c_b balance_b / sum_b c_b on any layout
    (c_b its trained tokens over T), the plain mean where nothing is masked."""
    from polytrain.objective import Objective

    objective = Objective(kind="language")
    balance = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    targets = torch.tensor([[1, 2, 3, 4], [-100, -100, 5, 6], [-100, -100, -100, -100]])
    objective.counted = True
    weighed = objective.weighed_balance(balance, targets, torch.nn.Linear(1, 1))
    assert float(weighed) == 1.0 * 1 + 2.0 * 0.5 + 4.0 * 0
    objective.counted = False  # labels never masked: each sequence once
    assert float(objective.weighed_balance(balance, targets, torch.nn.Linear(1, 1))) == 7.0


def _exchange_on_rank(rank, world):
    """Every rank's tokens through 8 experts split over the `world` ranks (parallel/experts.py), against the same
    experts whole on each rank: outputs, the tokens' gradients, and each rank's experts' gradients, the mean over
    the ranks of each rank's tokens' gradient (as ranks' copies of a parameter average theirs)."""
    from torch.distributed.device_mesh import init_device_mesh

    from polytrain.parallel.experts import apply_expert_parallel

    torch.manual_seed(0)
    whole = MixtureOfExperts(8, 12, 8, 2).double()
    split = MixtureOfExperts(8, 12, 8, 2).double()
    split.load_state_dict(whole.state_dict())
    apply_expert_parallel(split, init_device_mesh("cpu", (world,)))
    torch.manual_seed(1 + rank)  # each rank its own tokens; rank 1 routes more of them to rank 0's experts
    x = torch.randn(3 + rank, 5, 8, dtype=torch.float64)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [whole(xs[0]), split(xs[1])]
    for out in outs:
        out.square().sum().backward()
    experts = 8 // world
    rows = slice(rank * experts, (rank + 1) * experts)
    sums = [whole.experts.w1.grad.clone(), whole.experts.w2.grad.clone()]
    for total in sums:
        torch.distributed.all_reduce(total)  # every rank's tokens' share of each expert's gradient
    local = [split.experts.w1.grad.to_local(), split.experts.w2.grad.to_local()]
    # compiled as --compile compiles a block (torch's tracer only: the exchange itself runs eager)
    compiled = torch.compile(split, backend="eager", fullgraph=False)(x.clone())
    return {
        "output": (outs[0] - outs[1]).abs().max().item(),
        "compiled": (outs[0] - compiled).abs().max().item(),
        "tokens": (xs[0].grad - xs[1].grad).abs().max().item(),
        "experts": max((sums[i][rows] / world - local[i]).abs().max().item() for i in range(2)),
        "held": tuple(split.experts.w1.to_local().shape),
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_experts_split_over_ranks_compute_what_whole_experts_do(world):
    from distributed import run_on_ranks

    for found in run_on_ranks(_exchange_on_rank, world_size=world):
        assert found["held"] == (8 // world, 12, 8), found
        assert max(found["output"], found["tokens"], found["experts"], found["compiled"]) < 1e-12, found


SMALL = ["--model", "llama", "--dataset", "shakespeare", "--layers", "2", "--width", "32", "--heads", "2", "--kv-heads", "2",
         "--context", "16", "--experts", "4", "--experts-per-token", "2"]  # fmt: skip
VERIFIES = {
    "4 FSDP2 shards of 2 experts (cut along their width)": [
        "--strategy", "sharded", "--devices", "4", "--experts", "2", "--experts-per-token", "1",
    ],
    "2 FSDP2 shards x 2 tensor ranks, experts over 2 ranks, a shared expert, the load-balancing loss, full "
    "checkpointing": [
        "--strategy", "tensor", "--tensor-parallel", "2", "--devices", "4", "--experts", "8", "--expert-parallel",
        "2", "--shared-experts", "1", "--router-aux-loss", "0.5", "--activation-checkpointing", "full",
    ],
    "2 replicas x 2 context ranks, the load-balancing loss, selective checkpointing, 2 passes": [
        "--strategy", "data", "--context-parallel", "2", "--devices", "4", "--router-aux-loss", "0.5",
        "--activation-checkpointing", "selective", "--accumulate", "2",
    ],
    "experts over 2 of 4 DDP copies, the load-balancing loss, full checkpointing, 2 passes": [
        "--strategy", "data", "--devices", "4", "--experts", "8", "--expert-parallel", "2", "--router-aux-loss",
        "0.5", "--activation-checkpointing", "full", "--accumulate", "2",
    ],
    "experts over 2 ranks (2 shards)": [
        "--strategy", "sharded", "--devices", "2", "--experts", "8", "--expert-parallel", "2",
    ],
    "4 FSDP2 shards, experts over 2 of them, selective checkpointing": [
        "--strategy", "sharded", "--devices", "4", "--experts", "8", "--expert-parallel", "2",
        "--activation-checkpointing", "selective",
    ],
    "experts over 4 ranks (4 shards)": [
        "--strategy", "sharded", "--devices", "4", "--experts", "8", "--expert-parallel", "4",
    ],
    "2 copies x 2 shards, experts over 2 ranks, full checkpointing": [
        "--strategy", "sharded", "--devices", "4", "--replicas", "2", "--experts", "8", "--expert-parallel", "2",
        "--activation-checkpointing", "full",
    ],
    "2 shards x 2 context ranks, experts over 2 ranks, the load-balancing loss, selective checkpointing, 2 passes": [
        "--strategy", "sharded", "--devices", "4", "--context-parallel", "2", "--experts", "8",
        "--expert-parallel", "2", "--router-aux-loss", "0.1", "--activation-checkpointing", "selective",
        "--accumulate", "2",
    ],
    "2 pipeline stages x 2 FSDP2 shards, experts over 2 ranks, the load-balancing loss on each stage, full "
    "checkpointing, 2 passes": [
        "--strategy", "pipeline", "--pipeline-stages", "2", "--data-parallel", "shard", "--devices", "4",
        "--experts", "8", "--expert-parallel", "2", "--router-aux-loss", "0.5", "--activation-checkpointing",
        "full", "--accumulate", "2",
    ],
    "2 pipeline stages x 2 context ranks, every other block dense, the load-balancing loss, full checkpointing": [
        "--strategy", "pipeline", "--context-parallel", "2", "--devices", "4", "--moe-every", "2",
        "--router-aux-loss", "0.5", "--activation-checkpointing", "full",
    ],
    "4 interleaved stages on 2 ranks, the load-balancing loss on each": [
        "--strategy", "pipeline", "--devices", "2", "--layers", "4", "--pipeline-schedule", "interleaved-1f1b",
        "--router-aux-loss", "0.5",
    ],
}  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(VERIFIES))
def test_verify_passes_with_mixtures_of_experts(capfd, case):
    done = polytrain_here(capfd, "verify", *SMALL, *VERIFIES[case], "--steps", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert "PASS" in done.stdout and len(rows) == 3 and all(float(row[3]) < 1e-12 for row in rows), (
        done.stdout
    )


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--experts", "4", "--experts-per-token", "5"],
            ["--experts-per-token 5 is more than the 4 experts"],
        ),
        (["--experts", "1"], ["--experts 1: a mixture needs 2 experts or more"]),
        (["--experts-per-token", "2"], ["--experts-per-token describes a mixture of experts; add --experts"]),
        (["--experts", "4", "--shared-experts", "-1"], ["--shared-experts", "-1"]),
        (["--router-aux-loss", "0.02"], ["--router-aux-loss describes a mixture of experts; add --experts"]),
        (["--experts", "4", "--router-aux-loss", "-1"], ["--router-aux-loss", "-1"]),
        (
            ["--experts", "6", "--strategy", "sharded", "--devices", "4", "--expert-parallel", "4"],
            ["--expert-parallel 4 must divide the 6 experts"],
        ),
        (
            ["--experts", "8", "--strategy", "sharded", "--devices", "2", "--expert-parallel", "4"],
            ["--expert-parallel 4", "must divide them (2 here"],
        ),
        (
            ["--experts", "8", "--strategy", "pipeline", "--devices", "4", "--expert-parallel", "2"],
            ["--expert-parallel 2", "none to borrow from", "--strategy pipeline --data-parallel shard"],
        ),
        (
            [
                "--experts",
                "8",
                "--strategy",
                "data",
                "--devices",
                "4",
                "--expert-parallel",
                "2",
                "--context-parallel",
                "2",
            ],
            [
                "--expert-parallel 2 borrows its ranks from DDP's copies beside no context ranks",
                "--strategy sharded",
            ],
        ),
        (
            ["--experts", "8", "--strategy", "data", "--devices", "6", "--expert-parallel", "4"],
            ["--expert-parallel 4", "must divide them (6 here)"],
        ),
        (
            [
                "--experts",
                "4",
                "--router-aux-loss",
                "0.02",
                "--strategy",
                "pipeline",
                "--devices",
                "2",
                "--split-at",
                "layers.1",
            ],
            ["--router-aux-loss is not taken by traced stages (--split-at) yet"],
        ),
    ],
    ids=[
        "more-per-token-than-experts",
        "one-expert",
        "no-experts",
        "negative-shared",
        "balance-without-experts",
        "negative-balance",
        "experts-not-divided",
        "shards-not-divided",
        "experts-over-unsharded-pipelines",
        "experts-over-copies-beside-context-ranks",
        "copies-not-divided",
        "balance-in-traced-stages",
    ],
)
def test_what_makes_no_mixture_is_refused_in_one_line(capsys, tmp_path, argv, words):
    base = ["--model", "llama", "--dataset", "shakespeare", "--max-steps", "1"]
    assert_refused_in_one_line(capsys, tmp_path / "out", base + argv, words)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_pipeline_weighs_each_stage_s_balance_loss_by_the_trained_tokens_of_masked_labels(capfd, tmp_path):
    """Rows with -100 labels (a prompt, padding): the loss is divided by the trained tokens, so each sequence's
    balance counts by its share of them, on every stage as on one device (only the last stage has the loss)."""
    datasets = pytest.importorskip("datasets")
    generator = torch.Generator().manual_seed(0)
    columns = {"input_ids": [], "labels": [], "attention_mask": []}
    for _ in range(24):
        length = int(torch.randint(1, 13, (1,), generator=generator))
        padding = int(torch.randint(0, 4, (1,), generator=generator))
        row = torch.randint(0, 16, (length,), generator=generator).tolist()
        masked = torch.rand(length, generator=generator) < 0.3
        columns["input_ids"].append(row + [0] * padding)
        columns["labels"].append([-100 if m else t for t, m in zip(row, masked)] + [-100] * padding)
        columns["attention_mask"].append([1] * length + [0] * padding)
    folder = tmp_path / "rows"
    datasets.DatasetDict(train=datasets.Dataset.from_dict(columns)).save_to_disk(str(folder))
    done = polytrain_here(
        capfd, "verify", "--model", "llama", "--dataset", "hf", "--data-dir", folder, "--layers", "2",
        "--width", "32", "--heads", "2", "--kv-heads", "2", "--experts", "4", "--experts-per-token", "2",
        "--router-aux-loss", "0.5", "--strategy", "pipeline", "--devices", "2", "--steps", "3",
    )  # fmt: skip
    assert done.returncode == 0 and "PASS" in done.stdout, done.stdout + done.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_pipeline_adds_no_balance_loss_to_the_user_s_own_loss_as_one_device_adds_none():
    # the objective adds the mixtures' balance loss to its built-in token loss only; a loss= of the user's trains
    # what it says on every layout (the stages' parts are not carried into its backward)
    from token_data import PaddedTokens, TokenPairs, token_loss

    import polytrain

    def last(**layout):
        torch.manual_seed(0)
        model = Llama(vocab=11, layers=2, width=32, heads=2, kv_heads=2, context=12, experts=4,
                      experts_per_token=2, router_aux_loss=0.5)  # fmt: skip
        train, val = TokenPairs(PaddedTokens(32)), TokenPairs(PaddedTokens(8, seed=1))
        return polytrain.fit(
            model, train=train, val=val, loss=token_loss, batch_size=8, epochs=1, verbose=False, **layout
        )

    one, pipeline = last().last, last(strategy="pipeline", devices=2).last
    assert "train_balance" not in one and pipeline["train_loss"] == pytest.approx(one["train_loss"], rel=1e-5)


def test_experts_on_a_model_without_them_are_refused(capsys, tmp_path):
    assert_refused_in_one_line(
        capsys,
        tmp_path / "out",
        ["--model", "gpt", "--dataset", "shakespeare", "--experts", "4"],
        ["--experts"],
    )


def test_a_run_with_experts_records_its_routing_samples_and_refuses_forms_hf_lacks(capfd, tmp_path):
    """...and its epoch records the balance apart and the tokens routed to the experts over both ranks: 4 steps
    of 8 sequences of 16 tokens, 2 choices each, 1024 per mixture."""
    import json

    run = tmp_path / "run"
    done = polytrain_here(
        capfd, "train", *SMALL, "--router-aux-loss", "0.5", "--devices", "2", "--strategy", "data",
        "--epochs", "0.0005", "--out", run,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    # W K = 1 where routing is even (the balance counts W = 0.5 in)
    assert 0.8 < record["train_balance"] < 2 and 0.8 < record["val_balance"] < 2, record
    assert 0 <= record["expert_tokens_min"] <= 256 <= record["expert_tokens_max"] <= 1024, record
    assert record["expert_imbalance"] == record["expert_tokens_max"] / 256, record
    assert "balance" in done.stdout and "tokens per expert" in done.stdout
    sampled = polytrain_here(capfd, "generate", run, "--tokens", "8")
    assert sampled.returncode == 0 and sampled.stdout.strip(), sampled.stderr
    # a mixture Mixtral's form cannot hold (a shared expert beside an attention without biases) is refused
    # in one line by --format hf, written by --format safetensors
    shared = tmp_path / "shared"
    done = polytrain_here(
        capfd, "train", *SMALL, "--shared-experts", "1", "--max-steps", "1", "--out", shared
    )
    assert done.returncode == 0, done.stderr
    refused = polytrain_here(capfd, "export", shared, "--format", "hf", "--out", tmp_path / "hf")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "Mixtral's form" in refused.stderr and "shared expert" in refused.stderr
    assert not (tmp_path / "hf").exists()
    weights = polytrain_here(
        capfd, "export", shared, "--format", "safetensors", "--out", tmp_path / "w.safetensors"
    )
    assert weights.returncode == 0, weights.stderr


def test_fewer_experts_than_shards_are_cut_along_their_width():
    """FSDP2 cuts dimension 0 by default: 2 stacked experts over 4 shards would leave two ranks none of them and
    the others half. They are cut along their second dimension instead: rank 0 holds a quarter (the plan builds the
    run's own sharding at full size on fake ranks)."""
    import math

    import polytrain
    from polytrain.models import build_model

    shape = dict(layers=2, heads=4, kv_heads=2, width=64, ffn_width=32, context=16)
    model = build_model("llama", (16,), VOCAB, dict(shape, experts=2))
    expected = 0
    for p in model.parameters():
        if p.dim() == 3:  # [E, F, D] with E < 4: torch.chunk of dimension 1
            expected += 4 * p.shape[0] * math.ceil(p.shape[1] / 4) * p.shape[2]
        else:
            expected += 4 * math.ceil(p.shape[0] / 4) * p[0].numel()
    (row,) = polytrain.plan(
        "llama", devices=4, batch_size=4, vocab_size=VOCAB, layout="dp_shard=4", experts=2, **shape
    )
    assert row["memory_split_gib"]["parameters"] * 2**30 == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe"])
def test_a_moe_config_json_is_planned_with_transformers_parameters(family, tmp_path):
    """`polytrain plan --hf-config` of Mixtral's and Qwen2-MoE's config.json builds the same parameters as
    transformers' model of that config (both on the meta device)."""
    transformers = pytest.importorskip("transformers")
    from polytrain.runtime.plan_report import make_request

    common = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, num_experts_per_tok=2,
    )  # fmt: skip
    if family == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=48, num_local_experts=8, **common)
        architecture = transformers.MixtralForCausalLM
    else:  # every other block dense, a shared expert of 2 experts' width, the kept scores not renormalised
        config = transformers.Qwen2MoeConfig(
            intermediate_size=32, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
            decoder_sparse_step=2, **common,
        )  # fmt: skip
        architecture = transformers.Qwen2MoeForCausalLM
    config.architectures = [architecture.__name__]
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in architecture(config).parameters())
    request = make_request(str(tmp_path), devices=2, batch_size=2, context=16)
    assert sum(p.numel() for p in request.build().parameters()) == theirs
    # the load-balancing loss where transformers adds it (output_router_logits), weighed by its coefficient
    from polytrain.config.pretrained import moe_settings

    settings = config.to_dict()
    assert "router_aux_loss" not in moe_settings(settings, architecture.__name__, "here")
    settings.update(output_router_logits=True, router_aux_loss_coef=0.03)
    assert moe_settings(settings, architecture.__name__, "here")["router_aux_loss"] == 0.03
    # what the llama's mixture does not compute is refused in one line
    config.mlp_only_layers = [0] if family == "qwen2-moe" else None
    config.sliding_window = 4096 if family == "mixtral" else config.sliding_window
    config.save_pretrained(tmp_path)

    with pytest.raises(UserError, match="--hf-config: .*(mlp_only_layers|sliding_window)"):
        make_request(str(tmp_path), devices=2, batch_size=2, context=16)


RESUMED = [
    *("--model", "llama", "--dataset", "shakespeare", "--layers", "2", "--heads", "4", "--kv-heads", "2"),
    *("--width", "32", "--context", "16", "--batch-size", "8", "--optimizer", "adamw", "--lr", "0.01"),
    *("--seed", "5", "--device", "cpu", "--experts", "8", "--experts-per-token", "2"),
]


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_a_run_with_experts_split_over_4_ranks_resumes_over_2_and_on_whole_copies_as_the_straight_run(
    tmp_path, capfd
):
    """2 steps with the experts over 4 ranks, 2 more over 2, 2 more on 2 data-parallel copies (every rank all the
    experts), 2 more on 2 DDP copies with the experts split over them, then 2 more on one device: the weights of 10
    steps on one device (the checkpoint holds the one-device names and shapes)."""
    from conftest import load_weights

    straight, out = tmp_path / "straight", tmp_path / "run"
    done = polytrain_here(capfd, "train", *RESUMED, "--max-steps", "10", "--out", straight)
    assert done.returncode == 0, done.stderr
    theirs = load_weights(straight / "model.pt")
    split = ["--strategy", "sharded", "--devices", "4", "--expert-parallel", "4"]
    done = polytrain_here(capfd, "train", *RESUMED, *split, "--max-steps", "2", "--out", out)
    assert done.returncode == 0 and "experts split over 4 ranks" in done.stdout, done.stdout + done.stderr
    halved = ["--strategy", "sharded", "--devices", "2", "--expert-parallel", "2"]
    done = polytrain_here(capfd, "train", "--resume", out, *halved, "--max-steps", "4")
    assert done.returncode == 0 and "experts split over 2 ranks" in done.stdout, done.stdout + done.stderr
    done = polytrain_here(
        capfd, "train", "--resume", out, "--strategy", "data", "--devices", "2", "--max-steps", "6"
    )
    assert done.returncode == 0 and "expert parallel" not in done.stdout, done.stdout + done.stderr
    copies = ["--strategy", "data", "--devices", "2", "--expert-parallel", "2"]
    done = polytrain_here(capfd, "train", "--resume", out, *copies, "--max-steps", "8")
    assert done.returncode == 0 and "experts split over 2 ranks" in done.stdout, done.stdout + done.stderr
    done = polytrain_here(
        capfd, "train", "--resume", out, "--strategy", "single", "--devices", "1", "--max-steps", "10"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ours = load_weights(out / "model.pt")
    assert list(ours) == list(theirs)
    apart = max(float((ours[k] - theirs[k]).abs().max() / theirs[k].abs().max()) for k in theirs)
    assert apart < 1e-5  # float32 sums in another order on each layout


def test_the_cost_model_reads_a_sample_batch_s_routing_and_leaves_the_counts_as_they_were():
    """scaling/workload.py `mixture_fields`: each expert's (token, choice) pairs of one forward of the sample, over
    both mixtures, and the bytes a sample routes; the training counts the epoch record reads are untouched."""
    from polytrain.scaling.workload import mixture_fields

    torch.manual_seed(0)
    model = Llama(
        11, context=12, layers=2, width=32, heads=2, kv_heads=2, experts=4, experts_per_token=2
    ).eval()
    ids = torch.randint(0, 11, (3, 12))
    model.train()(ids)  # a training step's routing, which the epoch's record counts
    before = {
        block: counts.clone() for block, counts in ((b, m.routed) for b, m in enumerate(mixtures(model)))
    }
    model.eval()
    fields = mixture_fields(model, ids)
    assert (fields["mixtures"], fields["experts"]) == (2, 4) and not model.training
    assert fields["routed_bytes"] == 12 * 2 * 32 * 4  # a sample's 12 tokens to 2 experts, 32 floats each
    assert len(fields["routed_counts"]) == 4 and sum(fields["routed_counts"]) == 2 * 3 * 12 * 2
    after = {b: m.routed for b, m in enumerate(mixtures(model))}
    assert all(torch.equal(before[b], after[b]) for b in before)
