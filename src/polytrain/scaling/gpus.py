"""The GPUs a cluster plan is made for: memory, peak dense FLOP/s and the bandwidths their collectives run over,
each from its maker's datasheet, and the few figures of a step that no datasheet gives, each with where it comes
from. One set serves every model and layout (`polytrain plan`, scaling/cluster_plan.py).

Peak FLOP/s are dense (without 2:4 sparsity): bf16 on the tensor cores, fp32 without them (TF32 is not counted).
`nvlink` is the bandwidth one GPU sends at to the others of its node, in one direction (the datasheets give both
directions together: half of it); `network` is one GPU's share of the links between nodes, as its maker's
reference system has them (one NIC per GPU). Pure: numbers only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from ..errors import ConfigError

T = 1e12
GB = 1e9


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float  # what the device has (GiB)
    bf16_flops: float  # dense, tensor cores
    fp32_flops: float  # dense, without tensor cores
    nvlink: float  # bytes/s one direction to the others of its node
    network: float  # bytes/s one direction between nodes, per GPU
    source: str

    def peak_flops(self, precision: str) -> float:
        return self.fp32_flops if precision == "fp32" else self.bf16_flops


GPUS: Dict[str, Gpu] = {
    gpu.name: gpu
    for gpu in (
        # H100 SXM5 80 GB: 989 TFLOPS bf16 dense (1,979 with sparsity), 67 TFLOPS fp32, NVLink 900 GB/s; DGX H100:
        # 8 ConnectX-7 at 400 Gb/s, one per GPU
        Gpu(
            "h100", 80 * 1e9 / 2**30, 989 * T, 67 * T, 450 * GB, 50 * GB, "nvidia.com/en-us/data-center/h100"
        ),
        # H100 PCIe 80 GB: 756 TFLOPS bf16 dense, 51 TFLOPS fp32, NVLink bridge 600 GB/s
        Gpu(
            "h100-pcie",
            80 * 1e9 / 2**30,
            756 * T,
            51 * T,
            300 * GB,
            50 * GB,
            "nvidia.com/en-us/data-center/h100",
        ),
        # H200 SXM 141 GB: the H100's compute, 141 GB HBM3e, NVLink 900 GB/s; DGX H200: 8 x 400 Gb/s
        Gpu(
            "h200", 141 * 1e9 / 2**30, 989 * T, 67 * T, 450 * GB, 50 * GB, "nvidia.com/en-us/data-center/h200"
        ),
        # A100 SXM 40 and 80 GB: 312 TFLOPS bf16 dense, 19.5 TFLOPS fp32, NVLink 600 GB/s; DGX A100: 8 x 200 Gb/s
        Gpu(
            "a100-40gb",
            40 * 1e9 / 2**30,
            312 * T,
            19.5 * T,
            300 * GB,
            25 * GB,
            "nvidia.com/en-us/data-center/a100",
        ),
        Gpu(
            "a100-80gb",
            80 * 1e9 / 2**30,
            312 * T,
            19.5 * T,
            300 * GB,
            25 * GB,
            "nvidia.com/en-us/data-center/a100",
        ),
        # B200 (HGX B200, 8 GPUs: 1.44 TB, 18 PFLOPS bf16 dense, 600 TFLOPS fp32, NVLink 1.8 TB/s per GPU; 8 x 400 Gb/s)
        Gpu(
            "b200", 180 * 1e9 / 2**30, 2250 * T, 75 * T, 900 * GB, 50 * GB, "nvidia.com/en-us/data-center/hgx"
        ),
        # L40S 48 GB: 362 TFLOPS bf16 dense (733 with sparsity), 91.6 TFLOPS fp32; no NVLink: PCIe Gen4 x16
        Gpu(
            "l40s", 48 * 1e9 / 2**30, 362 * T, 91.6 * T, 32 * GB, 25 * GB, "nvidia.com/en-us/data-center/l40s"
        ),
    )
}

GPUS_PER_NODE = 8  # the reference systems above (DGX, HGX) hold 8 GPUs each

# The share of a GPU's peak that a transformer's training step computes at, where its collectives are hidden: the
# kernels' efficiency (matrix products near peak; norms, rotary embeddings, attention and elementwise work far
# below). torchtitan's published FSDP2 runs of Llama 3.1 8B reach 33-39% of bf16 peak on 8 and 128 H100s (at a
# 500 W limit) and 57-58% on 64 A100s; its 405B with FSDP2 x TP on 128 H100s 29% (docs/benchmarks.md compares
# every prediction with them). One constant for every model, layout and GPU: 0.40.
ACHIEVED = 0.40
# A collective's fixed cost per step of its ring, NCCL's small-message latency: a few microseconds within a node
# over NVLink, about ten between nodes over InfiniBand (nccl-tests' all-reduce of small messages)
LATENCY = {"nvlink": 5e-6, "network": 12e-6}
# A collective that overlaps computation (FSDP2's prefetched all-gathers and its reduce-scatters, DDP's bucketed
# all-reduce) hides behind it up to this share of the computation it runs beside; the rest of it is exposed
OVERLAP = 1.0


def gpu_named(name: str) -> Gpu:
    """The GPU called `name` (case and a trailing "-sxm" ignored); one line listing the known ones otherwise."""
    key = name.lower().removesuffix("-sxm").removesuffix("-sxm5")
    if key not in GPUS:
        raise ConfigError(f"unknown --gpu {name!r}; choose one of {', '.join(GPUS)}")
    return GPUS[key]
