"""What each pipeline rank ran when (`--timeline`): a stage's forward and backward of each micro-batch, timed
while the strategy is tracing, as (rank, step, kind, micro-batch, stage, start, end) events (scaling/timeline.py
draws them)."""

from __future__ import annotations

import time


def record_calls(strategy, stage, index: int) -> None:
    """Wrap `stage`'s (a torch PipelineStage holding model stage `index`) forward and backward of one chunk so
    that, while `strategy.tracing`, each call appends its event to `strategy.trace` (and, before each, tells
    the strategy which micro-batch runs: `mark_chunk`)."""
    for method, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B")):
        run = getattr(stage, method)

        def recorded(chunk, *args, _run=run, _kind=kind, **kwargs):
            strategy.mark_chunk(chunk)
            if not strategy.tracing:
                return _run(chunk, *args, **kwargs)
            strategy.synchronize()
            began = time.perf_counter() - strategy.trace_origin
            result = _run(chunk, *args, **kwargs)
            strategy.synchronize()
            ended = time.perf_counter() - strategy.trace_origin
            strategy.trace.append((strategy.rank, strategy.traced_steps, _kind, chunk, index, began, ended))
            return result

        setattr(stage, method, recorded)
