"""Pipeline parallelism, from the plan made in the launching process to the strategy each rank runs. Nothing is
imported here (polytrain/strategy_registry.py imports `Pipeline` from `pipeline.strategy`, which builds on
`strategies/`); each module is imported by its own name. Read top-down:

- plan.py: `PipelinePlan`, the layout of a pipeline run as numbers (which rank holds which stage, micro-batch
  counts, which layers each stage holds); pure, no torch.
- schedule.py: schedules as clock-tick tables (which rank runs which forward or backward, when; the bubble);
  pure.
- layers.py: a model as a chain of layers (nested Sequentials flattened), cut into stages that keep each
  layer's name, and timed or measured layer by layer.
- balance.py: a chain of layers split into contiguous stages by their costs, or as `--split` says; pure.
- planning.py: `plan_pipeline`, the plan made in the launching process (layers measured, the split chosen,
  every mistake refused before any worker starts).
- traced.py: stages of a model that is not an nn.Sequential, cut by torch's tracer (`--split-at`).
- strategy.py: `Pipeline`, the strategy: a rank's stages set up, stepped through torch's schedules, evaluated.
- state.py: a rank's stages as the whole model's tensors and back (state dicts, checkpoints of shards), and the
  start-up lines of where stages run and what each rank holds.
- sharding.py: the data degree, pipelines side by side holding their stages through FSDP2 or DDP.
- aux_loss.py: `StageBalance`, the mixtures' load-balancing loss added on every stage (each stage's output
  carries its part into the backward).
- tied.py: `TiedWeights`, weights that layers on different stages share (tied embeddings).
- transfer.py: activations of any shape sent between pipeline ranks (evaluation without a schedule).
- timeline.py: what each rank ran when (`--timeline`'s events).
"""
