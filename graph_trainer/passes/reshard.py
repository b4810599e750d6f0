"""reshard_after_forward: `--parallelism.reshard_after_forward` (default / always / never) in the
graph modes. Every capture runs it first (it is not listed in `--compile.passes`); eager mode does the
same through autograd's saved-tensor hooks (`parallel/simple_fsdp.py`, where the policy is defined:
`resharded_params`).

Which gathers: the FSDP all-gathers of parameters (`collectives.find_collectives`), named through
the parameter placeholder they read; a parameter the policy keeps is left as traced.

- `train_step` (aot_fx_trace): an all-gathered parameter is used by forward and again by backward
  (weight gradients of the input need the weight), so it stays alive from its forward use to its last
  backward use. For each resharded parameter a second all-gather (same input shard) is placed before
  its first backward use, with copies of the one-input ops (views, casts) forward applied to the
  gathered value, and the backward uses point at them: the forward copy dies after its last forward
  use. Bucketing passes after it bucket and prefetch the backward all-gathers too.
- `joint` (aot, jit): the all-gather and its wait are tagged for the min-cut partitioner, as
  activation checkpointing tags ops: must-recompute for a resharded parameter (backward gathers it
  again), must-save for a kept one (backward reads the forward copy).

Parameters that activation checkpointing already gathers again in backward have no backward use of
the forward copy, so the pass is a no-op on them (and on a graph it already resharded).
"""

from __future__ import annotations

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from ..parallel.simple_fsdp import resharded_params
from .bucket_merge import emit
from .bucketing_compat import ALL_GATHER, WAIT
from .collectives import Collective, find_collectives, forward_derived, forward_end
from .compat import copy_node_as
from .registry import GRAPH_MODES, PassContext, PassSpec, register_pass

FLAG = "--parallelism.reshard_after_forward"
AC_GRAPH_ID = 100_000
"""The partitioner saves values on the border of two checkpointed regions with nearby ids: an id
far from activation checkpointing's keeps the tags of the gathers apart from those regions."""


def parameter_passes(cfg) -> list[str]:
    """The passes the parameter policy adds in front of the others (every capture that makes graphs
    runs them; the pass itself reads the policy)."""
    return ["reshard_after_forward"]


def _gathers(gm: fx.GraphModule, ctx: PassContext) -> list[tuple[Collective, bool]]:
    """Each parameter all-gather and whether the policy reshards its parameter."""
    index = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    # Leading inputs in aot and aot_fx_trace; in jit one name per input, '' for those not parameters.
    names = ctx.param_fqns
    resharded = resharded_params([f for f in dict.fromkeys(names) if f], ctx.cfg.parallelism.reshard_after_forward)
    found = []
    for c in find_collectives(gm):
        i = index.get(c.placeholder, len(names)) if c.kind == "all_gather" else len(names)
        if i < len(names) and names[i]:
            found.append((c, names[i] in resharded))
    return found


def _regather_for_backward(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graph = gm.graph
    boundary = forward_end(gm)
    pos = {n: i for i, n in enumerate(graph.nodes)}
    changed = False
    for c, reshard in _gathers(gm, ctx):
        if not reshard or pos[c.start] > boundary:
            continue
        parent = forward_derived(c.wait, pos, boundary)
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
            # from the parameter itself: gathering the forward's input again would keep its cast (a bf16 copy of
            # the shard) alive from forward to backward, 1.7 GB at the loss on llama3 8B at dp_shard 4 with every
            # other block checkpointed; FSDP2 casts again in backward as well
            shard = {c.placeholder: c.placeholder}
            for node in sorted(c.chain, key=pos.__getitem__):
                shard[node] = copy_node_as(graph, node, lambda n: shard.get(n, n), f"regather_{node.name}")
            source, *rest = c.start.args
            start = emit(graph, ALL_GATHER, shard.get(source, source), *rest)
            copies = {c.wait: emit(graph, WAIT, start)}
            for node in sorted(needed, key=pos.__getitem__):
                copies[node] = copy_node_as(graph, node, lambda n: copies[n], f"regather_{node.name}")
        for value, users in late_uses.items():
            for user in users:
                user.replace_input_with(value, copies[value])
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm


def _tag_for_partitioner(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for c, reshard in _gathers(gm, ctx):
        policy = CheckpointPolicy.MUST_RECOMPUTE if reshard else CheckpointPolicy.MUST_SAVE
        for node in (c.start, c.wait):
            node.meta["recompute"] = policy
            node.meta["ac_graph_id"] = AC_GRAPH_ID
    return gm


def reshard_after_forward(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.stage == "joint":
        return _tag_for_partitioner(gm, ctx)
    return _regather_for_backward(gm, ctx)


register_pass(PassSpec(
    name="reshard_after_forward",
    description=f"free gathered parameters after forward, gather again for backward (set by {FLAG})",
    stages=("train_step", "joint"),
    modes=GRAPH_MODES,
    fn=reshard_after_forward,
    set_by=FLAG,
))
