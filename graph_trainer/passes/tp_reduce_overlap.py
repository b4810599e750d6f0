"""`tp_reduce_overlap`: run the weight gradients beside the tensor-parallel reduce-scatters that async_tp leaves.

In a sequence-parallel block's backward the gradient of the block's input is the sum of the input gradients of the
column-parallel matmuls it feeds (wq, wk, wv; w1, w3), reduce-scattered over the TP group. A sum of matmuls is no
pattern async_tp fuses, so it stays an NCCL reduce-scatter, waited for at once by the norm's backward; autograd
interleaves each matmul's weight gradient with its input gradient, so no compute is left to run beside it: at llama3
8B cut to 16 layers, tp 2 on 2 H200s, 5.8 ms of the step's reduce-scatter time stayed exposed
(bench/results/2026-11-30-session28, call 4). The pass moves the ops between the previous communication and each
TP reduce-scatter that its input does not need (the weight gradients, and what reads them there) to just after the
reduce-scatter's issue. A reorder: the same ops on the same values, so losses and gradients are bit for bit the same.
"""

from __future__ import annotations

import torch
from torch import fx

from ..graph_dump import is_collective
from .async_tp import PIPELINED, tp_group
from .bucketing_compat import REDUCE_SCATTER
from .registry import PassContext, PassSpec, register_pass


def _is_barrier(node: fx.Node) -> bool:
    """Where a window of movable ops ends: anything but a pure computation (communication, symmetric memory's fused
    ops, in-place writes, inputs)."""
    # is_collective: waits included
    if node.op != "call_function" or is_collective(node):
        return True
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target.namespace != "aten" or node.target._schema.is_mutable
    return False


def _needed_by(node: fx.Node, window: set[fx.Node]) -> set[fx.Node]:
    """The ops of `window` that `node` reads, directly or through others of them."""
    needed: set[fx.Node] = set()
    todo = [a for a in node.all_input_nodes if a in window]
    while todo:
        n = todo.pop()
        if n not in needed:
            needed.add(n)
            todo.extend(a for a in n.all_input_nodes if a in window)
    return needed


def tp_reduce_overlap(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    group = tp_group(ctx)
    window: list[fx.Node] = []
    moved = sites = 0
    for node in list(gm.graph.nodes):
        # async_tp's own slices are pipelined with their matmuls already
        if node.target is REDUCE_SCATTER and node.args[3] == group and PIPELINED not in node.meta:
            needed = _needed_by(node, set(window))
            later = [n for n in window if n not in needed]
            cursor = node
            for n in later:
                cursor.append(n)
                cursor = n
            moved += len(later)
            sites += bool(later)
            window = []
        elif _is_barrier(node):
            window = []
        else:
            window.append(node)
    gm.graph.lint()
    gm.recompile()
    ctx.report.setdefault("tp_reduce_overlap", {}).update(tp_reduce_overlap_sites=sites, tp_reduce_overlap_ops=moved)
    return gm


register_pass(PassSpec(
    name="tp_reduce_overlap",
    description="ops a TP reduce-scatter's input does not need (the weight gradients) moved after its issue",
    stages=("train_step",),
    modes=("aot_fx_trace",),
    fn=tp_reduce_overlap,
    needs_degrees=("tp",),
))
