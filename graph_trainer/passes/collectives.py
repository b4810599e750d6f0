"""Discovery: the parameter collectives of a traced graph (FSDP all-gathers, gradient reduce-scatters,
and the gradient all-reduces of replicated parameters) with the positions the schedulers may move them
between."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from ..blocks import UPDATE_KEY
from ..graph_dump import is_collective
from .bucketing_compat import (ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, WAIT, ancestors, group_size, is_fsdp_all_gather,
                               is_gradient_reduction)

aten = torch.ops.aten


REDUCTIONS = ("reduce_scatter", "all_reduce")
"""Gradient reductions: issued once the bucket's last gradient exists, their results moved later."""
ORDER_BY = {"all_gather": "need", **dict.fromkeys(REDUCTIONS, "ready")}
"""Bucket neighbours: all-gathers by first use, reductions by when their gradient exists."""
KINDS = tuple(ORDER_BY)


@dataclass
class Collective:
    """One FSDP all-gather, gradient reduce-scatter or gradient all-reduce and its wait, at positions in graph order."""

    start: fx.Node
    wait: fx.Node
    kind: str
    key: tuple
    """What must match to share a bucket: kind, group, its size, dtype, reduce op, forward/backward."""
    nbytes: int
    """Unsharded bytes: the gathered output, or the reduction's input."""
    ready: int
    """First position it may be issued at."""
    need: int
    """Position of its first consumer."""
    chain: list[fx.Node]
    """All-gather: the nodes between its parameter input and it (moved earlier with it).
    Reduction: the one-input nodes between its result and the graph output (moved later)."""
    at: tuple[int, int] = (0, 0)
    """Positions of its issue and wait in the traced graph (the unscheduled baseline)."""
    placeholder: fx.Node | None = None
    output_index: int | None = None
    update_index: int | None = None
    """A gradient the in-graph optimizer reads: the index of the parameter whose update reads it."""

    @property
    def group_size(self) -> int:
        return self.key[2]

    @property
    def group_name(self) -> str:
        return self.key[1]


def _ancestors_to_placeholder(node: fx.Node) -> tuple[fx.Node | None, list[fx.Node]]:
    found = list(ancestors(node))
    placeholder = next((n for n in found if n.op == "placeholder"), None)
    return placeholder, [n for n in found if n.op != "placeholder"]


def _holds_collective(chain: list[fx.Node]) -> bool:
    """Whether another collective lies on the chain (with tensor parallelism a parameter may be
    gathered, or its gradient reduced, over two mesh dims in a row). Only the collective nearest
    the parameter (all-gather) or the output (reduce-scatter) is scheduled: moving one would move
    the other, which its own bucket moves too."""
    return any(is_collective(n) for n in chain)


def _descendants_to_output(node: fx.Node) -> tuple[list[fx.Node], fx.Node | None]:
    """The one-input chain below `node` and the value of it the graph returns."""
    chain: list[fx.Node] = []
    returned = None
    stack = [node]
    while stack:
        n = stack.pop()
        for user in n.users:
            if user.op == "output":
                returned = n
            elif user not in chain:
                chain.append(user)
                stack.append(user)
    return chain, returned


def forward_end(gm: fx.GraphModule) -> int:
    """Position of the loss in a train-step graph (forward before it, backward after); the end of
    the graph when the first output is not a loss computed in the graph."""
    order = list(gm.graph.nodes)
    outputs = order[-1].args[0]
    first = outputs[0] if isinstance(outputs, (list, tuple)) and outputs else None
    while isinstance(first, fx.Node) and first.target in (aten.detach.default, aten.alias.default):
        first = first.args[0]
    if not isinstance(first, fx.Node) or first.op == "placeholder":
        return len(order)
    return order.index(first)


def forward_derived(wait: fx.Node, pos: dict[fx.Node, int], boundary: int) -> dict[fx.Node, fx.Node]:
    """Forward nodes computed from a gathered value alone (views, casts), each mapped to its one input."""
    parent: dict[fx.Node, fx.Node] = {}
    frontier = [wait]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.op == "call_function" and pos[user] <= boundary and user.all_input_nodes == [node]:
                parent[user] = node
                frontier.append(user)
    return parent


def find_collectives(gm: fx.GraphModule) -> list[Collective]:
    order = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    boundary = forward_end(gm)
    outputs = order[-1].args[0]
    out_index = {n: i for i, n in enumerate(outputs) if isinstance(n, fx.Node)} if isinstance(outputs, (list, tuple)) else {}
    found = []
    for node in order:
        if node.op != "call_function" or node.target not in (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE):
            continue
        waits = [u for u in node.users if u.target is WAIT]
        if len(waits) != 1 or len(node.users) != 1:
            continue
        wait, val = waits[0], node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        if node.target is ALL_GATHER and is_fsdp_all_gather(node):
            _, ranks, group_name = node.args
            placeholder, chain = _ancestors_to_placeholder(node)
            if _holds_collective(chain):
                continue
            need = min((pos[u] for u in wait.users), default=len(order) - 1)
            key = ("all_gather", group_name, ranks, val.dtype, None, need <= boundary)
            found.append(Collective(node, wait, "all_gather", key, val.numel() * val.element_size(),
                                    pos[placeholder] + 1, need, chain, (pos[node], pos[wait]), placeholder=placeholder))
        elif node.target in (REDUCE_SCATTER, ALL_REDUCE):
            kind = "reduce_scatter" if node.target is REDUCE_SCATTER else "all_reduce"
            read = read_by_update(wait, pos)
            if read is None and not is_gradient_reduction(node):
                continue
            if kind == "reduce_scatter":
                source, reduce_op, ranks, group_name = node.args
            else:
                source, reduce_op, group_name = node.args
                ranks = group_size(group_name)
                if ranks is None:
                    continue
            src_val = source.meta["val"]
            key = (kind, group_name, ranks, val.dtype, reduce_op, False)
            common = (node, wait, kind, key, src_val.numel() * src_val.element_size(), pos[source] + 1)
            if read is not None:
                # Read by the in-graph optimizer (the norm over every gradient, then the update): the wait
                # may move down to its first reader; the views between move with it.
                chain, need, update = read
                if _holds_collective(chain):
                    continue
                found.append(Collective(*common, need, chain, (pos[node], pos[wait]), update_index=update))
                continue
            chain, returned = _descendants_to_output(wait)
            if _holds_collective(chain):
                continue
            found.append(Collective(*common, len(order) - 1, chain, (pos[node], pos[wait]), output_index=out_index.get(returned)))
    return found


def read_by_update(wait: fx.Node, pos: dict[fx.Node, int]) -> tuple[list[fx.Node], int, int] | None:
    """For a gradient that a traced parameter update (`blocks.UPDATE_KEY`) reads: the one-input chain below
    its wait (views), the position of the first op that reads it otherwise, and the parameter's index.

    A reduction whose value, or a one-input op on it, has its parameter's shape: the gradient norm's all-reduce also
    reaches updates through one-input ops (its root, the clip coefficient), as a [parameters] or scalar value. Replicated
    parameters' gradient all-reduces are taken so, as reduce-scatters are (an auto-placed 8B-16L step with the in-graph
    optimizer waited for each of its 33 norm weights' all-reduces at once: 37.4 ms exposed by the cost model's estimate,
    bench/results/2026-11-30-session29, call 7)."""
    chain: list[fx.Node] = []
    readers: list[fx.Node] = []
    stack = [wait]
    while stack:
        n = stack.pop()
        for user in n.users:
            if user.op == "call_function" and user.all_input_nodes == [n]:
                chain.append(user)
                stack.append(user)
            else:
                readers.append(user)
    marks = [(r.meta.get("custom") or {}).get(UPDATE_KEY) for r in readers]
    index = next((m for m in marks if m is not None), None)
    if index is None:
        return None
    param = wait.graph.find_nodes(op="placeholder")[index].meta.get("val")
    if param is None or not any(getattr(n.meta.get("val"), "shape", None) == param.shape for n in (wait, *chain)):
        return None
    return chain, min(pos[r] for r in readers), index
