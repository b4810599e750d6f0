"""A traced stage's backward graph split into its input-gradient and weight-gradient parts, for the
zero-bubble pipeline schedules (`InterleavedZeroBubble`), which run a microbatch's input gradient (I)
as soon as the next stage's gradient arrives, so that the previous stage can go on, and its weight
gradients (W) later, in what would have been the bubble.

The input part holds every node the input gradient needs; it returns the input gradient and the values
of its nodes that the weight part reads. The weight part holds the rest and returns the parameters'
gradients, which are accumulated into `param.grad` through autograd (post-accumulate hooks fire as for
the unsplit graph). The ops are the unsplit graph's, in its order within each part, so the gradients are
the same bit for bit. The saved activations that only the weight part reads stay alive until W runs:
the memory that zero-bubble schedules trade for the bubble.

Only stages whose graph parameters are plain tensors split: AOTAutograd rebuilds a DTensor parameter's
gradient from several graph outputs and cannot be handed none for it (validate.py refuses those up front).
"""

from __future__ import annotations

import collections
import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import fx


@dataclass
class BackwardSplit:
    input_part: fx.GraphModule
    """Takes the backward graph's inputs; returns (input gradients..., values the weight part reads...)."""
    weight_part: fx.GraphModule
    """Takes (the backward inputs it reads..., the input part's values...); returns the weight gradients."""
    input_positions: list[int]
    """Positions in the backward graph's outputs of the input gradients (the others are weight gradients or None)."""
    weight_positions: list[int]
    """Positions of the weight part's outputs in the backward graph's outputs."""
    weight_reads: list[int]
    """Indices of the backward graph's inputs the weight part reads."""
    crossing: list[fx.Node]
    """The input part's values the weight part reads (nodes of the original graph)."""


def _copy(graph: fx.Graph, nodes: Sequence[fx.Node], env: dict[fx.Node, fx.Node]) -> None:
    for node in nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])


def split_backward(gm: fx.GraphModule, input_positions: Sequence[int]) -> BackwardSplit:
    """Split `gm` (a partitioned backward graph) at the outputs in `input_positions` (the stage input's gradients)."""
    graph = gm.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    outputs = list(graph.output_node().args[0])
    need: set[fx.Node] = set()
    stack = [outputs[i] for i in input_positions if isinstance(outputs[i], fx.Node)]
    while stack:
        node = stack.pop()
        if node in need or node.op == "placeholder":
            continue
        need.add(node)
        stack.extend(node.all_input_nodes)
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    # An op of several outputs (the fused RMSNorm's backward on GPUs: the input's and the weight's gradient) that the
    # input part runs hands the weight part its outputs, not itself: a part's output is then a tensor, never a tuple,
    # which torch 2.11's compile refuses ("output spec mismatch").
    need |= {n for n in body if n.target is operator.getitem and n.args[0] in need}
    first = [n for n in body if n in need]
    rest = [n for n in body if n not in need]
    read_by_rest = {a for n in rest for a in n.all_input_nodes}
    weight_positions = [i for i, o in enumerate(outputs) if i not in input_positions and isinstance(o, fx.Node)]
    read_by_rest |= {outputs[i] for i in weight_positions}
    crossing = [n for n in first if n in read_by_rest]
    weight_reads = [i for i, p in enumerate(placeholders) if p in read_by_rest]

    input_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {p: input_graph.placeholder(p.name) for p in placeholders}
    for p in placeholders:
        env[p].meta = dict(p.meta)
    _copy(input_graph, first, env)
    input_graph.output(tuple([env[outputs[i]] if isinstance(outputs[i], fx.Node) else outputs[i] for i in input_positions]
                             + [env[n] for n in crossing]))

    weight_graph = fx.Graph()
    wenv: dict[fx.Node, fx.Node] = {}
    for i in weight_reads:
        wenv[placeholders[i]] = weight_graph.placeholder(placeholders[i].name)
        wenv[placeholders[i]].meta = dict(placeholders[i].meta)
    for n in crossing:
        wenv[n] = weight_graph.placeholder(f"{n.name}_from_input_part")
        wenv[n].meta = dict(n.meta)
    _copy(weight_graph, rest, wenv)
    weight_graph.output(tuple(wenv[outputs[i]] for i in weight_positions))
    return BackwardSplit(fx.GraphModule(gm, input_graph), fx.GraphModule(gm, weight_graph), list(input_positions), weight_positions,
                         weight_reads, crossing)


class SplitBackwardCompiler:
    """An AOTAutograd backward compiler that compiles the two parts with `inner` (the job's backward compiler)
    and returns the input part as the backward: the weight gradients come back None and the weight part's
    call waits in `pending`, which the stage's `dw_builder` hands the schedule (in the order the backwards ran)."""

    def __init__(self, inner: Callable[[fx.GraphModule, Sequence[Any]], Callable[[list[Any]], Any]], weights: Callable[[], list[torch.Tensor]],
                 pending: collections.deque[Callable[[], None]]):
        """`weights`: the tensors the backward's outputs are gradients of, in output order (the stage graph's
        parameters and buffers; the last output is its input's gradient)."""
        self.inner = inner
        self.weights = weights
        self.pending = pending

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[[list[Any]], Any]:
        n_out = len(gm.graph.output_node().args[0])
        if n_out != len(self.weights()) + 1:
            raise AssertionError(f"a stage backward graph with {n_out} outputs for {len(self.weights())} parameters and buffers and one "
                                 "input: its parameters are not plain tensors, which validation should have refused")
        split = split_backward(gm, [n_out - 1])
        input_part = self.inner(split.input_part, example_inputs)
        weight_part = self.inner(split.weight_part, [*(example_inputs[i] for i in split.weight_reads),
                                                     *(n.meta["val"] for n in split.crossing)])
        pending = self.pending
        weights = self.weights

        def run(args: list[Any]) -> list[Any]:
            kept = [args[i] for i in split.weight_reads]
            outs = list(input_part(args))
            n_in = len(split.input_positions)
            crossing = outs[n_in:]

            def weight() -> None:
                grads = weight_part([*kept, *crossing])
                targets = weights()
                pairs = [(targets[i], g) for i, g in zip(split.weight_positions, grads) if g is not None]
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

            pending.append(weight)
            result: list[Any] = [None] * n_out
            for i, g in zip(split.input_positions, outs[:n_in]):
                result[i] = g
            return result

        run._boxed_call = True  # type: ignore[attr-defined]
        return run
