"""Where the host transfers of offloaded activations go in a step, how long compute would wait for
them, and the rewrite that puts `offload_ops` there.

Positions are indices into a `liveness` schedule (the graph's node order, or a schedule a pass
simulates before rewriting), whose steps' ops take `step_time` seconds each, one after another on
the compute stream. Each direction of the host link is one FIFO queue (one side stream each):

- D2H: issued right after the activation is made (the earliest its bytes exist; the copy only reads
  them, so forward goes on using them). It starts when the link is free; its wait goes at the first
  step after the activation's last forward read by which compute has run past the copy's end, so
  compute never stalls there and the device copy is freed as soon as the data is on the host.
- H2D: planned backwards from the first backward read: the copy must end by then and before the next
  reload (in use order) starts; it is issued at the latest step whose start leaves it that time.
  Its wait goes just before that first read.

Copy times are the hardware's (`Hardware.host_transfer_s`) times `MARGIN`, since op times are
roofline estimates. Where compute cannot cover a copy (no host link, or too little compute in the
window), the offload still works but stalls: its wait goes right after the last forward read and
its reload right before the first backward read, and `exposed_s` says how long compute would wait.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch import fx

from ..graph_dump import nbytes
from ..hardware import Hardware
from .compat import detect_fake_mode
from .liveness import Step
from .offload_ops import OFFLOAD, RELOAD, WAIT_OFFLOAD, WAIT_RELOAD

OFFLOADED = "offloaded"
"""`node.meta["memory_policy"]` of the nodes the rewrite adds, and the key tag of simulated reloads."""
MARGIN = 1.25
"""Copy times are stretched by this much before they count as hidden behind estimated compute."""


@dataclass(frozen=True)
class Transfer:
    """One offloaded activation's four points in a schedule: the offload is issued right after step
    `start`, its wait, the reload and the reload's wait go right before steps `wait`, `reload`, `use`."""

    root: fx.Node
    start: int
    wait: int
    reload: int
    use: int
    seconds: float
    """One copy's time (either direction), with the margin."""
    exposed_s: float
    """How long compute would stall at the two waits."""


@dataclass(frozen=True)
class _Reads:
    start: int
    last_forward: int
    first_backward: int


def _reads(steps: Sequence[Step], roots: set[fx.Node], boundary: int) -> dict[fx.Node, _Reads]:
    start: dict[fx.Node, int] = {}
    last: dict[fx.Node, int] = {}
    first: dict[fx.Node, int] = {}
    for i, (key, _, inputs) in enumerate(steps):
        if key in roots:
            start[key] = last[key] = i
        for read in inputs.values():
            if read in roots:
                if i <= boundary:
                    last[read] = i
                elif read not in first:
                    first[read] = i
    return {r: _Reads(start[r], last[r], first[r]) for r in roots if r in first and r in start}


def windows(steps: Sequence[Step], boundary: int) -> dict[fx.Node, tuple[int, int]]:
    """Each forward value's (last forward read, first backward read) in `steps`, for values read on
    both sides of `boundary` (the loss's step)."""
    roots = {key for key, node, _ in steps[: boundary + 1] if isinstance(key, fx.Node) and key is node}
    return {r: (x.last_forward, x.first_backward) for r, x in _reads(steps, roots, boundary).items()}


def place(steps: Sequence[Step], roots: Iterable[fx.Node], boundary: int, step_time: Callable[[fx.Node], float],
          hw: Hardware) -> dict[fx.Node, Transfer]:
    """The transfers of `roots` (forward values read after `boundary`) in `steps`."""
    reads = _reads(steps, set(roots), boundary)
    prefix = [0.0]
    for _, node, _ in steps:
        prefix.append(prefix[-1] + (step_time(node) if node is not None else 0.0))
    seconds = {r: MARGIN * hw.host_transfer_s(nbytes(r.meta.get("val"))) for r in reads}

    waits: dict[fx.Node, tuple[int, float]] = {}
    link_free = 0.0
    for root in sorted(reads, key=lambda r: reads[r].start):
        x = reads[root]
        done = max(prefix[x.start + 1], link_free) + seconds[root]
        link_free = done
        wait = bisect.bisect_left(prefix, done, lo=x.last_forward + 1)
        if wait < x.first_backward:
            waits[root] = (wait, 0.0)
        else:
            waits[root] = (x.last_forward + 1, done - prefix[x.last_forward + 1])

    plan: dict[fx.Node, Transfer] = {}
    next_start = float("inf")
    for root in sorted(reads, key=lambda r: reads[r].first_backward, reverse=True):
        x = reads[root]
        wait, exposed = waits[root]
        begin = min(prefix[x.first_backward], next_start) - seconds[root]
        reload = bisect.bisect_right(prefix, begin) - 1
        if wait < reload <= x.first_backward:
            next_start = begin
        else:
            reload = x.first_backward
            exposed += seconds[root]
        plan[root] = Transfer(root, x.start, wait, reload, x.first_backward, seconds[root], exposed)
    return plan


def with_transfers(steps: Sequence[Step], plan: dict[fx.Node, Transfer]) -> list[Step]:
    """`steps` as the rewrite leaves them, for the liveness simulation: the activation is read last by
    its offload's wait; the reload allocates its copy, which the backward reads take instead."""
    before: dict[int, list[Step]] = {}
    for t in plan.values():
        before.setdefault(t.wait, []).append(((WAIT_OFFLOAD, t.root), None, {t.root: t.root}))
    for t in plan.values():
        before.setdefault(t.reload, []).append(((OFFLOADED, t.root), t.root, {}))
    out: list[Step] = []
    for i, (key, node, inputs) in enumerate(steps):
        out.extend(before.get(i, ()))
        moved = {n: (OFFLOADED, k) for n, k in inputs.items() if k in plan and i >= plan[k].use}
        out.append((key, node, {**inputs, **moved}) if moved else (key, node, inputs))
    return out


def insert_transfers(gm: fx.GraphModule, plan: dict[fx.Node, Transfer]) -> fx.GraphModule:
    """Rewrite the graph with `plan`, whose positions are indices into its node list."""
    graph = gm.graph
    nodes = list(graph.nodes)
    hosts: dict[fx.Node, fx.Node] = {}
    copies: dict[fx.Node, fx.Node] = {}

    def add(target: torch._ops.OpOverload, args: tuple, name: str, val: object) -> fx.Node:
        node = graph.create_node("call_function", target, args, name=name)
        node.meta = {"val": val, "memory_policy": OFFLOADED}
        return node

    for root, t in plan.items():
        val = root.meta["val"]
        with graph.inserting_after(root):
            hosts[root] = add(OFFLOAD, (root,), f"offload_{root.name}", _fake_like(val, torch.device("cpu")))
    for root, t in plan.items():
        with graph.inserting_before(nodes[t.wait]):
            add(WAIT_OFFLOAD, (hosts[root], root), f"wait_offload_{root.name}", None)
    for root, t in plan.items():
        with graph.inserting_before(nodes[t.reload]):
            copies[root] = add(RELOAD, (hosts[root], root.meta["val"].device), f"reload_{root.name}",
                               _fake_like(root.meta["val"], root.meta["val"].device))
    pos = {n: i for i, n in enumerate(nodes)}
    for root, t in plan.items():
        with graph.inserting_before(nodes[t.use]):
            add(WAIT_RELOAD, (copies[root], hosts[root]), f"wait_reload_{root.name}", None)
        for user in list(root.users):
            if user in pos and pos[user] >= t.use:
                user.replace_input_with(root, copies[root])
    graph.lint()
    gm.recompile()
    return gm


def _fake_like(val: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A value of `val`'s layout on `device`, in `val`'s fake mode when it has one (the traced graphs')."""
    mode = detect_fake_mode([val])
    if mode is None:
        return torch.empty_strided(val.size(), val.stride(), dtype=val.dtype, device="meta")
    with mode:
        return torch.empty_strided(val.size(), val.stride(), dtype=val.dtype, device=device)
