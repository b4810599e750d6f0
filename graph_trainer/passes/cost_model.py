"""Estimated times for the collective scheduling passes, the autoparallel backend and the run's
prediction file, on the numbers of `graph_trainer.hardware` (the solver prices with the same ones).

- Collectives: `hardware.ring_collective_s`, a latency-bandwidth model of a ring collective on the
  process group's ranks: `(n-1) * latency + (n-1)/n * bytes / bandwidth` for all-gather and
  reduce-scatter (twice that for all-reduce), with the link of the mesh dimension (inside one node
  of `gpus_per_node` ranks, or across nodes).
- Compute: a roofline per aten node, `max(FLOPs / achieved FLOP/s, bytes moved / achieved memory
  bandwidth)`; views cost nothing. With `fused=True` (the graph will be compiled whole by Inductor)
  pointwise and reduction ops are charged only for writing their output, since their inputs stay in
  registers inside fused kernels. Every kernel costs at least the hardware's per-kernel floor (`launch_s`).
- A timeline of one step: compute runs in graph order, collectives run one after another on one
  communication stream from the point they are issued; a wait stalls compute until its collective
  is done. The schedulers compare plans by the simulated step time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
from torch import fx

from ..graph_dump import collective_kind, nbytes
from ..flops import node_flops
from ..hardware import Hardware, ring_collective_s, select

from .bucketing_compat import WAIT


@dataclass(frozen=True)
class Link:
    size: int
    inter_host: bool


def mesh_links(meshes: Any, hw: Hardware) -> dict[str, Link]:
    """Process group name -> (size, whether its ranks span nodes), for every mesh dimension of the
    job's mesh. Nodes hold `hw.gpus_per_node` ranks: the real job's layout, also when a fake
    process group simulates it on one device."""
    if meshes is None or not torch.distributed.is_initialized():
        return {}
    per_host = hw.gpus_per_node
    links: dict[str, Link] = {}
    for mesh in (meshes.dense, getattr(meshes, "sparse", None)):
        if mesh is None:
            continue
        for dim in range(mesh.ndim):
            group = mesh.get_group(dim)
            ranks = torch.distributed.get_process_group_ranks(group)
            links[group.group_name] = Link(len(ranks), len({r // per_host for r in ranks}) > 1)
    return links


_FREE_TARGETS = {torch.ops.aten._unsafe_view.default, WAIT}
_CAST = torch.ops.aten._to_copy.default


@dataclass
class CostModel:
    hw: Hardware
    links: dict[str, Link] = field(default_factory=dict)
    fused: bool = False

    @classmethod
    def for_context(cls, ctx: Any, fused: bool = False) -> "CostModel":
        hw = select(ctx.cfg.compile.hardware, ctx.device)
        return cls(hw, mesh_links(ctx.meshes, hw), fused)

    def _link(self, group_name: str) -> tuple[float, float]:
        link = self.links.get(group_name)
        return self.hw.link(link is not None and link.inter_host)

    def collective_time(self, kind: str, nbytes: int, group_size: int, group_name: str = "") -> float:
        """Seconds for one ring collective; `nbytes` is the unsharded size (gathered output,
        reduce-scatter input, all-reduce tensor)."""
        bw, latency = self._link(group_name)
        return ring_collective_s(kind, nbytes, group_size, bw, latency)

    def blocking_collective_time(self, node: fx.Node, kind: str) -> float:
        """A collective the schedulers do not move (tensor-parallel activations, all-reduces,
        all-to-alls) holds compute up for its whole time: its wait directly follows in the traced graph."""
        group_name = node.args[-1]
        link = self.links.get(group_name)
        if kind in ("all_gather", "reduce_scatter"):
            size = node.args[-2]
        else:
            size = link.size if link is not None else 1
        sent = fx.node.map_arg(node.args[0], lambda n: n.meta.get("val"))
        moved = nbytes(node.meta.get("val")) if kind == "all_gather" else nbytes(sent)
        return self.collective_time(kind, moved, size, group_name) + self.hw.launch_s

    def per_byte_time(self, kind: str, nbytes: int, group_size: int, group_name: str = "") -> float:
        return self.collective_time(kind, nbytes, group_size, group_name) / max(nbytes, 1)

    def saturating_bytes(self, kind: str, group_size: int, group_name: str = "", latency_share: float = 0.1) -> int:
        """The smallest bucket whose latency term is at most `latency_share` of its time: below it a
        collective is latency-bound and merging more tensors into it is nearly free."""
        if group_size <= 1:
            return 0
        bw, latency = self._link(group_name)
        # latency * steps = share * (latency * steps + steps/n * S / bw), solved for S.
        return int(math.ceil(latency * group_size * bw * (1 - latency_share) / latency_share))

    def copy_time(self, nbytes: int) -> float:
        """A copy reads and writes every byte once."""
        return 2 * nbytes / self.hw.mem_bw

    def node_time(self, node: fx.Node) -> float:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            return 0.0
        target = node.target
        if target.is_view or target in _FREE_TARGETS:
            return 0.0
        kind = collective_kind(node)
        if kind is not None:
            return self.blocking_collective_time(node, kind)
        out = node.meta.get("val")
        flops = node_flops(node)
        # dtype casts (_to_copy) are pointwise too, though not tagged so
        fusible = torch.Tag.pointwise in target.tags or torch.Tag.reduction in target.tags or target is _CAST
        if self.fused and fusible:
            moved, floor = nbytes(out), 0.0
        else:
            moved = nbytes(out) + sum(nbytes(a.meta.get("val")) for a in node.all_input_nodes)
            floor = self.hw.launch_s
        # the first tensor result's dtype (attention returns a tuple: output, logsumexp, ...)
        tensors = [v for v in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(v, torch.Tensor)]
        dtype = tensors[0].dtype if tensors else torch.float32
        return max(flops / self.hw.flops(dtype), moved / self.hw.mem_bw, floor)


@dataclass(frozen=True)
class Transfer:
    """One collective of a plan, at positions in the compute order."""

    issue: int
    wait: int
    comm_s: float
    issue_cost_s: float = 0.0
    """Compute-side time spent at the issue point (launch, copy into the bucket)."""
    wait_cost_s: float = 0.0
    """Compute-side time spent after the wait (copies out of the bucket)."""


@dataclass(frozen=True)
class Timeline:
    step_s: float
    compute_s: float
    exposed_comm_s: float
    comm_s: float


def prefix_times(times: Sequence[float]) -> list[float]:
    """prefix[i] = time compute reaches position i (the start of node i) with no stalls."""
    out = [0.0]
    for t in times:
        out.append(out[-1] + t)
    return out


def simulate(prefix: Sequence[float], transfers: Iterable[Transfer]) -> Timeline:
    """Step time of compute (prefix times over positions) with the given collectives: FIFO on one
    communication stream in issue order, stalling compute at each wait until its collective is done."""
    events = []
    for i, t in enumerate(transfers):
        events.append((t.issue, 0, i, t))
        events.append((t.wait, 1, i, t))
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    extra = 0.0
    stalled = 0.0
    comm_free = 0.0
    comm_total = 0.0
    done: dict[int, float] = {}
    for pos, is_wait, i, t in events:
        now = prefix[min(pos, len(prefix) - 1)] + extra
        if not is_wait:
            start = max(now, comm_free)
            comm_free = done[i] = start + t.comm_s
            comm_total += t.comm_s
            extra += t.issue_cost_s
        else:
            stall = max(0.0, done[i] - now)
            stalled += stall
            extra += stall + t.wait_cost_s
    end = prefix[-1] + extra
    tail = max(0.0, comm_free - end)
    return Timeline(end + tail, prefix[-1], stalled + tail, comm_total)
