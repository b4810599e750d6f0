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

from typing import Any, Callable, Sequence

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


def shards_total_norm(specs: Sequence[Any], grads: Sequence[torch.Tensor], ep_enabled: bool) -> torch.Tensor:
    """`total_norm` of the gradients whose local shards are `grads`, placed as `specs` say (`train_step.ParamSpec`),
    for a step being traced. Where every gradient lies on one mesh with one placement and one dtype, sharded along at
    most one mesh dimension of more than one rank (FSDP, HSDP, one rank), the ops DTensor's dispatch issues are
    issued on the shards themselves: each shard's norm (`_foreach_norm`, chunked as `_norm`), their stack, and where
    a dimension shards them, the square, the sum across its ranks, the square root; then the norm of that vector.
    The same ops in the same order, so the same bits (tests/test_clipping.py compares the traced graphs); what is
    left out is DTensor's work on the host, a `from_local` and a sharding propagation per gradient: llama3 8B's step
    with the in-graph optimizer, as one rank of dp_shard 8 on one H200, traced in 3.2-4.1 s instead of 3.8-4.4 s
    (bench/results/2026-12-01-session32, call 4). Anything else (several meshes or placements, sharded along two
    dimensions, expert parallelism) goes through DTensor."""
    placed = {(id(s.mesh), tuple(s.placements)) for s in specs}
    if ep_enabled or len(placed) != 1 or len({(g.device, g.dtype) for g in grads}) != 1:
        return total_norm([s.wrap(g) for s, g in zip(specs, grads)], ep_enabled)
    mesh, placements = specs[0].mesh, specs[0].placements
    # DTensor leaves a mesh dimension of one rank as it is: no reduction across it
    sharded = [d for d, p in enumerate(placements) if mesh.size(d) > 1 and not p.is_replicate()]
    if len(sharded) > 1 or any(not placements[d].is_shard() for d in sharded):
        return total_norm([s.wrap(g) for s, g in zip(specs, grads)], ep_enabled)
    norms = torch.stack([n for i in range(0, len(grads), NORM_CHUNK) for n in torch._foreach_norm(list(grads[i : i + NORM_CHUNK]), 2.0)])
    if sharded:
        summed = torch.ops._c10d_functional.all_reduce(norms**2.0, "sum", mesh.get_group(sharded[0]).group_name)
        norms = torch.ops._c10d_functional.wait_tensor(summed) ** 0.5
    return torch.linalg.vector_norm(norms, 2.0)


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
