"""The in-graph optimizer's update appended to a step traced from a few blocks (capture/block_template.py).

The template repeats the ops of a traced layer for the layers like it; the update (clipping and AdamW,
capture/optimizer_in_graph.py) reads every layer's gradient at once (the norm) and then updates the parameters
smallest first, across layers, so it has no per-layer part to repeat. It is traced on its own, on the expanded
step's gradients, and its ops are appended after the step's backward, named as make_fx names them: the graph is the
one a trace of the whole step gives (tests/test_block_template.py compares them).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from ..passes.compat import lazy_graph_modules
from .block_template import make_fx_name

logger = logging.getLogger("graph_trainer")

Update = Callable[..., tuple[torch.Tensor, Sequence[torch.Tensor]]]
"""`update(params, loss, grads, *state) -> (loss, outputs)`, as `ClipAndAdamWStep.update`."""


def append_update(gm: fx.GraphModule, update: Update, args: Sequence[torch.Tensor], params: int,
                  mode: FakeTensorMode) -> fx.GraphModule | None:
    """`gm`, a step `(*params, *buffers, inputs, labels) -> (loss, *grads)` traced in `mode`, followed by `update`:
    the step of `args` (the fake values of its inputs, the update's state after the batch) -> (loss, *outputs).
    None where the update's trace holds other than calls (logged): then the caller traces the whole step."""
    graph = gm.graph
    out = graph.output_node()
    loss, *grads = out.args[0]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]

    def flat_update(*a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        reported, outputs = update(a[:params], a[params], a[params + 1 : 2 * params + 1], *a[2 * params + 1 :])
        return (reported, *outputs)

    state = args[len(placeholders):]
    with mode, fx_traceback.preserve_node_meta(), lazy_graph_modules(True):
        tail = make_fx(flat_update, tracing_mode="real")(*args[:params], loss.meta["val"], *(g.meta["val"] for g in grads), *state)
    if any(n.op not in ("placeholder", "call_function", "output") for n in tail.graph.nodes):
        logger.info("block template: tracing every layer (the in-graph update reads module attributes)")
        return None
    tail_inputs = [n for n in tail.graph.nodes if n.op == "placeholder"]
    env = dict(zip(tail_inputs, [*placeholders[:params], loss, *grads]))
    with graph.inserting_before(placeholders[-1].next):
        for k, node in enumerate(tail_inputs[2 * params + 1 :], start=len(placeholders)):
            env[node] = graph.placeholder(f"arg{k}_1")
            env[node].meta = dict(node.meta)
    with graph.inserting_before(out):
        for node in tail.graph.nodes:
            if node.op == "call_function":
                args_, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                env[node] = graph.create_node(node.op, node.target, args_, kwargs, make_fx_name(graph, node.target))
                env[node].meta = dict(node.meta)
    tail_out = tail.graph.output_node()
    out.args = (fx.node.map_arg(tail_out.args[0], env.__getitem__),)
    out.meta = dict(tail_out.meta)
    gm.recompile()
    return gm
