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


def _norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    norm = torch.nn.utils.get_total_norm(list(grads), 2.0, False, True)
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
