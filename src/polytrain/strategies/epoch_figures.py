"""What a strategy adds to each epoch's record (every rank calls it, its collectives in step): clipping and loss
scaling (`gradients.py`), the strategy's own figures (`epoch_extras`: here the most device memory a rank of
parts had allocated; the pipeline's and the parameter server's their own), and where the model has mixtures of
experts, the tokens routed to each expert (models/moe.py `routed_tokens`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..models.moe import routed_tokens


class EpochFigures:
    """A mixin of `Strategy`: `epoch_figures` and the parts of it; `routes` (set by `setup`): whether the model
    has mixtures of experts."""

    routes = False

    def epoch_figures(self) -> dict:
        """The epoch record's figures of this strategy and of clipping and loss scaling (every rank calls it)."""
        extras, figures, routing = self.epoch_extras(), self.gradients.epoch_figures(), self.routing_figures()
        said = (extras.pop("note", ""), figures.pop("note", ""), routing.pop("note", ""))
        notes = "; ".join(note for note in said if note)
        return dict(extras, **figures, **routing, **({"note": notes} if notes else {}))

    def epoch_extras(self) -> dict:
        """Figures of this strategy for the epoch's record (every rank calls it); "note" is printed: where ranks
        hold parts of the model on GPUs, the most device memory any rank had allocated this epoch."""
        if self.device.type != "cuda" or not self.layout.holds_parts:
            return {}
        peak = torch.tensor(
            [torch.cuda.max_memory_allocated(self.device)], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        torch.cuda.reset_peak_memory_stats(self.device)
        mib = float(peak) / 2**20
        return {"peak_device_memory_mib": mib, "note": f"peak device memory {mib:,.0f} MiB (largest rank)"}

    def routing_figures(self) -> dict:
        """The tokens routed to each expert this epoch, over every rank's (each tensor group once: its ranks route
        the same tokens): the fewest and most any expert of any mixture got, and the busiest expert's over its
        mixture's mean; {} for a dense model."""
        if not self.routes:
            return {}
        counts = routed_tokens(self.model)
        counted = self.world_size == 1 or self.layout.coordinates(self.rank)["tensor"] == 0
        parts = self.gather_object({block: c.tolist() for block, c in counts.items()} if counted else {})
        figures = {}
        blocks: dict = {}
        for part in parts if self.is_main else ():
            for block, c in part.items():
                blocks[block] = [a + b for a, b in zip(blocks[block], c)] if block in blocks else c
        if blocks:
            flat = [n for c in blocks.values() for n in c]
            busiest = max(max(c) * len(c) / max(1, sum(c)) for c in blocks.values())
            figures = {
                "expert_tokens_min": min(flat),
                "expert_tokens_max": max(flat),
                "expert_imbalance": busiest,
                "note": f"tokens per expert {min(flat):,}-{max(flat):,} (busiest {busiest:.2f}x its mixture's mean)",
            }
        return self.broadcast_object(figures)
