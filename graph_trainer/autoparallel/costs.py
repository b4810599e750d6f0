"""Cost model of the solver: ring collectives per mesh dimension, roofline compute, per-rank memory.

The device and link numbers are `graph_trainer.hardware.Hardware` (H100 by default; `--compile.hardware`
picks another), the same ones the collective scheduling passes and the prediction file use, and a
collective is priced by the same formula (`hardware.ring_collective_s`). A mesh dim stays inside an
8-GPU node (NVLink) when it and the dims after it fit in one, else it crosses nodes (InfiniBand).

Collectives over n ranks of a mesh dimension with bandwidth B and ring step latency L:
all-gather (S->R) and reduce-scatter (P->S): (n-1) L + (n-1)/n * bytes / B with `bytes` the full
(gathered, or pre-scatter) local size; all-reduce (P->R): twice the bytes, one latency; all-to-all
(S(d)->S(d')): (n-1) L + (n-1)/n * bytes / B; R->S is a local slice (free); anything -> Partial is
forbidden. The collectives gather and scatter along tensor dim 0 only (torch's functional
collectives): a reduce-scatter along another tensor dim first packs the chunks (a copy of the whole
local tensor), and a gather along another dim ends in a cat of the chunks (a copy), unless every dim
before it has local size 1 (then the result is a view). Each copy is one kernel priced as a copy
(read and write every byte, at least the per-kernel floor). A multi-dimension redistribution runs
reductions first, then all-to-alls, then gathers from the innermost mesh dimension out, each priced
on the local size at that moment. The gathers of parameters (and the reductions of their gradients)
pay one latency per unit, not per parameter: the bucketing passes merge them per transformer block,
as FSDP implementations do.

Backward: the plan runs as DTensor ops, so autograd's backward of each redistribution is the
reverse one that DTensor performs (gradient layout -> the producer's layout, where a Partial
producer keeps a Replicate/Shard gradient as Replicate), and an input used Replicate by an op whose
other operands or output are not Replicate on that mesh dim gets a Partial gradient. Where nothing
was redistributed in forward, DTensor leaves a Partial gradient as it is, and views and casts pass it
on: their strategies have variants that take it (Strategy.grad_outs), so the reduction is priced once
where the value was redistributed (Megatron's one reduce-scatter for q, k and v), not after each
reader. Backward compute is 2x the forward for matmul-like ops (two matmuls per forward one) and 1x
for the rest; every kernel (forward and backward) costs at least the hardware's per-kernel floor
(`Hardware.launch_s`), which is what small models and the MoE dispatch's many small ops are bound by.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import torch

from ..hardware import Hardware, ring_collective_s, roofline_s
from .strategies import Spec, Strategy, shard_factor


def mesh_links(full_shape: Sequence[int], solver_dims: Sequence[int], hw: Hardware) -> tuple[tuple[float, float], ...]:
    """(bytes/s, ring step latency) per solver dim. Ranks are laid out row-major: a mesh dim stays
    inside a node when it and the dims after it fit."""
    return tuple(hw.link(math.prod(full_shape[d:]) > hw.gpus_per_node) for d in solver_dims)


@dataclass(frozen=True)
class CommModel:
    sizes: tuple[int, ...]
    links: tuple[tuple[float, float], ...]
    """(bytes/s, ring step latency) per solver mesh dim."""
    copy_bytes_per_s: float = math.inf
    """Local memory bandwidth for the reorder copy of a gather or scatter along a tensor dim other than 0."""
    kernel_floor_s: float = 0.0
    """The least time of that copy (`Hardware.launch_s`)."""

    def redistribute(self, nbytes: float, src: Spec, dst: Spec, latency_share: float = 1.0,
                     shape: tuple[int, ...] = ()) -> tuple[float, tuple[tuple[str, float], ...]]:
        """Time in seconds (inf if impossible) and the collectives as (kind, bytes) pairs.
        `latency_share` < 1 prices a collective that is bucketed with others (one alpha per bucket);
        `shape`, the value's global shape, tells whether a gather's result is a view (empty: it is not)."""
        return _redistribute(self, nbytes, src, dst, latency_share, tuple(shape))[:2]

    def collective_times(self, nbytes: float, src: Spec, dst: Spec, latency_share: float = 1.0,
                         shape: tuple[int, ...] = ()) -> tuple[tuple[int, float], ...]:
        """(solver mesh dim, seconds) of each of `redistribute`'s collectives, in its order; the rest of its time is
        local reorder copies (compute-stream work)."""
        return _redistribute(self, nbytes, src, dst, latency_share, tuple(shape))[2]

    def collective(self, kind: str, nbytes: float, mesh_dim: int, latency_share: float = 1.0) -> float:
        """Seconds for one collective on solver mesh dim `mesh_dim`; `nbytes` is the full (gathered,
        pre-scatter, or sent) local size."""
        bw, latency = self.links[mesh_dim]
        return ring_collective_s(kind, nbytes, self.sizes[mesh_dim], bw, latency, latency_share)

    def reorder_copy(self, nbytes: float) -> float:
        """Seconds for the local copy that a gather or scatter along a tensor dim other than 0 adds."""
        return max(2 * nbytes / self.copy_bytes_per_s, self.kernel_floor_s)


@lru_cache(maxsize=None)
def _redistribute(cm: CommModel, nbytes: float, src: Spec, dst: Spec, latency_share: float,
                  shape: tuple[int, ...]) -> tuple[float, tuple[tuple[str, float], ...], tuple[tuple[int, float], ...]]:
    """(seconds, collectives, (mesh dim, seconds) of each collective)."""
    if src == dst:
        return 0.0, (), ()
    cur = list(src)
    for m, (a, b) in enumerate(zip(src, dst)):
        if b.startswith("P") and a != b:
            return math.inf, (), ()
    copy = 0.0
    colls: list[tuple[str, float]] = []
    timed: list[tuple[int, float]] = []

    def run(kind: str, m: int, copies: bool = False) -> None:
        nonlocal copy
        b = nbytes / shard_factor(tuple(cur), cm.sizes)
        timed.append((m, cm.collective(kind, b, m, latency_share)))
        if copies:
            copy += cm.reorder_copy(b)
        colls.append((kind, b))

    def gathers_into_view(dim: int) -> bool:
        """Every tensor dim before `dim` has local size 1 (False where the shape is not given)."""
        if len(shape) <= dim:
            return False
        return all(shape[d] // math.prod(n for p, n in zip(cur, cm.sizes) if p == f"S{d}") == 1 for d in range(dim))

    for m in range(len(cur)):
        if cur[m].startswith("P") and dst[m] != cur[m]:
            run("all_reduce" if dst[m] == "R" else "reduce_scatter", m, dst[m] not in ("R", "S0"))
            cur[m] = dst[m]
    for m in range(len(cur)):
        if cur[m].startswith("S") and dst[m].startswith("S") and cur[m] != dst[m]:
            run("all_to_all", m)
            cur[m] = dst[m]
    for m in reversed(range(len(cur))):
        if cur[m].startswith("S") and dst[m] == "R":
            dim = int(cur[m][1:])
            cur[m] = "R"
            run("all_gather", m, not gathers_into_view(dim))
    return sum(t for _, t in timed) + copy, tuple(colls), tuple(timed)


def grad_spec(strategy: Strategy, arg: int) -> Spec:
    """Layout of the gradient an op's backward produces for input `arg` under `strategy`."""
    if strategy.grad_ins is not None:
        return strategy.grad_ins[arg]
    out = []
    spec = strategy.ins[arg]
    for m, p in enumerate(spec):
        if p.startswith("S"):
            out.append(p)
        elif p.startswith("P"):
            out.append("R")
        else:
            others = [s[m] for i, s in enumerate(strategy.ins) if i != arg] + [s[m] for s in strategy.outs]
            out.append("P" if any(o != "R" for o in others) else "R")
    return tuple(out)


def backward_target(producer: Spec, grad: Spec) -> Spec:
    """Where DTensor's backward of a redistribution sends the gradient: the producer's layout, except
    that a Partial producer receives a Replicate (or Shard -> Replicate) gradient as Replicate."""
    return tuple("R" if p.startswith("P") and not g.startswith("P") else p for p, g in zip(producer, grad))


def work_fraction(strategy: Strategy, sizes: Sequence[int]) -> int:
    """How many ways the op's work is split: mesh dims on which some operand is not replicated."""
    return math.prod(n for m, n in enumerate(sizes) if any(s[m] != "R" for s in strategy.ins + strategy.outs))


def compute_time(flops: float, in_bytes: Sequence[float], out_bytes: Sequence[float], strategy: Strategy,
                 sizes: Sequence[int], dtype: torch.dtype, hw: Hardware, needs_grad: bool) -> float:
    split = work_fraction(strategy, sizes)
    moved = sum(b / shard_factor(s, sizes) for b, s in zip(in_bytes, strategy.ins))
    moved += sum(b / shard_factor(s, sizes) for b, s in zip(out_bytes, strategy.outs))
    t = roofline_s(flops / split, moved, dtype, hw)
    if needs_grad:
        # forward and backward kernels of the same size: one and two with FLOPs, one and one without
        return max(t, hw.launch_s) * (3 if flops else 2)
    return max(t, hw.launch_s)


def state_bytes_per_element(storage_itemsize: int) -> int:
    """Parameter + gradient + two Adam moments, all in the storage dtype."""
    return 4 * storage_itemsize
