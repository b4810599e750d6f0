"""Gradient clipping by the total 2-norm, as torchtitan's `clip_grad_norm_` defines it, for the eager
optimizer step and for the one traced into the graph (capture/optimizer_in_graph.py).

The norm is computed on the DTensor gradients (a sharded gradient's norm is a partial DTensor whose
`full_tensor()` is the cross-rank reduction); with expert parallelism, the expert and the other
parameters' norms apart, combined. The scaling multiplies each rank's local shards: the same kernel on
the same tensors as DTensor's `_foreach_mul_`, without its sharding propagation, which on torch 2.13
expands every strategy over every mesh dimension, size-1 dimensions too: at the first step of the
llama3 debug model on one CPU rank (57 gradients on the 3-D dense mesh) clipping took 0.89 s through
torchtitan's `clip_grad_norm_` and takes 0.03 s here; losses and grad norms are bitwise the same.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.distributed.tensor import DTensor

EP_DIM = "ep"
"""A gradient on a mesh with this dimension is an expert parameter's (torchtitan's rule for clipping)."""


NORM_CHUNK = 32
"""Gradients per `_foreach_norm` call. DTensor's sharding propagation of one foreach call grows with the square of
its tensors: with 291 gradients sharded 8 ways (llama3 8B's count, the debug model's sizes, CPU) the first norm took
0.15 s in one call and 0.05 s in calls of 32, and under the trace of the in-graph optimizer the one call took 0.75 s
of cProfile's 9.2 s. Each gradient's norm is its own reduction either way, stacked in the same order."""


def _norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    grads = list(grads)
    if not grads or len({(g.device, g.dtype) for g in grads}) > 1:
        # torch groups the norms by device and dtype, which orders their sum
        norm = torch.nn.utils.get_total_norm(grads, 2.0, False, True)
    else:
        norms = [n for i in range(0, len(grads), NORM_CHUNK) for n in torch._foreach_norm(grads[i : i + NORM_CHUNK], 2.0)]
        norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def is_expert_grad(g: torch.Tensor) -> bool:
    return isinstance(g, DTensor) and EP_DIM in (g.device_mesh.mesh_dim_names or ())


def join_norms(ep_norm: torch.Tensor, dense_norm: torch.Tensor) -> torch.Tensor:
    """The total norm from the expert gradients' and the others' (each reduced over its own mesh)."""
    return (ep_norm**2.0 + dense_norm**2.0) ** 0.5


def total_norm(grads: Sequence[torch.Tensor], ep_enabled: bool) -> torch.Tensor:
    """The total 2-norm over all gradients and ranks, a plain 0-dim tensor."""
    if not ep_enabled:
        return _norm(grads)
    is_ep = [is_expert_grad(g) for g in grads]
    return join_norms(_norm([g for g, e in zip(grads, is_ep) if e]), _norm([g for g, e in zip(grads, is_ep) if not e]))


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(max_norm / (norm + 1e-6), 1): with max_norm inf the gradients are scaled by exactly 1."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


@torch.no_grad()
def clip_grad_norm_(params: Sequence[torch.Tensor], max_norm: float, ep_enabled: bool,
                    norm_fn: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
    """Scale the parameters' gradients in place to a total norm of at most `max_norm`; returns the norm.
    `norm_fn` computes the total norm instead (pipeline parallelism: over the stages of other ranks too)."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = norm_fn() if norm_fn is not None else total_norm(grads, ep_enabled)
    coef = clip_coefficient(norm, max_norm)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        by_dtype.setdefault(local.dtype, []).append(local)
    for local in by_dtype.values():
        torch._foreach_mul_(local, coef.to(local[0].device))
    return norm
