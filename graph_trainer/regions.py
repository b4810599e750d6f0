"""Regions of the model that `regional_inductor` compiles: each block's attention (FlexAttention
needs Inductor to be fast) or feed-forward, marked while the train step is traced.

The mark is `torch.fx.traceback.annotate({"compile_with_inductor": ...})` around the module's
forward: every op traced inside it carries `node.meta["custom"]["compile_with_inductor"]` (the
tracer must run under `preserve_node_meta`). Outside a trace the wrapper only enters a context
manager, so eager and the other backends are unaffected.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch import fx, nn
from torch.fx import traceback as fx_traceback
from torch.fx.traceback import annotate
from torch.overrides import TorchFunctionMode

REGION_KEY = "compile_with_inductor"
REGION_MODULES = ("attention", "feed_forward")


def region_tag(module_name: str) -> dict[str, Any]:
    return {REGION_KEY: {"region": module_name}}


def _annotated(forward: Callable[..., Any], tag: dict[str, Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with annotate(tag):
            return forward(*args, **kwargs)

    return wrapper


def annotate_module(module: nn.Module, tag: dict[str, Any]) -> None:
    """Every op `module`'s forward traces carries `tag` in `node.meta["custom"]` (set on the instance)."""
    module.forward = _annotated(module.forward, tag)


def annotate_regions(model: nn.Module, modules: tuple[str, ...] = ("attention",)) -> nn.Module:
    """Mark the named submodule (`attention`, `feed_forward`) of every transformer block that has one
    (DeepSeek V3's MoE blocks have no `feed_forward`).

    The wrapper is set on each instance, not on the class, so two models in one process (a
    reference and a placed copy) do not share marks.
    """
    unknown = set(modules) - set(REGION_MODULES)
    assert not unknown, f"unknown region modules {sorted(unknown)}; choose from {REGION_MODULES}"
    marked = 0
    for block in model.layers.values():
        for name in modules:
            sub = getattr(block, name, None)
            if sub is not None:
                annotate_module(sub, region_tag(name))
                marked += 1
    assert marked, f"no transformer block of {type(model).__name__} has a submodule named {' or '.join(modules)}"
    return model


def _autograd_nodes(outputs: Any) -> Iterator[Any]:
    tensors = outputs if isinstance(outputs, (list, tuple)) else (outputs,)
    todo = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen = set(todo)
    while todo:
        node = todo.pop()
        yield node
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)


def _enter_backward_of(seq_nr: int) -> Callable[[Any], None]:
    return lambda grad_outputs: fx_traceback.set_grad_fn_seq_nr(seq_nr)


def _leave_backward(grad_inputs: Any, grad_outputs: Any) -> None:
    fx_traceback.reset_grad_fn_seq_nr()


OUTSIDE_GRAD_FN = -2
"""The `seq_nr` of a backward op that no autograd node records (the engine's sums of the gradients that reach one
value, the initial `ones_like`): no forward op has it (theirs are the thread's node count less one, at least -1).
Without it make_fx gives such an op the running thread's node count, and on CUDA autograd runs the backward on
its device thread, whose count starts again at 0: the sums took the marks of block 0's attention (llama3 70B,
full AC, one H200; bench/results/2026-11-29-session16)."""


class BackwardSeqNr(TorchFunctionMode):
    """While a train step is traced (under `preserve_node_meta`): each op that `torch.autograd.grad`
    records gets the `seq_nr` of the forward op it differentiates, as AOTAutograd arranges for its
    joint graph, and one that no node records gets `OUTSIDE_GRAD_FN`. Without it make_fx numbers
    backward ops apart from forward ones."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.autograd.grad:
            return func(*args, **kwargs)
        for node in _autograd_nodes(kwargs["outputs"] if "outputs" in kwargs else args[0]):
            node.register_prehook(_enter_backward_of(node._sequence_nr()))
            node.register_hook(_leave_backward)
        fx_traceback.set_grad_fn_seq_nr(OUTSIDE_GRAD_FN)
        try:
            return func(*args, **kwargs)
        finally:
            fx_traceback.reset_grad_fn_seq_nr()


def ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def copy_marks_to_backward(gm: fx.GraphModule) -> None:
    """Give each backward op of a train-step graph `(…) -> (loss, *grads)` the `custom` marks of the
    forward op it differentiates, so a marked region is compiled in backward too.

    make_fx records the marks only where the annotated forward ran; autograd's backward ops carry the
    `seq_nr` of their forward op instead (AOTAutograd copies marks the same way for its joint graph).
    Forward ops are the loss's ancestors; among forward ops sharing a `seq_nr` (ops that create no
    autograd node reuse the previous one's) the first is the one differentiated.
    """
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    forward = ancestors(output.args[0][0])
    first: dict[int, fx.Node] = {}
    for node in gm.graph.nodes:
        if node in forward and "seq_nr" in node.meta:
            first.setdefault(node.meta["seq_nr"], node)
    for node in gm.graph.nodes:
        if node in forward or node.op in ("placeholder", "output"):
            continue
        source = first.get(node.meta.get("seq_nr"))
        custom = source.meta.get("custom") if source is not None else None
        if custom:
            _add_marks(node, custom)
        elif isinstance(node.target, torch._ops.HigherOrderOperator):
            _mark_hop_backward(node, forward)
        elif node.target is operator.getitem and _marks(node.args[0]):
            _add_marks(node, _marks(node.args[0]))


def _marks(node: fx.Node) -> dict[str, Any]:
    custom = node.meta.get("custom") or {}
    return {REGION_KEY: custom[REGION_KEY]} if REGION_KEY in custom else {}


def _add_marks(node: fx.Node, custom: dict[str, Any]) -> None:
    node.meta["custom"] = {**(node.meta.get("custom") or {}), **custom}


def _mark_hop_backward(node: fx.Node, forward: set[fx.Node]) -> None:
    """A higher-order op's backward (FlexAttention's) carries the `seq_nr` of its autograd Function,
    not of the forward op, so the lookup by `seq_nr` misses it and it would run unfused, outside the
    region, materialising the scores. It takes the region of the forward ops it reads (q, k, v, the
    forward's output and logsumexp), and so do the subgraphs (get_attr) it calls."""
    marks = [_marks(n) for n in node.all_input_nodes if n in forward and _marks(n)]
    if not marks or any(m != marks[0] for m in marks):
        return
    _add_marks(node, marks[0])
    for arg in node.all_input_nodes:
        if arg.op == "get_attr" and not _marks(arg):
            _add_marks(arg, marks[0])
