"""Pure planning: the device mesh layout, tensor and sharded plans, parameter servers, the cost and memory
models. No torch.distributed here. (A pipeline's pure planning, its plan, schedule tables and stage balancing,
is in polytrain/pipeline/: plan.py, schedule.py, balance.py.)"""
