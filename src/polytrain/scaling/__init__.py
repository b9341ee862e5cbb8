"""Where time goes on N devices and which strategy to use: `polytrain bench` and its report, the measured
workload the cost model needs, the per-rank step clock, the pipeline timeline, and `--strategy auto`."""
