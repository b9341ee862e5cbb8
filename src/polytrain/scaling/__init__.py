"""Where time goes on N devices and which strategy to use, measured in this process: the workload the cost model
needs, the per-rank step clock and the pipeline timeline (callbacks the worker attaches), the memory check, and
`--strategy auto`. `polytrain bench`, which starts processes, is in runtime/ (bench.py) above it."""
