"""Estimated times for the collective scheduling passes and the autoparallel backend.

- Collectives: an alpha-beta (latency-bandwidth) model of a ring collective on the process group's
  ranks: `(n-1) * latency + (n-1)/n * bytes / bandwidth` for all-gather and reduce-scatter (twice
  that for all-reduce), with the link of the mesh dimension (inside one host or across hosts).
- Compute: a roofline per aten node, `max(FLOPs / achieved FLOP/s, bytes moved / achieved memory
  bandwidth)`; views cost nothing. With `fused=True` (the graph will be compiled whole by Inductor)
  pointwise and reduction ops are charged only for writing their output, since their inputs stay in
  registers inside fused kernels.
- A timeline of one step: compute runs in graph order, collectives run one after another on one
  communication stream from the point they are issued; a wait stalls compute until its collective
  is done. The schedulers compare plans by the simulated step time.

The figures are per device kind, never measured per run: every rank must derive the same plan
(same collectives, same order) from the same graph, or the ranks deadlock.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
from torch import fx

from ..graph_dump import nbytes

from .bucketing_compat import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, WAIT, node_flops

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class Hardware:
    """Achieved (not spec-sheet) rates of one device kind and its links."""

    name: str
    flops: dict[torch.dtype, float]
    """Matmul FLOP/s by dtype; dtypes not listed use the float32 figure."""
    mem_bw: float
    intra_bw: float
    """Bytes/s one rank sends around a ring inside one host."""
    intra_latency: float
    """Seconds per ring step inside one host."""
    inter_bw: float
    inter_latency: float
    launch_s: float
    """Host time to issue one collective and wait for it."""
    max_bucket_bytes: int
    max_in_flight_bytes: int
    """Gathered bytes that may be in flight (issued, not yet consumed) at once."""


# Calibrated on the shared CPU machines (2 ranks, gloo over loopback, one thread each): a 2-rank
# all-gather took 0.25 ms at 8 KB and moved 0.2-0.5 GB/s, fp32 mm ran at 23 GFLOP/s, copies at 2-4 GB/s.
CPU_GLOO = Hardware(
    name="cpu-gloo",
    flops={torch.float32: 25e9, torch.bfloat16: 8e9, torch.float16: 8e9},
    mem_bw=4e9,
    intra_bw=0.5e9,
    intra_latency=150e-6,
    inter_bw=0.5e9,
    inter_latency=150e-6,
    launch_s=30e-6,
    max_bucket_bytes=64 * MiB,
    max_in_flight_bytes=256 * MiB,
)

# 70% of the dense spec peaks (989 TFLOP/s bf16, 67 TFLOP/s fp32), NCCL ring bus bandwidth over
# NVLink inside a host and one 400 Gb/s NIC per GPU across hosts.
H100 = Hardware(
    name="h100",
    flops={torch.bfloat16: 0.7 * 989e12, torch.float16: 0.7 * 989e12, torch.float32: 0.7 * 67e12},
    mem_bw=0.7 * 3.35e12,
    intra_bw=360e9,
    intra_latency=10e-6,
    inter_bw=40e9,
    inter_latency=20e-6,
    launch_s=8e-6,
    max_bucket_bytes=1 * GiB,
    max_in_flight_bytes=5 * GiB,
)
H200 = Hardware(**{**H100.__dict__, "name": "h200", "mem_bw": 0.7 * 4.8e12})


def hardware_for(device: torch.device) -> Hardware:
    if device.type != "cuda":
        return CPU_GLOO
    return H200 if "H200" in torch.cuda.get_device_name(device) else H100


@dataclass(frozen=True)
class Link:
    size: int
    inter_host: bool


def mesh_links(meshes: Any) -> dict[str, Link]:
    """Process group name -> (size, whether its ranks span hosts), for every mesh dimension."""
    if meshes is None or not torch.distributed.is_initialized():
        return {}
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", torch.distributed.get_world_size()))
    links: dict[str, Link] = {}
    for mesh in (meshes.dense, getattr(meshes, "sparse", None)):
        if mesh is None:
            continue
        for dim in range(mesh.ndim):
            group = mesh.get_group(dim)
            ranks = torch.distributed.get_process_group_ranks(group)
            links[group.group_name] = Link(len(ranks), len({r // per_host for r in ranks}) > 1)
    return links


_FREE_TARGETS = {torch.ops.aten._unsafe_view.default, WAIT, ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE}


@dataclass
class CostModel:
    hw: Hardware
    links: dict[str, Link] = field(default_factory=dict)
    fused: bool = False

    @classmethod
    def for_context(cls, ctx: Any, fused: bool = False) -> "CostModel":
        return cls(hardware_for(ctx.device), mesh_links(ctx.meshes), fused)

    def _link(self, group_name: str) -> tuple[float, float]:
        link = self.links.get(group_name)
        if link is not None and link.inter_host:
            return self.hw.inter_bw, self.hw.inter_latency
        return self.hw.intra_bw, self.hw.intra_latency

    def collective_time(self, kind: str, nbytes: int, group_size: int, group_name: str = "") -> float:
        """Seconds for one ring collective; `nbytes` is the unsharded size (gathered output,
        reduce-scatter input, all-reduce tensor)."""
        if group_size <= 1:
            return 0.0
        bw, latency = self._link(group_name)
        steps = group_size - 1
        one_pass = steps * latency + steps / group_size * nbytes / bw
        return 2 * one_pass if kind == "all_reduce" else one_pass

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
        out = node.meta.get("val")
        flops = node_flops(node)
        fusible = torch.Tag.pointwise in target.tags or torch.Tag.reduction in target.tags
        if self.fused and fusible:
            moved = nbytes(out)
        else:
            moved = nbytes(out) + sum(nbytes(a.meta.get("val")) for a in node.all_input_nodes)
        dtype = out.dtype if isinstance(out, torch.Tensor) else torch.float32
        rate = self.hw.flops.get(dtype, self.hw.flops[torch.float32])
        return max(flops / rate, moved / self.hw.mem_bw)


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
