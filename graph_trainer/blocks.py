"""The transformer blocks of a traced train step: one notion of "block" for every pass that works per
block (the block-reuse compile, and the collective schedule and pipeline stages as they come to use it).

Each block's forward is marked while the step is traced, as regions.py marks its regions: every op
traced inside `model.layers[i]` carries `node.meta["custom"]["block"] = i` (the `i` of the parameter
FQNs `layers.<i>.…`), and `regions.copy_marks_to_backward` gives the backward ops the marks of the
forward ops they differentiate (the recomputation of an activation-checkpointed block runs inside
the block's forward again, so it is marked too).

In graph order a train step runs a prologue (embedding), each block's forward, the loss, each
block's backward and an epilogue. `block_starts` finds where each block phase begins: its first
compute op. Collectives, their waits and the casts and copies that only feed a collective do not
count, since the scheduling passes move them ahead of the block that needs them (a prefetch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import fx, nn

from .graph_dump import is_collective
from .regions import ancestors, annotate_module

BLOCK_KEY = "block"
CHECKPOINTED_KEY = "checkpointed"
"""Set beside the block's index on the blocks torchtitan's activation-checkpoint wrappers wrap whole
(`parallel.apply_activation_checkpointing`): what `passes/checkpoint_tags.py` tags for recomputation."""
UPDATE_KEY = "update"
"""With the optimizer traced in (capture/optimizer_in_graph.py) each parameter's update is marked with
the parameter's index: the updates of parameters of one shape are the same ops, so the block-reuse
compile cuts there too and compiles them once per shape, not once per parameter."""

Phase = Literal["forward", "backward"]


def annotate_blocks(model: nn.Module) -> nn.Module:
    """Mark every transformer block's forward with its index (on the instance, like the regions)."""
    for name, block in model.layers.items():
        annotate_module(block, {BLOCK_KEY: int(name)})
    return model


def node_block(node: fx.Node) -> int | None:
    """The transformer block whose forward (or backward) traced `node`; None outside the blocks."""
    return (node.meta.get("custom") or {}).get(BLOCK_KEY)


def block_count(gm: fx.GraphModule) -> int:
    """How many transformer blocks traced ops of `gm`."""
    return len({node_block(n) for n in gm.graph.nodes} - {None})


def computed_from_inputs(gm: fx.GraphModule) -> set[fx.Node]:
    """The graph's inputs and the ops computed from them alone, without a collective between (a parameter
    shard's cast, a bucket's concatenation of shards)."""
    from_inputs: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" or node.op == "call_function" and not is_collective(node) and all(
                a in from_inputs for a in node.all_input_nodes):
            from_inputs.add(node)
    return from_inputs


def communication_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Collectives, their waits, and the nodes computed from graph inputs alone whose every use is one
    of these (a parameter shard's cast, a bucket's concatenation): what a scheduling pass moves ahead
    of the block that needs it, so it tells nothing of where a block is. (A gradient also feeds only
    a collective, but it is computed from activations.)"""
    from_inputs = computed_from_inputs(gm)
    comm: set[fx.Node] = set()
    for node in reversed(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if is_collective(node) or node in from_inputs and node.users and all(u in comm for u in node.users):
            comm.add(node)
    return comm


_ALIASES = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}


def loss_node(gm: fx.GraphModule) -> fx.Node:
    """The loss of a train-step graph `(…) -> (loss, …)`: its first output, before the detach that the
    step returns it through (traced after the backward)."""
    node = gm.graph.output_node().args[0][0]
    while node.op == "call_function" and node.target in _ALIASES:
        node = node.args[0]
    return node


@dataclass(frozen=True)
class BlockStart:
    phase: Phase
    block: int
    node: fx.Node
    """The phase's first compute op."""


def block_starts(gm: fx.GraphModule, phase: Phase | None = None) -> list[BlockStart]:
    """Where each block's forward and each block's backward begins, in graph order: the first marked
    op of the block, other than communication, before the loss (forward) and after it (backward).
    A graph of one phase (aot's forward or backward graph, a pipeline stage's) gives that `phase`: its
    first output is no loss, and its ops are all of the phase. Empty when the graph has no marked blocks."""
    comm = communication_nodes(gm)
    loss = loss_node(gm) if phase is None else None
    forward = ancestors(loss) if loss is not None else set()
    starts: dict[tuple[Phase, int], fx.Node] = {}
    current: Phase = phase or "forward"
    for node in gm.graph.nodes:
        block = node_block(node)
        if block is not None and node.op == "call_function" and node not in comm:
            if phase is not None or current == "forward" and node in forward or current == "backward":
                starts.setdefault((current, block), node)
        if node is loss:
            current = "backward"
    return [BlockStart(which, block, node) for (which, block), node in starts.items()]


def update_starts(gm: fx.GraphModule) -> list[fx.Node]:
    """The first op of each parameter's update traced into the step, in graph order."""
    starts: dict[int, fx.Node] = {}
    for node in gm.graph.nodes:
        index = (node.meta.get("custom") or {}).get(UPDATE_KEY)
        if index is not None:
            starts.setdefault(index, node)
    return list(starts.values())
