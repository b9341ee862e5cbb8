"""The matrix: every model on every layout it can take, for two steps, with nothing of torch's internals reaching
the user (no error, no warning); what a model cannot take is refused in one line before any worker starts.

Models: polytrain's (lenet, lenet5, mlp, cifar-cnn, resnet, gpt on the built-in text, llama on token shards that
`polytrain tokenize` writes before the launch, and llama-moe: the llama with mixtures of experts) by name, and torch-only ones given to
`polytrain.fit` (tests/matrix_models.py: nn.TransformerEncoderLayer blocks, pytorch/examples' sequence-first
LSTM with a step=, Hugging Face's LlamaForCausalLM where transformers is installed). Layouts: one device; data,
sharded, pipeline, parameter-server, tensor and context parallelism on 2 processes, and for llama-moe its experts
split over 2 sharded processes (expert parallelism, tried on no other model); on 4, 2 replicas x 2 pipeline
stages, 2 stages x 2 tensor ranks, 2 FSDP2 replicas x 2 tensor ranks, 2 FSDP2 shards x 2 stages, hybrid sharding
(2 replicas of 2 shards) and 2 stages x 2 context ranks. The tensor layouts need a tensor plan: the built-in ones
(mlp, gpt, llama) or the one given to fit for the Hugging Face Llama (its MLPs split); the context layouts a model
whose sequences polytrain splits (gpt, llama).

The cross product is chosen, not complete, so that the launch stays within a few minutes on 2 cores:
- every model on every layout it takes, with the defaults (fp32, no activation checkpointing);
- the models with blocks to checkpoint, the transformers (gpt, llama, encoder, hf-llama), on every layout also
  with checkpointing and reduced precision, in two more runs that together take every mode and precision:
  full with one of bf16 and fp16, selective with the other, alternating from layout to layout, so that each
  mode meets each precision too;
- the other models with each reduced precision once: bf16 on one device, fp16 (its loss scaling and skipped
  steps agreed between ranks) on two sharded processes;
- `EXPECTED_REFUSALS`: each thing a model cannot take, once, with the words of its refusal.

All runs share one launch of four processes (tests/matrix_runs.py), since starting processes costs more than
the runs themselves: single runs and refusals one per process, two-process runs on processes {0, 1} and
{2, 3} side by side, then the four-process meshes.
"""

import json
import re
import sys
from pathlib import Path

import pytest
from processes import finish_all, start

import polytrain
from polytrain.data.corpus import tokenize_corpus

SHAKESPEARE = Path(polytrain.__file__).with_name("data") / "shakespeare" / "input.txt"
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

try:
    import transformers  # noqa: F401

    HAS_TRANSFORMERS = True
except ImportError:
    HAS_TRANSFORMERS = False

SYNTHETIC = ["--dataset", "synthetic", "--synthetic-size", "64"]
IMAGES = [*SYNTHETIC, "--synthetic-shape", "3,32,32"]
TEXT = ["--dataset", "shakespeare", "--layers", "2", "--width", "32", "--heads", "2", "--context", "16"]
TOKENS = "<token shards>"  # the folder the fixture writes with polytrain tokenize, before the launch
LLAMA = ["--dataset", "tokens", "--data-dir", TOKENS, *TEXT[2:], "--kv-heads", "2"]
# the llama with a mixture of experts in every other block (a shared expert beside them), models/moe.py
MOE = ["--experts", "4", "--experts-per-token", "2", "--shared-experts", "1", "--moe-every", "2"]
DATA = {"cifar-cnn": IMAGES, "resnet": IMAGES, "gpt": TEXT, "llama": LLAMA, "llama-moe": LLAMA + MOE}
BUILT_IN = ["lenet", "lenet5", "mlp", "cifar-cnn", "resnet", "gpt", "llama", "llama-moe"]
NAMES = {"llama-moe": "llama"}  # --model of a case whose name says its flags
TORCH_ONLY = ["encoder", "lstm", "hf-llama"]  # tests/matrix_models.py, trained through polytrain.fit
BLOCKS = [
    "gpt",
    "llama",
    "encoder",
    "hf-llama",
]  # models with blocks that activation checkpointing recomputes
PLANNED = [
    "mlp",
    "gpt",
    "llama",
    "llama-moe",
    "hf-llama",
]  # models with a tensor plan: the built-in ones, and hf-llama's given to fit
UNSPLIT = ["encoder", "lstm", "hf-llama"]  # models the pipeline cannot split (refused below)
MESHLESS = ["lenet5"]  # (LeNet with other layer sizes: its layouts of 2 processes are enough)

LAYOUTS = {  # name: (strategy and its settings, processes)
    "single": ("single", 1),
    "data": ("data", 2),
    "sharded": ("sharded", 2),
    "pipeline": ("pipeline", 2),
    "parameter-server": ("parameter-server", 2),
    "tensor": ("tensor", 2),
    "pipeline-2x2": ("pipeline --pipeline-stages 2", 4),  # 2 replicas x 2 stages
    "pipeline-tensor": ("pipeline --pipeline-stages 2 --tensor-parallel 2", 4),  # 2 stages x 2 tensor ranks
    "tensor-2x2": ("tensor --tensor-parallel 2", 4),  # 2 replicas (FSDP2) x 2 tensor ranks
    "pipeline-shards": ("pipeline --pipeline-stages 2 --data-parallel shard", 4),  # 2 FSDP2 shards x 2 stages
    "hybrid": ("sharded --replicas 2", 4),  # 2 replicas of 2 FSDP2 shards
    "context": ("data --context-parallel 2", 2),  # each sequence split over 2 ranks
    "pipeline-context": ("pipeline --context-parallel 2", 4),  # 2 stages x 2 context ranks
    "experts": ("sharded --expert-parallel 2", 2),  # each mixture's experts split over the 2 shards
    "experts-data": ("data --expert-parallel 2", 2),  # ... over 2 DDP copies
    "experts-tensor": (
        "tensor --tensor-parallel 2 --expert-parallel 2",
        4,
    ),  # 2 shards x 2 tensor ranks, EP 2
    "experts-pipeline": ("pipeline --pipeline-stages 2 --data-parallel shard --expert-parallel 2", 4),
}
EXPERTS = [
    "experts",
    "experts-data",
    "experts-tensor",
    "experts-pipeline",
]  # layouts only a model with mixtures of experts takes (the others are not tried there)
TENSOR = ["tensor", "pipeline-tensor", "tensor-2x2", "experts-tensor"]
PIPELINE = [
    "pipeline",
    "pipeline-2x2",
    "pipeline-tensor",
    "pipeline-shards",
    "pipeline-context",
    "experts-pipeline",
]
CONTEXT = ["context", "pipeline-context"]
SEQUENCES = [
    "gpt",
    "llama",
    "llama-moe",
]  # models whose sequences --context-parallel splits (refused below for the others)
SETTINGS = {
    ("mlp", "pipeline-tensor"): "--split 4"
}  # (its Linears 1 and 3 split the hidden units between them)

# What a model cannot take, each once, in words of its one line. A model refused a tensor plan (or a pipeline)
# is refused it on the layouts with more dimensions for the same reason, and is not tried there.
NO_PLAN = "tensor needs a plan for"
CHECKPOINTS_NOTHING = "is made of torch.nn layers only, where recomputing a layer saves nothing"
EXPECTED_REFUSALS = {
    ("lenet", "tensor", ""): f"{NO_PLAN} LeNet",
    ("lenet5", "tensor", ""): f"{NO_PLAN} LeNet5",
    ("cifar-cnn", "tensor", ""): f"{NO_PLAN} CifarCNN",
    ("resnet", "tensor", ""): f"{NO_PLAN} ResNet20",
    ("encoder", "tensor", ""): f"{NO_PLAN} EncoderLM",
    ("lstm", "tensor", ""): f"{NO_PLAN} RNNModel",
    ("encoder", "pipeline", ""): "the pipeline strategy splits an nn.Sequential, and EncoderLM is not one",
    ("lstm", "pipeline", ""): "computes the loss on its last stage from the model's outputs and the targets, "
    "which step= does not give",
    (
        "hf-llama",
        "pipeline",
        "",
    ): "computes the loss on its last stage from the model's outputs and the targets, "
    "which a model that returns its own loss does not give",
    ("lenet", "context", ""): "--context-parallel splits the sequences of --model gpt and llama; LeNet",
    ("encoder", "context", ""): "EncoderLM has no attention that polytrain can split (its blocks.0.self_attn "
    "(MultiheadAttention) attends over the whole sequence",
    ("lenet", "single", "--activation-checkpointing full"): f"LeNet {CHECKPOINTS_NOTHING}",
    ("lenet5", "single", "--activation-checkpointing full"): f"LeNet5 {CHECKPOINTS_NOTHING}",
    ("mlp", "single", "--activation-checkpointing full"): f"MLP {CHECKPOINTS_NOTHING}",
    ("cifar-cnn", "single", "--activation-checkpointing selective"): f"CifarCNN {CHECKPOINTS_NOTHING}",
    ("lstm", "single", "--activation-checkpointing selective"): f"RNNModel {CHECKPOINTS_NOTHING}",
    (
        "resnet",
        "single",
        "--activation-checkpointing full",
    ): "holds BatchNorm, whose running statistics would then update twice per step",
}

# Defects found, each with its cause: the case stays in the matrix, and passes once the defect is fixed.
FSDP2_STEP = (
    "the step= calls the model's init_hidden, which makes the hidden state with next(self.parameters())"
    ".new_zeros(...): under FSDP2 the parameters outside forward are DTensor shards, so the LSTM gets a DTensor "
    "hidden state; the first step stops with one line saying so (objective.py shards_outside_forward)"
)
KNOWN = {
    ("lstm", "sharded", ""): FSDP2_STEP,
    ("lstm", "sharded", "--precision fp16"): FSDP2_STEP,
    ("lstm", "hybrid", ""): FSDP2_STEP,
}


def takes(model: str, layout: str) -> bool:
    """Whether `model` trains on `layout` (else it is refused there: `EXPECTED_REFUSALS`)."""
    refused_plan = layout in TENSOR and model not in PLANNED
    refused_split = layout in CONTEXT and model not in SEQUENCES
    experts = layout not in EXPERTS or model == "llama-moe"
    return (
        experts and not refused_plan and not refused_split and not (layout in PIPELINE and model in UNSPLIT)
    )


def reduced(index: int) -> list:
    """The runs of a model with blocks beside its default one on the `index`-th layout: each checkpointing mode
    with one of the reduced precisions, the pairing turned round on every other layout."""
    precisions = ["bf16", "fp16"] if index % 2 == 0 else ["fp16", "bf16"]
    return [
        f"--activation-checkpointing {mode} --precision {precision}"
        for mode, precision in zip(["full", "selective"], precisions)
    ]


def matrix() -> list:
    cases = []
    for index, layout in enumerate(LAYOUTS):
        four = LAYOUTS[layout][1] == 4
        taken = [
            model
            for model in BUILT_IN + TORCH_ONLY
            if takes(model, layout) and not (four and model in MESHLESS)
        ]
        cases += [(model, layout, "") for model in taken]
        for turn, model in enumerate(model for model in taken if model in BLOCKS):
            both = reduced(index)
            cases += [
                (model, layout, options) for options in (both[turn % 2 : turn % 2 + 1] if four else both)
            ]
    for model in BUILT_IN + TORCH_ONLY:
        if model not in BLOCKS:
            cases += [(model, "single", "--precision bf16"), (model, "sharded", "--precision fp16")]
    return cases + list(EXPECTED_REFUSALS)


CASES = matrix()
WARNING = re.compile(r"Warning\b|\bWARN")


def marks(case) -> list:
    if case[0] == "hf-llama" and not HAS_TRANSFORMERS:
        return [pytest.mark.skip(reason="needs transformers")]
    if case in KNOWN:
        return [pytest.mark.xfail(strict=True, reason=KNOWN[case])]
    return []


def argv(model: str, layout: str, options: str) -> list:
    """The run's arguments after its model: polytrain train's flags (fit's keywords for a torch-only model)."""
    strategy, devices = LAYOUTS[layout]
    data = [] if model in TORCH_ONLY else DATA.get(model, SYNTHETIC)
    extra = f"{options} {SETTINGS.get((model, layout), '')}".split()
    return [
        NAMES.get(model, model),
        *data,
        "--batch-size",
        "16",
        "--max-steps",
        "2",
        "--strategy",
        *strategy.split(),
        *extra,
        "--devices",
        str(devices),
        "--device",
        "cpu",
    ]


def plan(folder: Path, cases: list) -> dict:
    """Groups for four processes: single runs and refusals (each in a process of its own, which refuses before
    it starts workers) one per process, two-process runs on processes {0, 1} and {2, 3} in turn, then the
    four-process meshes."""
    groups = [{"processes": [p], "runs": []} for p in range(4)] + [
        {"processes": [0, 1], "runs": []},
        {"processes": [2, 3], "runs": []},
        {"processes": [0, 1, 2, 3], "runs": []},
    ]
    alone = pairs = 0
    for case in cases:
        processes = LAYOUTS[case[1]][1]
        if processes == 1 or case in EXPECTED_REFUSALS:
            groups[alone % 4]["runs"].append(case)
            alone += 1
        elif processes == 2:
            groups[4 + pairs % 2]["runs"].append(case)
            pairs += 1
        else:
            groups[6]["runs"].append(case)
    return {"folder": str(folder), "groups": groups}


@pytest.fixture(scope="module")
def printed(tmp_path_factory) -> dict:
    """What each case printed, all processes together, and its exit codes: case -> (codes, lines on stderr,
    lines on stdout)."""
    folder = tmp_path_factory.mktemp("matrix")
    text = folder / "corpus.txt"
    text.write_text(SHAKESPEARE.read_text()[:100_000])
    tokenize_corpus([str(text)], str(folder / "tokens"), vocab_size=300, val_fraction=0.05, show=False)
    layout = plan(folder, [case for case in CASES if HAS_TRANSFORMERS or case[0] != "hf-llama"])
    cases = [case for group in layout["groups"] for case in group["runs"]]
    for group in layout["groups"]:
        group["runs"] = [
            [str(folder / "tokens") if arg == TOKENS else arg for arg in argv(*case)]
            for case in group["runs"]
        ]
    (folder / "plan.json").write_text(json.dumps(layout))
    helper = Path(__file__).with_name("matrix_runs.py")
    processes = [start([sys.executable, helper, folder / "plan.json", p]) for p in range(4)]
    finished = finish_all(processes, timeout=600)
    found = {case: ([], [], []) for case in cases}
    for process, done in enumerate(finished):
        case = None
        for line in done.stdout.splitlines():
            opened = re.match(r"matrix-run (\d+): ", line)
            if opened:
                case = cases[int(opened.group(1)) - 1]
            elif case is not None:
                found[case][2].append(line)
        case = None
        for line in done.stderr.splitlines():
            opened = re.match(r"matrix-run (\d+): ", line)
            closed = re.match(r"matrix-exit (\d+): (-?\d+)", line)
            if opened:
                case = cases[int(opened.group(1)) - 1]
            elif closed:
                found[cases[int(closed.group(1)) - 1]][0].append(int(closed.group(2)))
                case = None
            elif case is not None:
                found[case][1].append(line)
        if case is not None:
            found[case][1].append(f"(process {process} ended in this run, with exit code {done.returncode})")
    return found


def case_id(case) -> str:
    model, layout, options = case
    return "-".join([model, layout, *options.split()[1::2]])


@pytest.mark.parametrize(
    "case",
    [pytest.param(case, marks=marks(case)) for case in CASES if case not in EXPECTED_REFUSALS],
    ids=case_id,
)
def test_trains_without_a_word_from_torch(printed, case):
    codes, lines, _ = printed[case]
    assert codes == [0] * LAYOUTS[case[1]][1], "\n".join(lines)
    assert not [line for line in lines if WARNING.search(line)], "\n".join(lines)


@pytest.mark.parametrize(
    "case", [pytest.param(case, marks=marks(case)) for case in EXPECTED_REFUSALS], ids=case_id
)
def test_refused_in_one_line_before_workers_start(printed, case):
    codes, lines, _ = printed[case]
    assert codes == [2] and len(lines) == 1, "\n".join(lines)
    assert lines[0].startswith("polytrain: error: ") and "worker rank" not in lines[0], lines[0]
    assert EXPECTED_REFUSALS[case] in lines[0]


def lacks_lstm_kernel(precision: str) -> bool:
    """Whether this processor's kernels cannot run an LSTM under autocast at `precision`, asked of torch (oneDNN
    has no LSTM primitive for bf16 or fp16 on a CPU without bf16 instructions, such as an AMD EPYC of the Zen 2
    or 3 generations)."""
    import torch

    try:
        with torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16" else torch.float16):
            torch.nn.LSTM(8, 8)(torch.randn(5, 3, 8))
    except RuntimeError:
        return True
    return False


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(case, marks=marks(case))
        for case in CASES
        if case[0] == "lstm" and "--precision" in case[2] and case not in EXPECTED_REFUSALS
    ],
    ids=case_id,
)
def test_an_lstm_runs_in_float32_where_this_processor_lacks_its_reduced_kernel_and_says_so(printed, case):
    """Where the processor has the kernel, the LSTM trains in the reduced precision and nothing is said; where it
    lacks it (tests/test_precision.py makes such a processor), the LSTM runs in float32 and one line says so."""
    codes, _, out = printed[case]
    precision = case[2].split()[-1]
    said = [line for line in out if line.startswith(f"--precision {precision}: this processor has no ")]
    assert codes == [0] * LAYOUTS[case[1]][1]
    assert len(said) == (1 if lacks_lstm_kernel(precision) else 0), "\n".join(out)
