"""The activations of a train-step graph as the memory policy (memory_policy.py) sees them: the
forward values backward reads that are computed from the batch, which of them can be recomputed or
offloaded, the storages they share, and the parameter gathers a recomputation must repeat."""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
from torch import fx

from ..blocks import node_block
from ..graph_dump import is_collective, nbytes
from .collectives import Collective, find_collectives, forward_derived, forward_end
from .liveness import Step, alias_of


def _mutates(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


def _argument(node: fx.Node, name: str) -> Any:
    """The value of an op's argument by schema name (its default when not passed); None if it has none."""
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == name:
            if name in node.kwargs:
                return node.kwargs[name]
            return node.args[i] if i < len(node.args) else arg.default_value
    return None


class Activations:
    """What the train-step graph keeps across the loss, and what could be recomputed instead.

    `batch` are the placeholders of the batch (inputs, labels): values that depend on none of them
    are parameter-derived and neither counted nor recomputed."""

    def __init__(self, gm: fx.GraphModule, batch: set[fx.Node]):
        self.order = list(gm.graph.nodes)
        self.pos_of_loss = boundary = forward_end(gm)
        self.pos = {n: i for i, n in enumerate(self.order)}
        depends = set(batch)
        for node in self.order:
            if node.op == "call_function" and any(i in depends for i in node.all_input_nodes):
                depends.add(node)
        self.forward = {n for n in self.order[: boundary + 1] if n.op == "call_function" and n in depends}
        self.roots: dict[fx.Node, fx.Node] = {}
        for node in self.order:
            alias = alias_of(node)
            self.roots[node] = self.roots.get(alias, alias) if alias is not None else node
        self.by_root: dict[fx.Node, list[fx.Node]] = {}
        for node in self.forward:
            self.by_root.setdefault(self.roots[node], []).append(node)
        # Recomputed copies and reloads run before the backward reads of forward values: a storage
        # written only after the last of them (the in-graph optimizer's write-back) holds what it held.
        last_read = max((self.pos[u] for n in self.forward for u in n.users if self.is_backward(u)), default=boundary)
        mutated = {self.roots[n.args[0]] for n in self.order
                   if _mutates(n) and n.args and isinstance(n.args[0], fx.Node) and self.pos[n] <= last_read}
        self.recomputable = {n for n in self.forward if self._recomputable(n, mutated)}
        self.offloadable = {n for n in self.forward if self._offloadable(n, mutated)}
        self.gathered, self.twin = _regathered(gm, self.pos, boundary)
        self.inputs = {n: n.all_input_nodes for n in self.order}
        self.steps: list[Step] = [(n, n, {i: i for i in self.inputs[n]}) for n in self.order]
        """The graph as it stands, as a `liveness` schedule."""

    @classmethod
    def of_step(cls, gm: fx.GraphModule, ctx: Any) -> "Activations":
        """Those of a traced train step (a pass's `ctx`): its batch is the two graph inputs after the
        parameters and buffers."""
        first = ctx.num_params + ctx.num_buffers
        return cls(gm, set(gm.graph.find_nodes(op="placeholder")[first : first + 2]))

    @functools.cached_property
    def block_of(self) -> dict[fx.Node, int | None]:
        """The transformer block each forward activation was computed in (None outside blocks)."""
        return {n: node_block(n) for n in self.forward}

    def _recomputable(self, node: fx.Node, mutated: set[fx.Node]) -> bool:
        target = node.target
        if target is operator.getitem:
            return True
        if not isinstance(target, torch._ops.OpOverload) or is_collective(node) or _mutates(node):
            return False
        if torch.Tag.nondeterministic_seeded in target.tags and _argument(node, "dropout_p") != 0:
            return False
        # A storage written in place after `node` read it would give a recomputation other inputs;
        # views read it when used, so recomputing a view sees what the original view saw.
        return target.is_view or not any(self.roots[i] in mutated for i in node.all_input_nodes) and self.roots[node] not in mutated

    def _offloadable(self, node: fx.Node, mutated: set[fx.Node]) -> bool:
        """A storage of its own that backward reads whole: the copy to host and back is then the value,
        and the reload can take over every backward read."""
        val = node.meta.get("val")
        if self.roots[node] is not node or node in mutated or is_collective(node) or not isinstance(val, torch.Tensor):
            return False
        if not val.numel() or not _dense(val):
            return False
        return all(m is node or not any(self.is_backward(u) for u in m.users) for m in self.by_root[node])

    def new_gathers(self, chain: set[fx.Node]) -> set[fx.Node]:
        """The forward all-gathers whose copies recomputing `chain` adds to backward (those backward
        gathers again anyway are merged with their twins)."""
        starts = {self.gathered[i] for n in chain for i in self.inputs[n] if i in self.gathered}
        return {s for s in starts if s not in self.twin}

    def is_backward(self, node: fx.Node) -> bool:
        return node.op == "call_function" and self.pos[node] > self.pos_of_loss

    def root_bytes(self, root: fx.Node) -> int:
        return nbytes(root.meta.get("val")) if root in self.forward else 0


def _regathered(gm: fx.GraphModule, pos: dict[fx.Node, int], boundary: int) -> tuple[dict[fx.Node, fx.Node], dict[fx.Node, fx.Node]]:
    """The parameters backward does not read from forward's gather (`reshard_after_forward` gathers
    them again, or backward does not need them): each value of their forward gather (the ops from the
    parameter to it, its cast; start, wait and what forward derives from it alone) mapped to the
    gather's start; and for the start and wait of each, those of the first backward gather of the same
    parameter, made by the same ops, over the same group (its twin).

    A recomputation reading one of these values gathers again rather than keep the forward copy
    alive into backward; where a twin runs later, the rewrite merges the two (the same collective
    on the same shard gives the same value), so backward still gathers each parameter once."""
    gathers = [c for c in find_collectives(gm) if c.kind == "all_gather"]

    def same(c: Collective) -> tuple:
        # backward's gather reads a cast of its own (`reshard_after_forward`): the parameter and the ops from it
        # name the shard (an auto-placed parameter may be gathered twice, from different views of it)
        ops = tuple((n.target, repr(fx.node.map_arg((n.args, n.kwargs), lambda _: None)))
                    for n in sorted(c.chain, key=pos.__getitem__))
        return (c.placeholder, ops, *c.start.args[1:])

    later: dict[tuple, Collective] = {}
    for c in gathers:
        if pos[c.start] > boundary:
            later.setdefault(same(c), c)
    gathered: dict[fx.Node, fx.Node] = {}
    twin: dict[fx.Node, fx.Node] = {}
    for c in gathers:
        if pos[c.start] > boundary:
            continue
        values = [c.start, c.wait, *forward_derived(c.wait, pos, boundary)]
        if any(pos[u] > boundary for v in values[1:] for u in v.users):
            continue
        gathered.update((v, c.start) for v in (*c.chain, *values))
        if (b := later.get(same(c))) is not None:
            twin[c.start], twin[c.wait] = b.start, b.wait
    return gathered, twin


def _dense(t: torch.Tensor) -> bool:
    """No two elements share memory and none is skipped (a copy with the same strides is a plain copy)."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.size()) if sz > 1):
        if stride != expected:
            return False
        expected *= size
    return True
