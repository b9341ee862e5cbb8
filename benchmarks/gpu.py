"""Everything polytrain measures on one CUDA GPU, in one run that writes its results to a folder.

    python benchmarks/gpu.py --out gpu-results            # all parts but control, about 4 minutes on an H200
    python benchmarks/gpu.py --out DIR --parts graphs,gpt # some of them

Parts (each writes JSON rows to DIR/results.jsonl and prints them):

- env: the GPU, driver, torch and CUDA versions.
- tests: `pytest tests/test_cuda.py` (CUDA graphs against eager steps among them), run beside `paths`.
- paths: every strategy and option at one rank on CUDA as `polytrain train` commands (NCCL), each one's exit
  status and last line; a sharded checkpoint written and resumed; a torch Dataset with pinned memory; verify.
- graphs: LeNet on 60,000 synthetic images, samples/s of the training pass at batch 64 and 512, eager and with
  CUDA graphs (best epoch of three after the first), and the GPT's tokens/s both ways.
- accuracy: time to 97% and 99% validation accuracy of LeNet on mnist-sample, on the GPU and on the CPU (the
  classic CPU-versus-GPU table), training passes only.
- gpt: nanoGPT's GPU configuration (6 layers, 6 heads, width 384, context 256, 64 sequences, AdamW lr 1e-3,
  cosine, clipping) on Shakespeare in bf16: tokens/s, model FLOPs utilisation against a measured bf16 matmul,
  and training seconds to each validation loss.
- llama: a Llama-style model with and without activation checkpointing and bf16, peak GPU memory measured
  (`max_memory_allocated`, reserved) against the memory check's prediction for the same layout, and tokens/s.
- bench: `polytrain bench --device cpu,cuda --devices 1`.
- plan: the planner against real runs: `polytrain plan`'s memory and tokens/s on one GPU of this kind for Llama 3
  8B's blocks at 32, 16 and 8 layers (`--plan batch,context`, default 2 sequences of 2048 tokens, bf16, AdamW,
  the checkpointing the plan chooses), and the first two shapes it says fit trained as planned for 8 steps, their
  peak allocated memory and tokens/s beside the prediction.
- control (only when named): how far two eager runs of a BatchNorm ResNet end apart on the GPU against a
  graphed and an eager run, with cuDNN's default and deterministic kernels; and what a finished graphed run
  leaves allocated.

`--parts` picks parts (plan always runs first, before anything else touches the GPU's memory, then llama);
`--paths` picks path cases by words in their names. Results of 2026-11-26: docs/benchmarks.md, "GPU (2026-11-26,
one H200)".
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import polytrain

ROOT = Path(__file__).resolve().parent.parent
OUT: Path = Path(".")
ONLY: list = []  # --paths: the path cases whose names contain one of these (all where empty)


def emit(part: str, **row) -> dict:
    row = {"part": part, **row}
    line = json.dumps(row, default=str)
    print(line, flush=True)
    with open(OUT / "results.jsonl", "a") as f:
        f.write(line + "\n")
    return row


def guarded(part):
    """Run a part; a failure is a row of its own, not the end of the whole run."""

    def run(fn):
        def wrapped(*args, **kwargs):
            began = time.perf_counter()
            try:
                fn(*args, **kwargs)
            except Exception as error:  # noqa: BLE001
                emit(part, error=f"{type(error).__name__}: {error}"[:2000])
            emit(part, done_seconds=round(time.perf_counter() - began, 1))

        return wrapped

    return run


@guarded("env")
def env():
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    emit(
        "env",
        gpu=torch.cuda.get_device_name(0),
        nvidia_smi=smi,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        python=sys.version.split()[0],
        cpus=os.cpu_count(),
    )


def start_tests():
    log = open(OUT / "pytest.txt", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "tests/test_cuda.py", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def path_cases(tmp: Path) -> dict:
    train = [sys.executable, "-m", "polytrain", "train", "--device", "cuda", "--epochs", "1"]
    lenet = train + ["--dataset", "synthetic", "--synthetic-size", "1024"]
    gpt = train + ["--model", "gpt", "--dataset", "shakespeare", "--epochs", "0.05"]
    cases = {
        "single": lenet,
        "single --no-cuda-graphs": lenet + ["--no-cuda-graphs"],
        "data": lenet + ["--strategy", "data"],
        "sharded": lenet + ["--strategy", "sharded"],
        "sharded --cpu-offload": lenet + ["--strategy", "sharded", "--cpu-offload"],
        "sharded bf16 (MixedPrecisionPolicy)": lenet + ["--strategy", "sharded", "--precision", "bf16"],
        "pipeline": lenet + ["--strategy", "pipeline"],
        "parameter-server --server-device cpu": lenet + ["--strategy", "parameter-server"],
        "tensor (mlp)": lenet + ["--strategy", "tensor", "--model", "mlp"],
        "accumulate 2 + clip": lenet + ["--accumulate", "2", "--clip-grad-norm", "1.0"],
        "fp16 loss scaling": lenet + ["--precision", "fp16"],
        "bf16": lenet + ["--precision", "bf16"],
        "resnet (BatchNorm)": train + ["--model", "resnet", "--dataset", "synthetic", "--synthetic-shape", "3,32,32"],
        "cifar-cnn (dropout: graphs off)": train
        + ["--model", "cifar-cnn", "--dataset", "synthetic", "--synthetic-shape", "3,32,32"],
        "gpt": gpt,
        "gpt activation checkpointing full": gpt + ["--activation-checkpointing", "full"],
        "gpt sharded bf16": gpt + ["--strategy", "sharded", "--precision", "bf16"],
        "llama tiny": train + ["--model", "llama", "--dataset", "shakespeare", "--epochs", "0.05"],
        "sharded checkpoint": lenet + ["--strategy", "sharded", "--out", str(tmp / "ckpt"), "--max-steps", "5"],
        "sharded --cpu-offload checkpoint": lenet
        + ["--strategy", "sharded", "--cpu-offload", "--out", str(tmp / "ckpt-offload"), "--max-steps", "5"],
        "verify data": [sys.executable, "-m", "polytrain", "verify", "--device", "cuda", "--devices", "1",
                        "--strategy", "data", "--steps", "5"],
    }  # fmt: skip
    dataset = (
        "import torch, polytrain;"
        "d=torch.utils.data.TensorDataset(torch.randn(512,1,28,28),torch.randint(0,10,(512,)));"
        "d.classes=list(range(10));"
        "h=polytrain.fit('lenet',train=d,val=d,epochs=1,device='cuda',verbose=False,num_workers=2);"
        "print('val_acc',h.last['val_acc'])"
    )
    cases["torch Dataset, pinned memory, 2 loader workers"] = [sys.executable, "-c", dataset]
    offload = (
        "import torch, torch.distributed as dist;"
        "from torch.distributed.fsdp import fully_shard, CPUOffloadPolicy;"
        "from polytrain.models import build_model;"
        f"dist.init_process_group('nccl', store=dist.FileStore('{tmp}/store', 1), rank=0, world_size=1);"
        "torch.cuda.set_device(0);"
        "m = build_model('lenet', (1, 28, 28), 10);"
        "[fully_shard(l, offload_policy=CPUOffloadPolicy()) for l in m if list(l.parameters())];"
        "fully_shard(m, offload_policy=CPUOffloadPolicy());"
        "print('after fully_shard', {n: str(p.device) for n, p in m.named_parameters()});"
        "m(torch.randn(4, 1, 28, 28, device='cuda')).sum().backward();"
        "print('forward and backward ran');"
        "dist.destroy_process_group()"
    )
    cases["FSDP2 CPU offload by hand (no polytrain strategy)"] = [sys.executable, "-c", offload]
    return cases


def run_case(name, argv, env_extra=None):
    began = time.perf_counter()
    try:
        done = subprocess.run(
            argv,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=240,
            env={**os.environ, **(env_extra or {})},
        )
        text = done.stdout + done.stderr
        with open(OUT / "paths.txt", "a") as log:
            log.write(f"\n===== {name}: {' '.join(argv)}\n{text}")
        lines = [line for line in text.strip().splitlines() if line.strip()]
        graphs = [line for line in lines if line.startswith("CUDA graphs")]
        return dict(
            case=name,
            rc=done.returncode,
            seconds=round(time.perf_counter() - began, 1),
            graphs=graphs[:1],
            warnings=[line[:300] for line in lines if "Warning" in line][:3],
            tail=[line[:300] for line in lines[-3:]],
        )
    except subprocess.TimeoutExpired:
        return dict(case=name, rc="timeout", seconds=240)


@guarded("paths")
def paths():
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cases = path_cases(tmp)
        if ONLY:
            cases = {name: argv for name, argv in cases.items() if any(word in name for word in ONLY)}
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            for row in pool.map(lambda item: run_case(*item), cases.items()):
                emit("paths", **row)
        for folder in ("ckpt", "ckpt-offload"):
            if (tmp / folder).exists():
                resume = [sys.executable, "-m", "polytrain", "train", "--resume", str(tmp / folder)]
                emit("paths", **run_case(f"{folder} resumed", resume))


def lenet_throughput(batch_size, **settings):
    data = polytrain.load_dataset("synthetic", synthetic_size=60000)
    history = polytrain.fit(
        "lenet", data, epochs=4, batch_size=batch_size, device="cuda", verbose=False,
        schedule="constant", warmup_epochs=0, lr=0.01, **settings,
    )  # fmt: skip
    rates = [r["samples_per_second"] for r in history.epochs[1:]]
    return round(max(rates)), round(sorted(rates)[len(rates) // 2]), history.epochs[-1]["train_loss"]


@guarded("graphs")
def graphs():
    for batch_size in (64, 512):
        for graphs_on in (False, True, False, True):
            best, median, loss = lenet_throughput(batch_size, cuda_graphs=graphs_on)
            emit("graphs", model="lenet", batch_size=batch_size, cuda_graphs=graphs_on,
                 samples_per_second=best, median=median, last_train_loss=loss)  # fmt: skip
    for precision in ("fp32", "bf16"):
        for graphs_on in (False, True):
            history = polytrain.fit(
                "gpt", polytrain.load_dataset("shakespeare", context=256), epochs=3, batch_size=64,
                layers=6, heads=6, width=384, context=256, precision=precision, device="cuda",
                verbose=False, cuda_graphs=graphs_on,
            )  # fmt: skip
            emit("graphs", model="gpt 6x384 ctx 256 batch 64", precision=precision, cuda_graphs=graphs_on,
                 tokens_per_second=round(max(r["tokens_per_second"] for r in history.epochs[1:])))  # fmt: skip
    # where a graphed LeNet step at batch 512 spends the host's time: one epoch under the profiler
    from torch.profiler import ProfilerActivity, profile

    data = polytrain.load_dataset("synthetic", synthetic_size=60000)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        polytrain.fit("lenet", data, epochs=1, batch_size=512, device="cuda", verbose=False)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    (OUT / "profile.txt").write_text(table)


def time_to(history, key, target, better=max):
    elapsed = 0.0
    for record in history.epochs:
        elapsed += record["epoch_seconds"]
        if (record[key] >= target) if better is max else (record[key] <= target):
            return record["epoch"], round(elapsed, 2)
    return None, None


@guarded("control")
def control():
    """How far apart two eager runs of a BatchNorm ResNet end on a GPU, against a graphed run and an eager one,
    with cuDNN's default kernels and with its deterministic ones; and what a finished graphed run leaves on
    the GPU."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import tiny_digits

    torch.backends.cudnn.allow_tf32 = False
    data = tiny_digits(n_train=200, shape=(3, 32, 32))
    for deterministic in (False, True):
        torch.backends.cudnn.deterministic = deterministic
        states = []
        for graphs_on in (True, False, False):
            torch.manual_seed(0)
            net = polytrain.build_model("resnet", data.input_shape, 10)
            polytrain.fit(
                net, data, epochs=2, batch_size=64, device="cuda", verbose=False, cuda_graphs=graphs_on
            )
            states.append(
                {k: v.detach().double().cpu() for k, v in net.state_dict().items() if v.is_floating_point()}
            )

        def gap(a, b):
            return max((a[k] - b[k]).abs().max().item() for k in a)

        emit("control", deterministic=deterministic, graphs_vs_eager=gap(states[0], states[1]),
             eager_vs_eager=gap(states[1], states[2]))  # fmt: skip
    torch.backends.cudnn.deterministic = False
    gc.collect()
    before = torch.cuda.memory_allocated()
    polytrain.fit("gpt", polytrain.load_dataset("shakespeare", context=256), epochs=0.2, batch_size=64,
                  layers=6, heads=6, width=384, context=256, device="cuda", verbose=False)  # fmt: skip
    after = torch.cuda.memory_allocated()
    gc.collect()
    emit("control", allocated_before_mib=before / 2**20, after_graphed_fit_mib=after / 2**20,
         after_gc_mib=torch.cuda.memory_allocated() / 2**20)  # fmt: skip


@guarded("accuracy")
def accuracy():
    recipe = dict(batch_size=128, lr=0.1, augment=True)
    runs = [("cuda", "batch 128, lr 0.1, --augment", recipe, 0), ("cuda", "batch 128, lr 0.1, --augment", recipe, 1),
            ("cuda", "defaults", {}, 0), ("cpu", "batch 128, lr 0.1, --augment", recipe, 0)]  # fmt: skip
    for device, name, settings, seed in runs:
        began = time.perf_counter()
        history = polytrain.fit("lenet", "mnist-sample", device=device, seed=seed, epochs=30, verbose=False,
                                **settings)  # fmt: skip
        row = dict(device=device, setting=name, seed=seed, best_val_acc=max(history["val_acc"]),
                   wall_seconds=round(time.perf_counter() - began, 1),
                   train_seconds=round(sum(history["epoch_seconds"]), 2))  # fmt: skip
        for target in (0.97, 0.98, 0.99):
            row[f"to_{target}"] = time_to(history, "val_acc", target)
        emit("accuracy", **row)


def matmul_peak(dtype=torch.bfloat16, n=8192):
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * 10 / (time.perf_counter() - began)


@guarded("gpt")
def gpt(epochs):
    peak = matmul_peak()
    emit("gpt", bf16_matmul_tflops=round(peak / 1e12, 1))
    data = polytrain.load_dataset("shakespeare", context=256)
    model = polytrain.build_model(
        "gpt", data.input_shape, data.num_classes, dict(layers=6, heads=6, width=384, context=256)
    )
    params = sum(p.numel() for p in model.parameters())
    history = polytrain.fit(
        model, data, epochs=epochs, batch_size=64, optimizer="adamw", lr=1e-3, betas=(0.9, 0.99),
        weight_decay=0.1, no_decay_norms_and_biases=True, schedule="cosine", warmup_epochs=1.6,
        clip_grad_norm=1.0, precision="bf16", device="cuda", verbose=False,
    )  # fmt: skip
    tokens = max(r["tokens_per_second"] for r in history.epochs[1:])
    # 6 N per token for the weights, plus attention's 12 L T C per token (nanoGPT's estimate_mfu)
    flops_per_token = 6 * params + 12 * 6 * 256 * 384
    row = dict(params=params, tokens_per_second=round(tokens), mfu=round(tokens * flops_per_token / peak, 4),
               best_val_loss=round(min(history["val_loss"]), 4),
               train_seconds=round(sum(history["epoch_seconds"]), 1))  # fmt: skip
    for target in (1.6, 1.5, 1.47):
        row[f"to_{target}"] = time_to(history, "val_loss", target, better=min)
    row["val_losses"] = [round(v, 3) for v in history["val_loss"]]
    emit("gpt", **row)


class StepClock:
    """Seconds per step after the first two (each step waited for on the GPU)."""

    def __init__(self, device: str = "cuda"):
        self.times = []
        self.device = device

    def on_step_end(self, trainer):
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())

    def seconds(self):
        later = self.times[2:]
        return (later[-1] - later[0]) / (len(later) - 1)


@guarded("llama")
def llama(layers, width):
    from polytrain.parallel.layout import Layout
    from polytrain.planning.memory import memory_per_rank
    from polytrain.scaling.fits import measured_activations, model_workload

    data = polytrain.load_dataset("shakespeare", context=1024)
    sizes = dict(layers=layers, width=width, heads=width // 128, kv_heads=width // 256, context=1024)
    for precision in ("fp32", "bf16"):
        for mode in ("none", "full"):
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            with torch.device("meta"):
                model = polytrain.build_model("llama", data.input_shape, data.num_classes, sizes)
            try:
                profile = measured_activations(model, data, torch.device("cuda"))
            except Exception:  # noqa: BLE001
                profile = measured_activations(model, data, torch.device("cpu"))
            work = model_workload(model, batch_size=8, **profile)
            predicted = memory_per_rank(work, Layout(), optimizer_slots=2, checkpointing=mode)
            clock = StepClock()
            history = polytrain.fit(
                "llama", data, epochs=1, max_steps=6, batch_size=8, optimizer="adamw", lr=1e-4,
                precision=precision, activation_checkpointing=mode, device="cuda", verbose=False,
                callbacks=[clock], cuda_graphs=False, **sizes,
            )  # fmt: skip
            emit("llama", params=sum(p.numel() for p in model.parameters()), precision=precision,
                 checkpointing=mode, predicted_gib=round(predicted / 2**30, 2),
                 max_allocated_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                 max_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2),
                 tokens_per_second=round(8 * 1024 / clock.seconds()), train_loss=history.validations[-1]["train_loss"])  # fmt: skip
            del model, history


# Llama 3 8B's blocks (its width, heads and MLP), deepest first: the planner's check trains the first shapes that
# `polytrain plan` says fit one GPU of this kind
PLANNED = {
    "8b": dict(layers=32, width=4096, heads=32, kv_heads=8, ffn_width=14336),
    "8b-16-layers": dict(layers=16, width=4096, heads=32, kv_heads=8, ffn_width=14336),
    "8b-8-layers": dict(layers=8, width=4096, heads=32, kv_heads=8, ffn_width=14336),
}


def gpu_kind() -> str:
    """The `--gpu` name of the GPU here (h100 where none matches)."""
    name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else ""
    known = [
        ("h200", "h200"),
        ("h100 pcie", "h100-pcie"),
        ("h100", "h100"),
        ("a100", "a100-80gb"),
        ("l40s", "l40s"),
    ]
    return next((kind for words, kind in known if words in name), "h100")


def planned(shape: dict, *, gpu: str, batch: int, context: int, vocab: int, out: Path) -> dict:
    """`polytrain plan`'s one row for `shape` on one GPU (the run's own settings; checkpointing chosen by the
    plan: the least recomputation that fits)."""
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in shape.items()]
    argv = [sys.executable, "-m", "polytrain", "plan", "--model", "llama", *flags, f"--vocab-size={vocab}",
            f"--context={context}", "--devices=1", f"--gpu={gpu}", f"--batch-size={batch}", "--precision=bf16",
            "--optimizer=adamw", "--json", str(out)]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(f"polytrain plan failed: {(done.stdout + done.stderr)[-1500:]}")
    return json.loads(out.read_text())[0]


@guarded("plan")
def plan_check(batch: int, context: int, *, device: str = "cuda", shapes=None, trained: int = 2):
    """The planner against real runs (issue 55): for each shape of `PLANNED`, deepest first, `polytrain plan`'s
    memory and tokens/s on one GPU of this kind; the first `trained` shapes that it says fit are trained as it
    plans them (bf16, AdamW, its checkpointing) for 8 steps, their peak memory and tokens/s set beside it."""
    gpu = gpu_kind()
    data = polytrain.load_dataset("shakespeare", context=context)
    for name, shape in (shapes or PLANNED).items():
        row = planned(
            shape,
            gpu=gpu,
            batch=batch,
            context=context,
            vocab=data.num_classes,
            out=OUT / f"plan-{name}.json",
        )
        said = dict(shape=name, gpu=gpu, batch=batch, context=context, fits=row["fits"],
                    checkpointing=row["activation_checkpointing"], predicted_gib=round(row["memory_gib"], 2),
                    predicted_split_gib={k: round(v, 2) for k, v in row["memory_split_gib"].items()},
                    predicted_tokens_per_second=round(row["tokens_per_second_per_device"]),
                    predicted_mfu=round(row["mfu"], 3))  # fmt: skip
        if not row["fits"] or trained <= 0:
            emit("plan", **said)
            continue
        trained -= 1
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        clock = StepClock(device)
        try:
            history = polytrain.fit(
                "llama", data, epochs=1, max_steps=8, batch_size=batch, optimizer="adamw", lr=1e-4,
                precision="bf16", activation_checkpointing=row["activation_checkpointing"], device=device,
                verbose=False, callbacks=[clock], context=context, **shape,
            )  # fmt: skip
        except torch.OutOfMemoryError as error:
            emit("plan", **said, trained="out of memory", error=str(error)[:500])
            continue
        measured = dict(max_allocated_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                        max_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2)) if device == "cuda" else {}  # fmt: skip
        tokens = batch * context / clock.seconds()
        emit("plan", **said, **measured, tokens_per_second=round(tokens),
             speed_predicted_over_measured=round(row["tokens_per_second_per_device"] / tokens, 3),
             memory_predicted_over_allocated=round(row["memory_gib"] / measured["max_allocated_gib"], 3) if measured else None,
             train_loss=history.validations[-1]["train_loss"])  # fmt: skip
        del history


@guarded("bench")
def bench():
    argv = [sys.executable, "-m", "polytrain", "bench", "--device", "cpu,cuda", "--devices", "1",
            "--batch-sizes", "64,512", "--out", str(OUT / "bench")]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    (OUT / "bench.txt").write_text(done.stdout + done.stderr)
    emit("bench", rc=done.returncode, tail=(done.stdout + done.stderr).strip().splitlines()[-25:])


def main():
    global OUT
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="folder for results.jsonl and logs")
    parser.add_argument("--parts", default="env,plan,tests,paths,graphs,accuracy,gpt,bench,llama")
    parser.add_argument("--gpt-epochs", type=float, default=30)
    parser.add_argument("--paths", default="", help="only the path cases whose names contain one of these")
    parser.add_argument("--llama", default="8,2048", help="layers,width of the Llama-style model")
    parser.add_argument("--plan", default="2,2048", help="batch,context of the planner's check")
    args = parser.parse_args()
    OUT = Path(args.out)
    ONLY[:] = [word for word in args.paths.split(",") if word]
    OUT.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    if "env" in parts:
        env()
    if "plan" in parts:  # first, in a process whose GPU memory nothing else has touched
        batch, context = map(int, args.plan.split(","))
        plan_check(batch, context)
    if "llama" in parts:
        layers, width = map(int, args.llama.split(","))
        llama(layers, width)
    tests = start_tests() if "tests" in parts else None
    if "paths" in parts:
        paths()
    if tests is not None:
        tests.wait(timeout=600)
        tail = (OUT / "pytest.txt").read_text().strip().splitlines()[-15:]
        emit("tests", rc=tests.returncode, tail=tail)
    if "graphs" in parts:
        graphs()
    if "accuracy" in parts:
        accuracy()
    if "gpt" in parts:
        gpt(args.gpt_epochs)
    if "bench" in parts:
        bench()
    if "control" in parts:
        control()


if __name__ == "__main__":
    main()
