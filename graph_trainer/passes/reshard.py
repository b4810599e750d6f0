"""reshard_after_forward: free gathered parameters after forward and gather them again for backward.

In the single train-step graph an all-gathered parameter is used by forward and again by backward
(weight gradients of the input need the weight), so it stays alive from its forward use to its last
backward use: every parameter is held unsharded across the loss. This pass gives each such
parameter a second all-gather (same input shard) placed before its first backward use, and points
the backward uses at it, along with copies of the one-input ops (views, casts) forward applied to the
gathered value. The forward copy then dies after its last forward use.

It acts when `parallelism.reshard_after_forward` is `always` or `default` (traced modes reshard by
default) and leaves the graph as is for `never`. Run it before any bucketing pass: those then bucket
the backward all-gathers too, per block or by the cost model, and prefetch them in backward.
Parameters that activation checkpointing already gathers again in backward have no backward use of
the forward copy, so the pass is a no-op on them (and on a graph it already resharded).
"""

from __future__ import annotations

from torch import fx

from .bucketing import emit, find_collectives, forward_end
from .bucketing_compat import ALL_GATHER, WAIT
from .registry import GRAPH_MODES, PassContext, PassSpec, register_pass


def enabled(ctx: PassContext) -> bool:
    return ctx.cfg.parallelism.reshard_after_forward in ("always", "default")


def _forward_derived(wait: fx.Node, pos: dict[fx.Node, int], boundary: int) -> dict[fx.Node, fx.Node]:
    """Forward nodes computed from the gathered value alone, each mapped to its one input."""
    parent: dict[fx.Node, fx.Node] = {}
    frontier = [wait]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.op == "call_function" and pos[user] <= boundary and user.all_input_nodes == [node]:
                parent[user] = node
                frontier.append(user)
    return parent


def reshard_after_forward(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if not enabled(ctx):
        return gm
    graph = gm.graph
    boundary = forward_end(gm)
    pos = {n: i for i, n in enumerate(graph.nodes)}
    changed = False
    for c in find_collectives(gm):
        if c.kind != "all_gather" or pos[c.start] > boundary:
            continue
        parent = _forward_derived(c.wait, pos, boundary)
        values = [c.wait, *parent]
        late_uses = {v: [u for u in v.users if pos[u] > boundary] for v in values}
        late_uses = {v: us for v, us in late_uses.items() if us}
        if not late_uses:
            continue
        needed: set[fx.Node] = set()
        for v in late_uses:
            while v not in needed and v is not c.wait:
                needed.add(v)
                v = parent[v]
        first_use = min((u for us in late_uses.values() for u in us), key=pos.__getitem__)
        with graph.inserting_before(first_use):
            start = emit(graph, ALL_GATHER, *c.start.args)
            copies = {c.wait: emit(graph, WAIT, start)}
            for node in sorted(needed, key=pos.__getitem__):
                copies[node] = graph.node_copy(node, lambda n: copies[n])
        for value, users in late_uses.items():
            for user in users:
                user.replace_input_with(value, copies[value])
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm


register_pass(PassSpec(
    name="reshard_after_forward",
    description="gather each FSDP parameter again for backward so forward's copy is freed "
                "(follows parallelism.reshard_after_forward; run before bucketing)",
    # Only the single train-step graph holds both uses; in aot/jit the partitioner decides what backward
    # saves, and apply_passes skips this pass on their forward/backward graphs.
    stages=("train_step",),
    modes=GRAPH_MODES,
    fn=reshard_after_forward,
))
