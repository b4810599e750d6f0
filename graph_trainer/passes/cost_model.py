"""Estimated times for the collective scheduling passes, the autoparallel backend and the run's
prediction file, on the numbers of `graph_trainer.hardware` (the solver prices with the same ones).

- Collectives: `hardware.ring_collective_s`, a latency-bandwidth model of a ring collective on the
  process group's ranks: `(n-1) * latency + (n-1)/n * bytes / bandwidth` for all-gather and
  reduce-scatter (twice that for all-reduce), with the link of the mesh dimension (inside one node
  of `gpus_per_node` ranks, or across nodes): the hardware's figures, or, on a real multi-GPU job,
  what `parallel/links.probe` measured on that dimension at start-up.
- Compute: a roofline per kernel on the GPU, `max(FLOPs / achieved FLOP/s, bytes moved / achieved
  memory bandwidth)`; views cost nothing. The host launches kernels one after another at `launch_s`
  each and the GPU runs a kernel once it is launched and the previous one is done (`graph_times`):
  small kernels queued behind a long one cost their GPU time, a run of small kernels the launches.
  Run op by op (no Inductor), every aten op is one kernel that reads its inputs and writes its output.
  With `fused=True` (the graph will be compiled whole by Inductor) the fusible ops (pointwise,
  reductions, casts, copies into inputs and the ops Inductor lowers to those) are grouped into the kernels
  Inductor emits (`fusion_groups`): one memory pass and one launch per group, reading what the group
  takes from outside once and writing only what is read outside it (or what it mutates). Matmuls,
  attention, collectives and the other extern kernels stay one kernel each. A single op priced alone
  (`node_time`, the memory policy's recompute price) costs max(roofline, launch_s).
- A timeline of one step: compute runs in graph order, collectives run one after another on their
  communicator's stream from the point they are issued (two communicators run at once: the FSDP
  all-gathers on their own, passes/gather_group.py); a wait stalls compute until its collective
  is done. A collective that overlaps compute takes `Hardware.collective_slowdown_s` longer and slows
  that compute by `compute_slowdown_s`. Two communicators that are busy together share one link: each is priced at its full
  rate, which is optimistic where both are bandwidth-bound. The FSDP collectives are placed by the planners (`bucket_plan`); every other collective
  is issued and waited for where the traced graph has it. The schedulers compare plans by the
  simulated step time.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Container, Iterable, Sequence

import torch
from torch import fx

from ..graph_dump import collective_kind, nbytes
from ..flops import FLEX_ATTENTION_OPS, node_flops
from ..hardware import Hardware, ring_collective_s, select
from ..parallel.links import made_twins, measured_link

from .bucketing_compat import WAIT


@dataclass(frozen=True)
class Link:
    size: int
    inter_host: bool
    bytes_per_s: float | None = None
    """Measured (parallel/links.probe); None: the hardware's figure for the link kind."""
    latency_s: float | None = None
    all_to_all: tuple[float, float] | None = None
    """(bytes/s, latency per ring step) of its all-to-alls, where the probe timed them (the expert-parallel
    dimension); else all-to-alls are priced with the figures above."""


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
            measured = measured_link(group.group_name)
            exchange = measured_link(group.group_name, "all_to_all")
            links[group.group_name] = Link(len(ranks), len({r // per_host for r in ranks}) > 1,
                                           measured and measured.bytes_per_s, measured and measured.latency_s,
                                           exchange and (exchange.bytes_per_s, exchange.latency_s))
    # twin communicators (made by passes/gather_group.py and ep_overlap.py, never by pricing) share the link
    for name, twin in made_twins():
        if name in links:
            links[twin] = links[name]
    return links


_FREE_TARGETS = {torch.ops.aten._unsafe_view.default, WAIT}
_aten = torch.ops.aten
_LOWERED_TO_FUSED = {
    # casts and copies (a copy_ into a graph input is the store of the kernel that computes its source)
    _aten._to_copy, _aten.copy_, _aten.copy, _aten.clone,
    # fills, computed where they are read
    _aten.full, _aten.full_like, _aten.zeros, _aten.zeros_like, _aten.ones, _aten.ones_like, _aten.fill_,
    _aten.scalar_tensor,
    # decomposed by Inductor into pointwise ops and reductions (indexing becomes indirect loads)
    _aten._softmax, _aten._log_softmax, _aten._softmax_backward_data, _aten._log_softmax_backward_data,
    _aten.nll_loss_forward, _aten.nll_loss_backward, _aten.gather, _aten.embedding, _aten.cat, _aten.stack,
    _aten.slice_scatter, _aten.select_scatter,
}
"""Ops without the pointwise or reduction tag that Inductor nonetheless emits inside fused kernels."""


def _is_alias(node: fx.Node) -> bool:
    """A view or a tuple element: no kernel, the same storage as its input."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and (target.is_view or target is _aten._unsafe_view.default)


def fusible(node: fx.Node) -> bool:
    """Whether Inductor emits `node` inside a fused kernel (else it is an extern kernel of its own:
    matmuls, attention, collectives, scatters with accumulation, sorts)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or _is_alias(node):
        return False
    if collective_kind(node) is not None or target is WAIT:
        return False
    return torch.Tag.pointwise in target.tags or torch.Tag.reduction in target.tags or target.overloadpacket in _LOWERED_TO_FUSED


def _source(node: fx.Node) -> fx.Node:
    """The node that computed the storage `node` reads (through views and tuple elements)."""
    while _is_alias(node) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _numel(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel()
    if isinstance(val, (list, tuple)):
        return max((_numel(v) for v in val), default=0)
    return 0


def _iteration(node: fx.Node) -> int:
    """Elements a fused kernel iterates over for `node`: a reduction's input, any other op's output."""
    out = _numel(node.meta.get("val"))
    if torch.Tag.reduction in node.target.tags:
        return max([out, *(_numel(a.meta.get("val")) for a in node.all_input_nodes)])
    return out


def _same_loop(a: int, b: int) -> bool:
    """One kernel can iterate over both: equal sizes, or one a broadcast/reduction of the other. A
    scalar joins nothing: it is shared by many kernels (the step's learning-rate scalars, the clip
    coefficient) and would otherwise tie every parameter's update into one."""
    if a <= 1 or b <= 1:
        return a == b
    return max(a, b) % min(a, b) == 0


def fusion_groups(order: Sequence[fx.Node], skip: Container[fx.Node] = ()) -> list[list[fx.Node]]:
    """The fused kernels of a graph (nodes in graph order), as Inductor forms them, approximately: a
    fusible op joins the kernel of a fusible producer when it needs no extern kernel's result that
    its producer did not already need (the same `stage`: kernels cannot fuse across a matmul,
    attention or a collective's wait) and both iterate over compatible sizes. Nodes in `skip` (moved
    with collectives) take part in no group."""
    pos = {n: i for i, n in enumerate(order)}
    stage: dict[fx.Node, int] = {}
    parent: dict[fx.Node, fx.Node] = {}

    def find(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in order:
        if n in skip or not fusible(n):
            continue
        parent[n] = n
        sources = [_source(a) for a in n.all_input_nodes]
        stage[n] = max((stage[s] if s in stage else pos.get(s, -1) for s in sources), default=-1)
        size = _iteration(n)
        for s in sources:
            if s in stage and stage[s] == stage[n] and _same_loop(_iteration(s), size):
                parent[find(s)] = find(n)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in parent:
        groups.setdefault(find(n), []).append(n)
    return sorted(groups.values(), key=lambda g: pos[g[-1]])


@dataclass
class CostModel:
    hw: Hardware
    links: dict[str, Link] = field(default_factory=dict)
    fused: bool = False

    @classmethod
    def for_context(cls, ctx: Any, fused: bool = False) -> "CostModel":
        hw = select(ctx.cfg.compile.hardware, ctx.device)
        return cls(hw, mesh_links(ctx.meshes, hw), fused)

    def _link(self, group_name: str, kind: str = "all_gather") -> tuple[float, float]:
        link = self.links.get(group_name)
        bandwidth, latency = self.hw.link(link is not None and link.inter_host)
        if link is not None and kind == "all_to_all" and link.all_to_all is not None:
            return link.all_to_all
        if link is not None and link.bytes_per_s is not None:
            return link.bytes_per_s, link.latency_s
        return bandwidth, latency

    def collective_time(self, kind: str, nbytes: int, group_size: int, group_name: str = "",
                        beside_compute: bool = False) -> float:
        """Seconds for one ring collective; `nbytes` is the unsharded size (gathered output,
        reduce-scatter input, all-reduce tensor, a rank's all-to-all buffer). `beside_compute`: compute kernels
        run while it does (`Hardware.collective_slowdown_s`)."""
        bw, latency = self._link(group_name, kind)
        slower = self.hw.collective_slowdown_s if beside_compute and group_size > 1 else 0.0
        return ring_collective_s(kind, nbytes, group_size, bw, latency) + slower

    def compute_slowdown(self, group_size: int) -> float:
        """What a collective over `group_size` ranks adds to the compute it overlaps (`Hardware.compute_slowdown_s`);
        nothing over one rank, where it moves nothing (as `collective_time` adds nothing to itself there)."""
        return self.hw.compute_slowdown_s if group_size > 1 else 0.0

    def blocking_collective_time(self, node: fx.Node, kind: str) -> float:
        """A collective the schedulers do not move (tensor-parallel activations, all-reduces,
        all-to-alls) holds compute up for its whole time: its wait directly follows in the traced graph."""
        return self.collective_node_time(node, kind) + self.hw.launch_s

    def group_size(self, node: fx.Node, kind: str) -> int:
        """The ranks the collective `node` runs over."""
        if kind in ("all_gather", "reduce_scatter"):
            return node.args[-2]
        link = self.links.get(node.args[-1])
        return link.size if link is not None else 1

    def collective_node_time(self, node: fx.Node, kind: str, beside_compute: bool = False) -> float:
        """Seconds of the collective `node` on its link (no launch)."""
        sent = fx.node.map_arg(node.args[0], lambda n: n.meta.get("val"))
        moved = nbytes(node.meta.get("val")) if kind == "all_gather" else nbytes(sent)
        return self.collective_time(kind, moved, self.group_size(node, kind), node.args[-1], beside_compute)

    def per_byte_time(self, kind: str, nbytes: int, group_size: int, group_name: str = "") -> float:
        return self.collective_time(kind, nbytes, group_size, group_name) / max(nbytes, 1)

    def saturating_bytes(self, kind: str, group_size: int, group_name: str = "", latency_share: float = 0.1) -> int:
        """The smallest bucket whose latency term is at most `latency_share` of its time: below it a
        collective is latency-bound and merging more tensors into it is nearly free."""
        if group_size <= 1:
            return 0
        bw, latency = self._link(group_name, kind)
        # latency * steps = share * (latency * steps + steps/n * S / bw), solved for S.
        return int(math.ceil(latency * group_size * bw * (1 - latency_share) / latency_share))

    def copy_time(self, nbytes: int) -> float:
        """A copy reads and writes every byte once."""
        return 2 * nbytes / self.hw.mem_bw

    def node_time(self, node: fx.Node) -> float:
        """Seconds of one op run as its own kernel, alone: its roofline, at least the launch floor."""
        device = self._device_time(node)
        if device is None:
            return 0.0
        kind = collective_kind(node)
        return device + self.hw.launch_s if kind is not None else max(device, self.hw.launch_s)

    def _device_time(self, node: fx.Node) -> float | None:
        """GPU seconds of the kernel `node` launches when run as its own kernel (None: it launches none)."""
        target = node.target
        if node.op != "call_function":
            return None
        if not isinstance(target, torch._ops.OpOverload):
            if target not in FLEX_ATTENTION_OPS:
                return None
        elif target.is_view or target in _FREE_TARGETS:
            return None
        kind = collective_kind(node)
        if kind is not None:
            return self.collective_node_time(node, kind)
        out = node.meta.get("val")
        inputs = [a.meta.get("val") for a in node.all_input_nodes]
        moved = nbytes(out) + sum(nbytes(v) for v in inputs)
        return self._roofline(node_flops(node), moved, _dtype(out) if out is not None else _operand_dtype(inputs))

    def _roofline(self, flops: float, moved: float, dtype: torch.dtype) -> float:
        return max(flops / self.hw.flops(dtype), moved / self.hw.mem_bw)

    def group_time(self, group: Sequence[fx.Node]) -> float:
        """GPU seconds of one fused kernel: it reads each value it takes from outside once (not the
        destination of a copy_, which it only writes) and writes the values read outside it, the
        graph's outputs and what it mutates."""
        members = set(group)
        read: dict[fx.Node, int] = {}
        written = 0
        flops = 0
        for n in group:
            flops += node_flops(n)
            destination = n.args[0] if n.target.overloadpacket is _aten.copy_ else None
            for a in n.all_input_nodes:
                if _source(a) not in members and a is not destination:
                    read[a] = nbytes(a.meta.get("val"))
            if not n.users or any(u not in members for u in n.users):
                written += nbytes(n.meta.get("val"))
        return self._roofline(flops, sum(read.values()) + written, _dtype(group[-1].meta.get("val")))

    def graph_times(self, order: Sequence[fx.Node], skip: Container[fx.Node] = ()) -> list[float]:
        """Compute seconds at each position of `order` (a graph's nodes in order; those in `skip`
        cost nothing), such that their prefix sums are when the GPU finishes each position.

        Kernels: unfused, every op; fused, every group of `fusion_groups` (at its last member) and
        every extern op. The host launches them one after another, `launch_s` each, and the GPU runs
        each once it is launched and the previous one is done: a kernel behind a long one launches
        while that one runs and costs only its own GPU time, a run of small kernels the host's."""
        kernels: dict[fx.Node, float] = {}
        grouped: set[fx.Node] = set()
        if self.fused:
            for group in fusion_groups(order, skip):
                kernels[group[-1]] = self.group_time(group)
                grouped.update(group)
        for n in order:
            if n not in skip and n not in grouped and (device := self._device_time(n)) is not None:
                kernels[n] = device
        times = []
        host = gpu = 0.0
        for n in order:
            done = gpu
            if n in kernels:
                host += self.hw.launch_s
                gpu = max(gpu, host) + kernels[n]
            times.append(gpu - done)
        return times


def _dtype(out: Any) -> torch.dtype:
    """The first tensor result's dtype (attention returns a tuple: output, logsumexp, ...)."""
    tensors = [v for v in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(v, torch.Tensor)]
    return tensors[0].dtype if tensors else torch.float32


def _operand_dtype(inputs: list[Any]) -> torch.dtype:
    """The rate of an op that writes into an input and returns nothing (losses.add_product_: bf16 operands summed into
    fp32): its narrowest floating operand's, as tensor cores run at the operands' precision."""
    floats = [v.dtype for v in inputs if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return min(floats, key=lambda d: torch.finfo(d).bits, default=torch.float32)


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
    channel: str = ""
    """The communicator (process group name): collectives of one run one after another."""
    kind: str = ""
    """all_gather, reduce_scatter, all_reduce or all_to_all (a bucket's), for `Timeline.exposed_by_kind`."""


@dataclass(frozen=True)
class Timeline:
    step_s: float
    compute_s: float
    exposed_comm_s: float
    comm_s: float
    exposed_by_kind: dict[str, float] = field(default_factory=dict)
    """The exposed time by the kind of the collective each wait stalled for (what a profile's exposed time by
    collective kernel compares with)."""


def prefix_times(times: Sequence[float]) -> list[float]:
    """prefix[i] = time compute reaches position i (the start of node i) with no stalls."""
    out = [0.0]
    for t in times:
        out.append(out[-1] + t)
    return out


def simulate(prefix: Sequence[float], transfers: Iterable[Transfer]) -> Timeline:
    """Step time of compute (prefix times over positions) with the given collectives: FIFO per
    communicator in issue order, stalling compute at each wait until its collective is done."""
    events = []
    for i, t in enumerate(transfers):
        events.append((t.issue, 0, i, t))
        events.append((t.wait, 1, i, t))
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    extra = 0.0
    stalled = 0.0
    by_kind: dict[str, float] = {}
    comm_free: dict[str, float] = {}
    comm_total = 0.0
    done: dict[int, float] = {}
    for pos, is_wait, i, t in events:
        now = prefix[min(pos, len(prefix) - 1)] + extra
        if not is_wait:
            start = max(now, comm_free.get(t.channel, 0.0))
            comm_free[t.channel] = done[i] = start + t.comm_s
            comm_total += t.comm_s
            extra += t.issue_cost_s
        else:
            stall = max(0.0, done[i] - now)
            stalled += stall
            by_kind[t.kind] = by_kind.get(t.kind, 0.0) + stall
            extra += stall + t.wait_cost_s
    end = prefix[-1] + extra
    tail = max(0.0, max(comm_free.values(), default=0.0) - end)
    return Timeline(end + tail, prefix[-1], stalled + tail, comm_total, by_kind)
