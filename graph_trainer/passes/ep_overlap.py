"""ep_overlap: each MoE layer's two token chunks take turns, one chunk's all-to-alls in flight while
the other chunk computes.

The split itself is made while the step is traced (`MoEPlan.chunks`, which `moe_chunks` sets when
this pass is listed): routing and dispatch are data-dependent sorts and scatters, which a graph
rewrite could only reproduce by tracing them again. The traced graph runs chunk 0's dispatch,
experts and combine, then chunk 1's; this pass reorders each layer's span (from its first
all-to-all to its last wait, forward and backward apart) so that a wait comes only when no other
node of the span is ready: while chunk 0's dispatch travels, chunk 1 routes and issues its own;
chunk 0's experts run while chunk 1's tokens travel, and so on. Waits are taken in the order their
all-to-alls were issued, the order one communicator completes them in.

Only the order of nodes changes (every value is computed by the same op from the same inputs), so
the step is bitwise the step without the pass. The split is not: see docs/modes-and-backends.md.

Communicator: NCCL runs the collectives of one communicator one after another. The all-to-alls go
over the sparse mesh's `ep` group; where that group is one another collective uses too (DeviceMesh
gives a dimension spanning every rank the world group, so dp_shard N x ep N shares it with the FSDP
collectives), a chunk's all-to-all would queue behind a gradient reduce-scatter: they move to a
communicator of their own over the same ranks (parallel/links.py all_to_all_twins).
"""

from __future__ import annotations

import heapq

import torch.distributed as dist
from torch import fx

from ..blocks import node_block
from ..graph_dump import is_collective
from ..parallel.expert_parallel import CHUNK_KEY
from ..parallel.links import all_to_all_twins
from ..step_watchdog import group_timeout
from .bucketing_compat import ALL_TO_ALL, WAIT
from .collectives import forward_end
from .registry import PassContext, PassSpec, register_pass

CHUNKS = 2


def moe_chunks(cfg) -> int:
    """Token chunks per MoE layer the job traces: two when this pass runs."""
    return CHUNKS if "ep_overlap" in cfg.compile.passes else 1


def node_chunk(node: fx.Node) -> int | None:
    return (node.meta.get("custom") or {}).get(CHUNK_KEY)


def _wait_of(node: fx.Node) -> fx.Node | None:
    waits = [u for u in node.users if u.target is WAIT]
    return waits[0] if len(waits) == 1 else None


def layer_spans(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """Per MoE layer and phase (forward, backward): the nodes from its first all-to-all to its last
    wait, in graph order."""
    order = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    boundary = forward_end(gm)
    bounds: dict[tuple, list[int]] = {}
    for node in gm.graph.find_nodes(op="call_function", target=ALL_TO_ALL):
        wait = _wait_of(node)
        if wait is None:
            continue
        key = (node_block(node), pos[node] > boundary)
        lo, hi = bounds.setdefault(key, [pos[node], pos[wait]])
        bounds[key] = [min(lo, pos[node]), max(hi, pos[wait])]
    return [order[lo : hi + 1] for lo, hi in sorted(bounds.values())]


def interleave(span: list[fx.Node]) -> list[fx.Node]:
    """A topological order of `span` that takes an all-to-all's wait only when nothing else is ready,
    waits in issue order, and otherwise keeps the graph's order."""
    inside = set(span)
    index = {n: i for i, n in enumerate(span)}
    missing = {n: sum(1 for a in n.all_input_nodes if a in inside) for n in span}
    issued: dict[fx.Node, int] = {}
    ready: list[int] = []
    # ready waits as (where their all-to-all went in the new order, their index in the span)
    parked: list[tuple[int, int]] = []
    out: list[fx.Node] = []

    def release(n: fx.Node) -> None:
        if n.target is WAIT and n.args[0] in issued:
            heapq.heappush(parked, (issued[n.args[0]], index[n]))
        else:
            heapq.heappush(ready, index[n])

    for n in span:
        if missing[n] == 0:
            release(n)
    while ready or parked:
        n = span[heapq.heappop(ready) if ready else heapq.heappop(parked)[1]]
        out.append(n)
        if n.target is ALL_TO_ALL:
            issued[n] = len(out)
        for user in n.users:
            if user in inside:
                missing[user] -= 1
                if missing[user] == 0:
                    release(user)
    assert len(out) == len(span), "the span of a MoE layer depends on a node after it"
    return out


def _own_communicator(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Move the all-to-alls to a twin of their group where another collective uses that group."""
    a2a = gm.graph.find_nodes(op="call_function", target=ALL_TO_ALL)
    groups = {n.args[3] for n in a2a}
    shared = {n.args[-1] for n in gm.graph.nodes if n.op == "call_function" and n.target not in (ALL_TO_ALL, WAIT)
              and is_collective(n)} & groups
    if not shared or ctx.meshes is None or not dist.is_initialized():
        return 0
    twins = all_to_all_twins(ctx.meshes, group_timeout(ctx.cfg.comm.timeout_seconds))
    moved = 0
    for node in a2a:
        if node.args[3] in shared and node.args[3] in twins:
            node.update_arg(3, twins[node.args[3]])
            moved += 1
    return moved


def ep_overlap(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    spans = layer_spans(gm)
    for span in spans:
        anchor = span[0].prev
        for node in interleave(span):
            anchor.append(node)
            anchor = node
    moved = _own_communicator(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    chunks = {node_chunk(n) for n in gm.graph.find_nodes(op="call_function", target=ALL_TO_ALL)} - {None}
    ctx.report.setdefault("ep_overlap", {}).update(
        moe_spans_interleaved=len(spans), moe_chunks=len(chunks), all_to_alls_on_twin=moved)
    return gm


register_pass(PassSpec(
    name="ep_overlap",
    description="each MoE layer's tokens in two chunks; one chunk's all-to-alls overlap the other's router and experts",
    stages=("train_step",),
    modes=("aot_fx_trace",),
    fn=ep_overlap,
    needs_degrees=("ep",),
))
