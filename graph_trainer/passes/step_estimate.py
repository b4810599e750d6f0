"""The cost model's estimate of one graph as the backend compiles it (`apply_passes` prices the graph
that reaches the first compiling pass; the last call for a stage wins: in aot_fx_trace the backend's,
after the parameter and activation policies, so the memory policy's recomputed ops are priced, and after
the scheduling passes, so their buckets, copies and issue points are): the step time with every
collective where the graph issues and waits for it (`bucket_plan.as_issued`) and the memory it implies
per rank. Only node metadata is read (linear passes over the graph), so every capture pays milliseconds,
not seconds.

Memory, in bytes: parameters (the local shards the graph takes), gradients (as many bytes), AdamW's
two moments; activations saved for backward (forward values a backward node reads, or a partitioned
forward's outputs after the loss), of which `moe_dispatch` are all-to-all buffers; `gathered_params`,
the most all-gathered parameters alive at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from ..graph_dump import collective_kind, nbytes
from ..hardware import OPTIMIZER_BYTES_PER_ELEMENT
from .bucket_plan import as_issued
from .bucketing_compat import WAIT
from .collectives import forward_end
from .cost_model import CostModel, Timeline

FUSED_BACKENDS = ("full", "autoparallel_backend")
"""Backends that compile the whole graph with Inductor: pointwise ops are priced fused."""


@dataclass(frozen=True)
class GraphEstimate:
    stage: str
    schedule: Timeline
    """The graph's step, its collectives where the graph issues and waits for them."""
    optimizer_s: float
    """The optimizer step after the graph (AdamW over the local shards, memory bound); 0 when the
    update is traced into the graph (`--compile.optimizer_in_graph`), whose ops the schedule prices."""
    memory: dict[str, float]
    hardware: dict[str, Any]

    @property
    def step_s(self) -> float:
        return self.schedule.step_s + self.optimizer_s

    @property
    def exposed_comm_s(self) -> float:
        """Time compute waits for a collective (a profile's collective kernel time no compute overlaps)."""
        return self.schedule.exposed_comm_s

    @property
    def compute_s(self) -> float:
        """The step less the waits: kernels, their launches, bucket copies and the optimizer after the graph."""
        return self.step_s - self.exposed_comm_s

    @property
    def comm_s(self) -> float:
        return self.schedule.comm_s


def _saved(gm: fx.GraphModule, stage: str) -> list[fx.Node]:
    """The values kept from forward for backward."""
    order = list(gm.graph.nodes)
    if stage == "backward":
        return []
    if stage == "forward":
        outputs = order[-1].args[0]
        return [n for n in outputs[1:] if isinstance(n, fx.Node)] if isinstance(outputs, (list, tuple)) else []
    boundary = forward_end(gm)
    pos = {n: i for i, n in enumerate(order)}
    return [n for n in order[:boundary] if n.op != "placeholder" and any(pos[u] > boundary and u.op != "output" for u in n.users)]


def _peak_gathered(gm: fx.GraphModule) -> int:
    """Most bytes of all-gather results alive at once (from each wait to its last reader)."""
    order = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    frees: dict[int, int] = {}
    live = peak = 0
    for i, n in enumerate(order):
        live -= frees.pop(i, 0)
        if n.target is WAIT and collective_kind(n.args[0]) == "all_gather":
            size = nbytes(n.meta.get("val"))
            live += size
            end = max((pos[u] for u in n.users), default=i) + 1
            frees[end] = frees.get(end, 0) + size
            peak = max(peak, live)
    return peak


def estimate_graph(gm: fx.GraphModule, ctx: Any) -> GraphEstimate:
    """`ctx`: the graph's PassContext (config, meshes, device, stage, number of parameter inputs)."""
    model = CostModel.for_context(ctx, fused=ctx.cfg.compile.inductor_compilation in FUSED_BACKENDS)
    timeline = as_issued(gm, model)
    memory = dict.fromkeys(("params", "grads", "optimizer", "activations", "moe_dispatch", "gathered_params"), 0.0)
    optimizer_s = 0.0
    if ctx.stage != "backward":
        # aot's parameter inputs include each DTensor's device mesh (an opaque object): tensors only
        shards = [v for n in gm.graph.find_nodes(op="placeholder")[: ctx.num_params] if isinstance(v := n.meta.get("val"), torch.Tensor)]
        params = sum(nbytes(v) for v in shards)
        if not ctx.cfg.compile.optimizer_in_graph:
            optimizer_s = sum(v.numel() for v in shards) * OPTIMIZER_BYTES_PER_ELEMENT / model.hw.mem_bw
        saved = _saved(gm, ctx.stage)
        dispatch = sum(nbytes(n.meta.get("val")) for n in saved if collective_kind(n) == "all_to_all")
        memory.update(params=params, grads=params, optimizer=2 * params, moe_dispatch=dispatch,
                      activations=sum(nbytes(n.meta.get("val")) for n in saved) - dispatch)
    memory["gathered_params"] = _peak_gathered(gm)
    return GraphEstimate(ctx.stage, timeline, optimizer_s, memory, model.hw.describe())
