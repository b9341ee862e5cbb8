"""A run's parallelism in one place: its degrees (`Layout`), the one device mesh built from them, and the steps
that prepare a model for them, applied by `parallelize` in torchtitan's order. Nothing is imported here; each
module is imported by its own name. Read top-down:

- layout.py: `Layout`, the degrees of parallelism (replicate, shard, pipeline, context, tensor) and what each
  means for the batch, the gradients and the mesh; its `--layout` words (`dp_shard=8,tp=8`). Pure: no torch.
- presets.py: the strategy names as presets of degrees (`layout_of`) and back (`settings_of`, `flags_of`);
  labels made from a layout for printing. Pure: no torch.
- mesh.py: `RunMesh`, the one DeviceMesh of a run and its named parts (tensor, context, pipeline, replicas,
  what FSDP2 shards over, the copies of a pipeline's stages).
- parallelize.py: `parallelize(module, layout, options)`, the steps below in order over the mesh.
- tensor_plan.py: `TensorPlan`, which layer of a model is split how over the tensor ranks, checked against
  the layers' sizes; pure. tensor.py: the plan applied (layers split over the tp dimension).
- context.py: sequences split over the cp dimension (`ContextGroup`), and what a model must be to allow it;
  block_attention.py: a context rank's attention block by block, merged by log-sum-exp (CPUs).
- experts.py: each mixture's experts split over the ep ranks, tokens exchanged by all-to-all.
- activation_checkpoint.py: blocks recomputed in backward (full, selective).
- global_batch.py: BatchNorm and Dropout computed over the global batch where ranks each hold a slice.
- precision.py: layers kept in float32 under autocast where the device's kernels need it.
- fsdp.py, units.py: FSDP2 over the data dimensions, unit by unit; ddp.py: DistributedDataParallel.
- compile.py: torch.compile of each block in place.
- meta.py: a model built on the meta device, and its one-device values made module by module from a seed
  per module name; materialise.py: a meta-device model's storage made for what this rank holds, filled with
  its part of those values.

The package needs nothing of polytrain but `errors.py`: the steps find a model's attention, mixtures and layers by
the hooks the models declare (`context_parallel`, `expert_parallel`), so every other package may build on it.

A new degree is a `Layout` field, a mesh view in mesh.py and one step here.
"""
