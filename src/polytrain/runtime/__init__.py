"""How processes run: starting workers (in this process, under torchrun or SLURM's srun, or spawned), what one
worker does, what the launcher told it, stopping on signals, and the hang watchdog. Strategies know nothing of
this; nothing here parses the command line."""
