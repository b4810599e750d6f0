"""SimpleFSDP parameters gathered once for a pipeline step (`--parallelism.pp_gather step`).

A pipeline step runs each stage's forward and backward once per microbatch. Left to SimpleFSDP, every
microbatch's forward gathers the stage's parameters again and every backward reduce-scatters their
gradients: 8 microbatches, 8 all-gathers and 8 reduce-scatters of the whole stage. Here each sharded
parameter is gathered once before the schedule runs, into a persistent full tensor in the compute dtype
that the stage reads in place of the gather (traced stages see it as a plain graph input, so their
graphs hold no data-parallel collective); each microbatch's gradient of it is added into an fp32
accumulator, reduce-scattered (average) once after the last microbatch and added to the parameter's
gradient, as SimpleFSDP's backward would have.

Memory: the rank's stage parameters held unsharded through the step, in the compute dtype, and their fp32
accumulated gradients: 6 bytes a parameter with bf16 compute. torchtitan's FSDP2 under pipelining peaked
13.3 GiB lower at llama3 8B-16L, pp 2 x dp_shard 2 on 4 H100s, where this step ran 1.11x faster
(bench/results/2026-11-27-pipeline).

Numerics: the gradients are summed over microbatches, then averaged over ranks, where the per-microbatch
reduce-scatter averages first; both in fp32, equal up to the order of the additions.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from .compat import all_gather_single, reduce_scatter_single
from .simple_fsdp import ParamGather


class _Read:
    """Stands in for a parameter's ParamGather during the step: the gathered tensor as the module computes
    with it (a DTensor on the TP/EP mesh where the gather gives one)."""

    def __init__(self, gather: ParamGather):
        self.gather = gather

    def __call__(self, full: torch.Tensor) -> torch.Tensor:
        g = self.gather
        return full if g.compute_mesh is None else DTensor.from_local(full, g.compute_mesh, g.compute_placements, run_check=False)


class _Gathered:
    """One sharded parameter: its full copy (a leaf the stages differentiate) and the fp32 sum of its gradients."""

    def __init__(self, module: nn.Module, name: str, gather: ParamGather):
        self.module, self.name, self.gather = module, name, gather
        self.param: DTensor = module._parameters[name]
        self.full: nn.Parameter | None = None
        self.grad_sum: torch.Tensor | None = None
        # one even gather over one mesh dimension (most parameters) skips DTensor's per-call planning, as eager
        # SimpleFSDP does: 150 parameters gathered and reduced a step
        self.direct = gather._direct_gather(self.param)

    def _add_grad(self, full: torch.Tensor) -> None:
        if full.grad is None:
            # a backward that left this gradient for later (a traced stage's input-gradient part under a zero-bubble
            # schedule) still runs the hook
            return
        if self.grad_sum is None:
            self.grad_sum = full.grad.to(torch.float32)
        else:
            self.grad_sum.add_(full.grad)
        full.grad = None

    @torch.no_grad()
    def gather_once(self) -> None:
        p, g = self.param, self.gather
        if self.direct is not None:
            mesh, mesh_dim, dim = self.direct
            local = all_gather_single(p.to_local().to(g.mp.param_dtype), dim, (mesh, mesh_dim))
        else:
            replicated = [Replicate() if i in g.dp_dims else pl for i, pl in enumerate(p.placements)]
            cast = g.mp.param_dtype if g.mp.param_dtype != p.dtype else None
            local = p.redistribute(p.device_mesh, replicated, forward_dtype=cast).to_local()
        if self.full is None:
            self.full = nn.Parameter(local)
            self.full.register_post_accumulate_grad_hook(self._add_grad)
        else:
            self.full.copy_(local)

    @torch.no_grad()
    def reduce_once(self) -> None:
        """The summed gradient averaged over the data-parallel ranks into the parameter's shard."""
        if self.grad_sum is None:
            return
        p, g = self.param, self.gather
        summed = self.grad_sum.to(g.mp.reduce_dtype)
        if self.direct is not None:
            mesh, mesh_dim, dim = self.direct
            local = reduce_scatter_single(summed, "avg", dim, (mesh, mesh_dim)).to(p.dtype)
            grad = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False)
        else:
            partial = [Partial("avg") if i in g.dp_dims else pl for i, pl in enumerate(p.placements)]
            grad = DTensor.from_local(summed, p.device_mesh, partial, run_check=False).redistribute(p.device_mesh, p.placements).to(p.dtype)
        self.grad_sum = None
        if p.grad is None:
            p.grad = grad
        else:
            p.grad += grad


def _sharded(gather: ParamGather, param: torch.Tensor) -> bool:
    return isinstance(param, DTensor) and any(param.device_mesh.size(i) > 1 for i in gather.dp_dims)


class StepGather:
    """The parameters of `model` that SimpleFSDP shards over more than one rank; `with step_gather():`
    around a pipeline step gathers them once, and reduces their gradients once at its end."""

    def __init__(self, model: nn.Module):
        self.entries = [_Gathered(m, n, g) for m in model.modules() for n, g in getattr(m, "_fsdp_gathers", {}).items()
                        if _sharded(g, m._parameters[n])]

    def __bool__(self) -> bool:
        return bool(self.entries)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        for e in self.entries:
            e.gather_once()
        for e in self.entries:
            e.module._parameters[e.name] = e.full
            e.module._fsdp_gathers = {**e.module._fsdp_gathers, e.name: _Read(e.gather)}
        try:
            yield
        finally:
            for e in self.entries:
                e.module._parameters[e.name] = e.param
                e.module._fsdp_gathers = {**e.module._fsdp_gathers, e.name: e.gather}
        for e in self.entries:
            e.reduce_once()
