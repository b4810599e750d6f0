"""Rewriting a graph to a bucket plan: merge each bucket's collectives into one and move its issue
and wait to the planned positions. All ranks run the same graph, so every rank issues the same
collectives in the same order.
- all-gather: the flattened shards are concatenated and gathered once; the result is viewed as
  [ranks, bucket] and each parameter's columns are copied out into its own full tensor;
- reduce-scatter: each gradient is viewed as [ranks, its shard] and the views are concatenated along
  dim 1, so the flat buffer's rank-r block holds rank r's shard of every gradient; one reduce-scatter
  then gives each rank its shard of each gradient as views of one buffer. Every element is reduced
  exactly as before (same ranks, same op), so results are bitwise equal to the unbucketed graph;
- all-reduce: the flattened gradients are concatenated, reduced once and split back into views. The
  same ranks sum each element, but a ring's order of summation depends on the element's place in the
  buffer: bitwise equal on two ranks (one addition), not beyond.
A merged collective carries `node.meta["bucket_size"]` (tensors in it) for the graph dumps.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from ..graph_dump import BUCKET_META
from .bucket_plan import Bucket, Layout
from .bucketing_compat import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, WAIT, fake_mode_of
from .collectives import REDUCTIONS

aten = torch.ops.aten


def emit(graph: fx.Graph, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
    """A new call node with its `meta["val"]` computed on the fake values of its inputs."""
    node = graph.call_function(target, args, kwargs)
    vargs, vkwargs = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    if target is operator.getitem:
        node.meta["val"] = vargs[0][vargs[1]]
    else:
        leaves: list[Any] = []
        fx.node.map_aggregate((vargs, vkwargs), leaves.append)
        with fake_mode_of(leaves):
            node.meta["val"] = target(*vargs, **vkwargs)
    return node


def _contiguous(graph: fx.Graph, node: fx.Node) -> fx.Node:
    if node.meta["val"].is_contiguous():
        return node
    return emit(graph, aten.clone.default, node, memory_format=torch.contiguous_format)


def _hoist(chain: list[fx.Node], before: fx.Node) -> None:
    """Move the nodes of an all-gather's input chain that come after `before` to just before it.
    Nodes compare by their place in the graph (fx keeps a sort key per node); numbering the graph's
    nodes for each bucket member instead took 4.6 s of llama3 70B's bucketing (profiled, one H200)."""
    for n in sorted(chain):
        if n > before:
            before.prepend(n)


def _issue(graph: fx.Graph, b: Bucket, anchor: fx.Node) -> fx.Node:
    members = b.members
    if b.kind == "all_gather":
        for m in members:
            _hoist(m.chain, anchor)
    if len(members) == 1:
        anchor.prepend(members[0].start)
        return members[0].start
    first = members[0]
    with graph.inserting_before(anchor):
        if b.kind in ("all_gather", "all_reduce"):
            flats = [emit(graph, aten.view.default, _contiguous(graph, m.start.args[0]), [-1]) for m in members]
            flat = emit(graph, aten.cat.default, flats)
            start = (emit(graph, ALL_GATHER, flat, first.group_size, first.group_name) if b.kind == "all_gather"
                     else emit(graph, ALL_REDUCE, flat, first.key[4], first.group_name))
        else:
            ranks = first.group_size
            rows = []
            for m in members:
                source = _contiguous(graph, m.start.args[0])
                rows.append(emit(graph, aten.view.default, source, [ranks, source.meta["val"].numel() // ranks]))
            stacked = emit(graph, aten.cat.default, rows, 1)
            flat = emit(graph, aten.view.default, stacked, [-1])
            start = emit(graph, REDUCE_SCATTER, flat, first.key[4], ranks, first.group_name)
    start.meta[BUCKET_META] = len(members)
    return start


def _wait(graph: fx.Graph, b: Bucket, start: fx.Node, anchor: fx.Node) -> list[fx.Node]:
    """Insert the bucket's wait (and copy-out) before `anchor`; returns the nodes inserted last,
    after which a reduction's output chains go."""
    members = b.members
    if len(members) == 1:
        anchor.prepend(members[0].wait)
        return [members[0].wait]
    ranks = members[0].group_size
    with graph.inserting_before(anchor):
        wait = emit(graph, WAIT, start)
        if b.kind == "all_gather":
            sizes = [m.start.args[0].meta["val"].numel() for m in members]
            grid = emit(graph, aten.view.default, wait, [ranks, sum(sizes)])
            parts = emit(graph, aten.split_with_sizes.default, grid, sizes, 1)
            outs = []
            for i, m in enumerate(members):
                part = emit(graph, operator.getitem, parts, i)
                dense = emit(graph, aten.clone.default, part, memory_format=torch.contiguous_format)
                outs.append(emit(graph, aten.view.default, dense, list(m.wait.meta["val"].shape)))
        else:
            sizes = [m.wait.meta["val"].numel() for m in members]
            parts = emit(graph, aten.split_with_sizes.default, wait, sizes)
            outs = [
                emit(graph, aten.view.default, emit(graph, operator.getitem, parts, i), list(m.wait.meta["val"].shape))
                for i, m in enumerate(members)
            ]
    for m, out in zip(members, outs):
        m.wait.replace_all_uses_with(out)
        graph.erase_node(m.wait)
        graph.erase_node(m.start)
    return outs


def rewrite(gm: fx.GraphModule, buckets: list[Bucket], lay: Layout) -> None:
    """Merge each bucket and move its issue and wait to the planned anchors. All issues are inserted
    before all waits, so at a shared anchor the next collective is in flight before the wait."""
    graph = gm.graph
    starts = [(b, _issue(graph, b, lay.anchor(b.issue))) for b in buckets]
    for b, start in starts:
        last = _wait(graph, b, start, lay.anchor(max(b.wait, b.issue)))
        if b.kind in REDUCTIONS:
            cursor = last[-1]
            for n in sorted({n for m in b.members for n in m.chain}):
                cursor.append(n)
                cursor = n
    graph.lint()
    gm.recompile()
