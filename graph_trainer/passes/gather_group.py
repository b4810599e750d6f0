"""separate_gather_group: the FSDP parameter all-gathers run on a communicator of their own.

NCCL runs the collectives of one communicator one after another on its stream. In backward the
next block's all-gather (prefetch) and the current block's gradient reduce-scatter are both in
flight, so on one communicator the reduce-scatter waits for the all-gather, and the block's compute
waits for both. With the all-gathers on a second communicator over the same ranks (what upstream
graph_trainer and FSDP2 do with their own process groups and streams), the two run at once.

The twin communicators come from `parallel/links.py`. Only the group name of each all-gather node
changes: same ranks, same data, bitwise the same step.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import fx

from ..parallel.links import gather_twins
from ..step_watchdog import group_timeout
from .bucketing_compat import ALL_GATHER, ancestors
from .registry import PassContext, PassSpec, register_pass


def gathers_parameters(node: fx.Node, params: set[fx.Node]) -> bool:
    """Whether the all-gather's input derives from parameter inputs alone: one parameter's shard, or
    a bucket of them (after a bucketing pass merged them); never an activation (tensor parallelism)."""
    found = False
    for n in ancestors(node):
        if n.op == "placeholder":
            if n not in params:
                return False
            found = True
    return found


def separate_gather_group(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.meshes is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return gm
    twins = gather_twins(ctx.meshes, group_timeout(ctx.cfg.comm.timeout_seconds))
    params = set(gm.graph.find_nodes(op="placeholder")[: ctx.num_params])
    moved = 0
    for node in gm.graph.find_nodes(op="call_function", target=ALL_GATHER):
        name = node.args[2]
        if name in twins and gathers_parameters(node, params):
            node.update_arg(2, twins[name])
            moved += 1
    ctx.report.setdefault("separate_gather_group", {})["gathers_on_own_group"] = moved
    gm.recompile()
    return gm


register_pass(PassSpec(
    name="separate_gather_group",
    description="FSDP all-gathers on a second communicator of the same ranks, so they run beside the reduce-scatters",
    stages=("train_step",),
    modes=("aot_fx_trace",),
    fn=separate_gather_group,
))
