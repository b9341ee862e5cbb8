"""What `polytrain verify` calls equal, as numbers and as its --help says it: apart from verify.py, which
imports torch, so that the command line's help does not wait for torch to import."""

# largest parameter difference over the largest parameter magnitude that passes in float64: float64 runs of
# every strategy measured 1e-16 .. 1e-13 (docs/benchmarks.md), while the smallest fault verify must catch, one
# rank's gradient scaled by 1 + 1e-6, moves the parameters by 1e-9 .. 1e-7 of their scale
DEFAULT_TOLERANCE = 1e-10
FLOOR_MULTIPLE = 10  # as trained: N devices may differ from one by this many times the noise floor
# GPUs whose float64 runs at half their float32 speed or better (P100, V100, A100, H100, B200)
FLOAT64_GPUS = {(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)}

TOLERANCE_HELP = (
    f"largest allowed parameter difference, relative to the largest parameter's magnitude "
    f"(default: {DEFAULT_TOLERANCE:g}: float64 runs of every strategy agree to 1e-13 or better, "
    f"and one rank's gradient off by 1e-6 moves the parameters by 1e-9 or more); as trained "
    f"(fp16, bf16): {FLOOR_MULTIPLE} times the measured noise floor"
)
COMPARE_HELP = (
    "float64: both sides train in float64 (exact to rounding; fp32 runs only); as-trained: in the "
    "run's own precision, against the noise floor of the one-device run repeated in another "
    "summation order; auto (default): float64 where the precision is fp32 and the device computes "
    "float64 at speed (CPUs; P100/V100/A100/H100 GPUs)"
)
