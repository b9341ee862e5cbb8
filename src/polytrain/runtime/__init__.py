"""How processes run: starting workers (in this process, under torchrun or SLURM's srun, or spawned), what one
worker does, stopping on signals, the hang watchdog, checkpoints and the weights a run starts from, and the
commands that run jobs (bench, verify, export, generate). Strategies know nothing of this; nothing here parses
the command line."""
