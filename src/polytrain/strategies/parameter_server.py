"""A parameter server: the TF1 recipe of "variables on the CPU, towers on the GPUs", MXNet's kvstore.

Every rank is a worker with a replica of the model for the forward and backward pass. The master weights
and the optimizer state live with the servers, in host memory by default (`--server-device cpu`), split
over `--servers K` roles by size (ranks 0..K-1 host them). Each step, for every server, the workers push
their gradients (summed onto the server with `reduce`), the server averages them and applies its
optimizer to its master weights, and the workers pull the new weights (`broadcast` from the server). This
is synchronous: the step equals the one-device step.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config import TrainConfig
from ..parallel.activation_checkpoint import apply_activation_checkpointing
from ..parallel.parallelize import apply_global_batch
from ..parallel.precision import apply_precision
from ..planning.servers import ServerPlan, check_servers, partition_by_size
from .async_server import ServerThread, flat_gradients, push_remote, say_done, set_mean_gradients
from .base import Strategy
from .optimizer_state import load_part, numbered_part, positions, whole_state


class ParameterServer(Strategy):
    name = "parameter-server"
    keeps_model_whole = False
    data_parallel = "none"  # the workers' gradients go to the servers (neither DDP nor FSDP2)
    waits_on_servers = True

    def __init__(self, *, plan: ServerPlan, **common):
        super().__init__(**common)
        self.plan = plan
        self.waited = 0.0  # seconds this rank spent pushing, waiting and pulling this epoch

    @classmethod
    def make_plan(cls, config: TrainConfig, model: nn.Module, dataset, *, device: torch.device) -> ServerPlan:
        servers = config.servers or 1
        check_servers(servers, devices=config.devices)
        sizes = [p.numel() for p in model.parameters()]
        return ServerPlan(
            servers,
            config.server_device or "cpu",
            partition_by_size(sizes, servers=servers),
            config.staleness or 0,
        )

    def setup(self, model: nn.Module, make_optimizer, make_scheduler) -> None:
        model = self.place(model)  # (channels-last where the loader hands over channels-last images)
        self.materialise(model)  # every rank holds a whole replica
        kept = apply_precision(model, self.device, self.precision)  # steps 0, 3 and 4 of parallelize
        apply_activation_checkpointing(model, self.activation_checkpointing)
        how = self.global_batch  # BatchNorm and Dropout over the global batch
        self.global_rows = apply_global_batch(model, how, loud=how == "across" and self.data_rank == 0)
        self.model = self.runner = model
        self.parameter_names = [name for name, _ in model.named_parameters()]
        self.replica = list(model.parameters())
        self.owned = {k: self.plan.owned(k) for k in range(self.plan.servers)}
        self.global_index = list(self.owned.get(self.rank, ()))
        home = torch.device("cpu") if self.plan.server_device == "cpu" else self.device
        # (a frozen parameter's master stays frozen: the optimizer neither decays nor steps it)
        self.master = [
            nn.Parameter(
                self.replica[i].detach().to(home, copy=True), requires_grad=self.replica[i].requires_grad
            )
            for i in self.global_index
        ]
        # a rank that serves nothing still keeps the learning-rate schedule's state
        named = [(self.parameter_names[i], weight) for i, weight in zip(self.global_index, self.master)]
        self.optimizer = make_optimizer(named or [("", nn.Parameter(torch.zeros(0)))])
        self.scheduler = make_scheduler(self.optimizer)
        self.placement = self._placement() + ([kept] if kept and self.is_main else [])
        self.server = None
        if self.plan.staleness:
            # one process group per server: on each rank, one thread uses it (the server's own thread on
            # the server rank, the training thread elsewhere)
            self.groups = [
                (dist.new_group(backend="gloo"), dist.new_group(backend="gloo"))
                for _ in range(self.plan.servers)
            ]
            if self.master:
                self.server = ServerThread(
                    rank=self.rank,
                    world_size=self.world_size,
                    groups=self.groups[self.rank],
                    master=self.master,
                    optimizer=self.optimizer,
                    scheduler=self.scheduler,
                    staleness=self.plan.staleness,
                )

    def _placement(self) -> list:
        if not self.is_main:
            return []
        lines = [f"parameter server: {self.plan.describe(self.layout)}; every rank is a worker"]
        for server, indices in self.owned.items():
            count = sum(self.replica[i].numel() for i in indices)
            lines.append(f"  server {server} (rank {server}): {len(indices)} tensors, {count:,} parameters")
        return lines

    def zero_grad(self) -> None:
        for p in self.replica:
            p.grad = None

    def apply_gradients(self) -> None:
        began = time.perf_counter()
        if self.gradients.active and not self.plan.staleness:
            self._push_step_pull()  # clipping and fp16 need every server's gradient before any step
        else:
            for server, indices in self.owned.items():
                if self.plan.staleness:
                    self._push_and_pull_async(server, indices)
                else:
                    self._push_and_pull(server, indices)
        if not self.master and not self.gradients.active:
            self.optimizer.step()  # a no-op on the placeholder; keeps the schedule's order of calls
        if self.server is None and self.schedule_per_step:  # an asynchronous server steps it with its updates
            self.scheduler.step()
        self.waited += time.perf_counter() - began

    def _push_and_pull_async(self, server: int, indices) -> None:
        params = [self.replica[i] for i in indices]
        grads = flat_gradients(params)
        if server == self.rank:
            weights = self.server.push_local(grads)
        else:
            weights = push_remote(grads, server=server, groups=self.groups[server])
        self._set(params, weights.to(self.device))

    def _set(self, params, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for p, value in zip(params, torch._utils._unflatten_dense_tensors(flat, params)):
                p.copy_(value)

    def before_evaluation(self) -> None:
        if self.plan.staleness:
            self._pull_latest()

    def _pull_latest(self) -> None:
        """Every replica takes the servers' current weights (after the servers stepped together, or, when
        asynchronous, once all updates are in: every worker has had the answer to its last push)."""
        for server, indices in self.owned.items():
            params = [self.replica[i] for i in indices]
            flat = (
                torch.cat([w.detach().flatten() for w in self.master]).to(self.device)
                if server == self.rank
                else torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=self.device)
            )
            dist.broadcast(flat, src=server)
            self._set(params, flat)

    def close(self) -> None:
        if not self.plan.staleness:
            return
        for server in self.owned:
            if server != self.rank:
                say_done(server=server, groups=self.groups[server])
        if self.server is not None:
            self.server.stop()

    def _push_and_pull(self, server: int, indices) -> None:
        params = [self.replica[i] for i in indices]
        grads = flat_gradients(params)
        began = time.perf_counter()
        dist.reduce(grads, dst=server)  # push: the sum lands on the server
        pushing = time.perf_counter() - began
        if self.rank == server:
            set_mean_gradients(self.master, grads, workers=self.world_size)
            self.optimizer.step()
            flat = torch.cat([w.detach().flatten() for w in self.master]).to(self.device)
            self.add_phase("server_update", time.perf_counter() - began - pushing)
        else:
            flat = torch.empty_like(grads)
        pulling = time.perf_counter()
        dist.broadcast(flat, src=server)  # pull: every worker gets the new weights
        self.add_phase("communication", pushing + time.perf_counter() - pulling)
        self._set(params, flat)

    @property
    def norm_group(self):
        """Every rank: each server holds a part of the whole gradient (a worker that serves nothing, none)."""
        return dist.group.WORLD

    overflow_group = norm_group

    def _push_step_pull(self) -> None:
        """With clipping or fp16: every server first receives its mean gradient, then all ranks agree on the
        global norm and on an overflow (one all-reduce; workers that serve nothing add zeros), the servers
        step, and the workers pull the new weights."""
        began = time.perf_counter()
        for server, indices in self.owned.items():
            grads = flat_gradients([self.replica[i] for i in indices])
            dist.reduce(grads, dst=server)
            if self.rank == server:
                set_mean_gradients(self.master, grads, workers=self.world_size)
        pushed = time.perf_counter()
        self.gradients.step(
            self.optimizer, self.master, norm_group=self.norm_group, overflow_group=self.overflow_group
        )
        updated = time.perf_counter()
        self._pull_latest()
        self.add_phase("server_update", updated - pushed)
        self.add_phase("communication", pushed - began + time.perf_counter() - updated)

    @classmethod
    def settle_phases(cls, ranks: list) -> list:
        """A worker's pull waits while the servers update: that share of its communication is idle time
        (waiting on a server). `ranks[r][i]` is rank r's phases in measured step i."""
        settled = [[dict(step) for step in steps] for steps in ranks]
        for rank, steps in enumerate(settled):
            for i, step in enumerate(steps):
                waiting = sum(
                    other[i].get("server_update", 0.0) for k, other in enumerate(ranks) if k != rank
                )
                moved = min(waiting, step.get("communication", 0.0))
                step["communication"] = step.get("communication", 0.0) - moved
                step["idle"] = step.get("idle", 0.0) + moved
        return settled

    def epoch_extras(self) -> dict:
        """How long the workers waited on the servers this epoch (mean over ranks), and with --staleness,
        how stale the applied updates were."""
        waited = float(self.reduce(torch.tensor([self.waited], dtype=torch.float64, device=self.device)))
        self.waited = 0.0
        extras = {"server_wait_seconds": waited / self.world_size}
        note = f"waited {waited / self.world_size:.2f}s on the servers"
        if self.plan.staleness:
            parts = self.gather_object(self.server.take_records() if self.server else [])
            records = [record for part in parts for record in part] if self.is_main else []
            if records:
                lags, leads = [r[1] for r in records], [r[2] for r in records]
                extras.update(
                    updates=len(records),
                    version_lag_mean=sum(lags) / len(lags),
                    version_lag_max=max(lags),
                    lead_max=max(leads),
                )
                note += (
                    f"; {len(records)} updates, {sum(lags) / len(lags):.2f} behind on average (max {max(lags)}), "
                    f"lead at most {max(leads)} of {self.plan.staleness}"
                )
        return dict(extras, note=note)

    # -- the whole model and its optimizer, as one device numbers them --------------------------------
    def model_state(self) -> dict:
        if self.plan.staleness:
            self._pull_latest()
        return super().model_state()

    def state_dict(self) -> dict:
        model = self.model_state()
        numbers = positions(self.master, self.global_index)
        parts = self.gather_object(numbered_part(self.optimizer, numbers) if self.master else {})
        if not self.is_main:
            return {}
        optimizer = whole_state(self.optimizer, parts)
        return {"model": model, "optimizer": optimizer, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        with torch.no_grad():
            for weight, i in zip(self.master, self.global_index):
                weight.copy_(self.replica[i].detach())
        load_part(self.optimizer, state["optimizer"], positions(self.master, self.global_index))
        self.scheduler.load_state_dict(state["scheduler"])
