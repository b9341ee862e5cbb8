"""The asynchronous side of a parameter server (`--staleness S`, stale synchronous parallel, Ho et al. 2013).

A server applies each worker's gradient as soon as it arrives and answers with its current weights. The
bound: a worker that has pushed c updates may start computing its next one only when every worker has
pushed at least c - S, so it never runs more than S updates ahead of the slowest and never waits for it
otherwise. The server enforces this by holding its answer back.

Each server rank runs two threads: one receives gradients from any worker (`recv` from any source) on the
server's inbound process group, the other applies them in arrival order, with those of the rank's own worker
(which arrive through a queue), and sends the answers on the outbound group. On every rank, each group is
used by one thread only. Every update's staleness is recorded: how many updates the server applied between
the weights the worker computed on and its gradient (`version_lag`), and how far the worker was ahead of
the slowest when it started (`lead`, at most S).
"""

from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist

DONE = -1


def set_mean_gradients(master: list, summed: torch.Tensor, *, workers: int) -> None:
    """Give each master weight its slice of a flat gradient, divided by the number of workers."""
    offset = 0
    for weight in master:
        size = weight.numel()
        weight.grad = (summed[offset : offset + size] / workers).view_as(weight).to(weight.device)
        offset += size


def flat_gradients(params: list) -> torch.Tensor:
    """The gradients of `params` as one vector (zeros for a parameter that got none)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])


class ServerThread:
    def __init__(
        self, *, rank: int, world_size: int, groups, master: list, optimizer, scheduler, staleness: int
    ):
        self.rank, self.world_size = rank, world_size
        self.inbound, self.outbound = groups
        self.master, self.optimizer, self.scheduler = master, optimizer, scheduler
        self.staleness = staleness
        self.version = 0
        self.clocks = [0] * world_size  # updates applied from each worker
        self.pulled = [0] * world_size  # version each worker computes on
        self.started_lead = [0] * world_size  # how far ahead of the slowest it was when it started
        self.held = []  # workers whose answer waits for the slowest
        self.records = []  # (worker, version_lag, lead) of every applied update
        self.inbox = queue.Queue()  # (worker, gradients), or the end of a source
        self.answers = queue.Queue()  # weights for this rank's own worker
        self.lock = threading.Lock()  # the training thread takes the records at epoch ends
        self.size = sum(w.numel() for w in master)
        self.threads = [
            threading.Thread(target=self._apply_loop, name=f"polytrain-server-{rank}", daemon=True)
        ]
        if world_size > 1:
            self.threads.append(
                threading.Thread(target=self._receive_loop, name=f"polytrain-inbox-{rank}", daemon=True)
            )
        else:
            self.inbox.put(("remote-done",))
        for thread in self.threads:
            thread.start()

    def _receive_loop(self) -> None:
        remote = self.world_size - 1  # remote workers that have not said they are done
        header = torch.empty(1, dtype=torch.int64)
        while remote:
            source = dist.recv(header, group=self.inbound)
            if int(header[0]) == DONE:
                remote -= 1
                continue
            grads = torch.empty(self.size, dtype=self.master[0].dtype)
            dist.recv(grads, src=source, group=self.inbound)
            self.inbox.put((source, grads))
        self.inbox.put(("remote-done",))

    def _apply_loop(self) -> None:
        ended = 0
        while ended < 2:
            item = self.inbox.get()
            if len(item) == 1:
                ended += 1
            else:
                self._apply(*item)

    def _apply(self, worker: int, grads: torch.Tensor) -> None:
        with self.lock:
            set_mean_gradients(self.master, grads, workers=self.world_size)
            self.optimizer.step()
            self.version += 1
            if self.version % self.world_size == 0:  # the schedule counts global steps of W updates
                self.scheduler.step()
            self.records.append((worker, self.version - 1 - self.pulled[worker], self.started_lead[worker]))
            self.clocks[worker] += 1
            self.held.append(worker)
            self._answer_those_allowed()

    def _answer_those_allowed(self) -> None:
        slowest = min(self.clocks)
        for worker in [w for w in self.held if self.clocks[w] - slowest <= self.staleness]:
            self.held.remove(worker)
            self.pulled[worker] = self.version
            self.started_lead[worker] = self.clocks[worker] - slowest
            weights = torch.cat([w.detach().flatten() for w in self.master]).cpu()
            if worker == self.rank:
                self.answers.put(weights)
            else:
                dist.send(weights, dst=worker, group=self.outbound)

    # -- the training thread ----------------------------------------------------------------------------
    def push_local(self, grads: torch.Tensor) -> torch.Tensor:
        self.inbox.put((self.rank, grads.detach().cpu()))
        return self.answers.get()

    def stop(self) -> None:
        self.inbox.put(("local-done",))
        for thread in self.threads:
            thread.join(timeout=30)

    def take_records(self) -> list:
        with self.lock:
            records, self.records = self.records, []
        return records


def push_remote(grads: torch.Tensor, *, server: int, groups) -> torch.Tensor:
    """Send gradients to a server on another rank; its answer (the weights to continue with) may be held
    back while this worker is too far ahead."""
    inbound, outbound = groups
    dist.send(torch.tensor([0], dtype=torch.int64), dst=server, group=inbound)
    dist.send(grads.detach().cpu(), dst=server, group=inbound)
    weights = torch.empty(grads.numel(), dtype=grads.dtype)
    dist.recv(weights, src=server, group=outbound)
    return weights


def say_done(*, server: int, groups) -> None:
    dist.send(torch.tensor([DONE], dtype=torch.int64), dst=server, group=groups[0])
