"""The in-graph optimizer's update appended to a step traced from a few blocks (capture/block_template.py).

The template repeats the ops of a traced layer for the layers like it; the update (clipping and AdamW,
capture/optimizer_in_graph.py) reads every layer's gradient at once (the norm) and then updates the parameters
smallest first, across layers, so it has no per-layer part to repeat. It is traced apart, on the expanded step's
gradients, in the parts it runs in: the head (the norm, the clip coefficient, the step's scalars) once, and one
parameter's update once for each kind of parameter (shapes, strides and dtypes of it, its gradient and its
moments), whose ops each parameter of that kind gets a copy of, with its own inputs, fresh values and its own
update mark. (Traced as one, llama3 8B's update at dp_shard 8 took 5.7 s under cProfile on the CI machine, 2.6 s of
it in its 291 parameters' updates; on one H200 the step with it traced in 6.6 s, by parts in 4.0-4.1 s.) The ops
are appended after the step's backward in the order and with the names make_fx gives them: the graph is the one a
trace of the whole step gives (tests/test_block_template.py compares them).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from ..blocks import UPDATE_KEY
from ..passes.compat import lazy_graph_modules
from .block_template import fake_on, make_fx_name, storage_of, tensors_of

logger = logging.getLogger("graph_trainer")


class StepUpdate(Protocol):
    """A step's update in the parts it runs in (`ClipAndAdamWStep`): `head` returns (the gradients in their
    parameters' dtypes, the total norm, the clip coefficient, the step's scalars: `decay`, `bias_correction2_sqrt`
    and `step_size` by dtype); then `update_one` per parameter, in `order`."""

    def head(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], lr: torch.Tensor,
             step: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, Any]: ...

    def order(self, params: Sequence[torch.Tensor]) -> list[int]: ...

    def update_one(self, i: int, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   coef: torch.Tensor, decay: torch.Tensor, bias_correction2_sqrt: torch.Tensor, step_size: torch.Tensor) -> None: ...


class _Refused(Exception):
    """A part's trace holds other than calls."""


def _trace(fn: Callable[..., Any], inputs: Sequence[torch.Tensor], mode: FakeTensorMode) -> fx.GraphModule:
    with mode, fx_traceback.preserve_node_meta(), lazy_graph_modules(True), torch.no_grad():
        gm = make_fx(fn, tracing_mode="real")(*inputs)
    if any(n.op not in ("placeholder", "call_function", "output") for n in gm.graph.nodes):
        raise _Refused
    return gm


class _Appender:
    """Copies a part's ops before the step's output, each reading the step's nodes its inputs stand for."""

    def __init__(self, graph: fx.Graph, mode: FakeTensorMode):
        self.graph, self.out, self.mode = graph, graph.output_node(), mode

    def append(self, part: fx.GraphModule, inputs: Sequence[fx.Node], mark: int | None = None) -> list[fx.Node]:
        """The part's outputs as nodes of the step (an output that is an input: that input's node)."""
        env = dict(zip((n for n in part.graph.nodes if n.op == "placeholder"), inputs, strict=True))
        # a value on an input's storage is on the storage of the input the copy reads; the others get storage of
        # their own, which the values viewing them share
        storages = {storage_of(t): v for p, node in env.items()
                    for t, v in zip(tensors_of(p.meta["val"]), tensors_of(node.meta["val"]), strict=True)}
        with self.graph.inserting_before(self.out):
            for node in part.graph.nodes:
                if node.op != "call_function":
                    continue
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                new = self.graph.create_node(node.op, node.target, args, kwargs, make_fx_name(self.graph, node.target))
                new.meta = dict(node.meta)
                if mark is not None:
                    new.meta["custom"] = {**(node.meta.get("custom") or {}), UPDATE_KEY: mark}
                new.meta["val"] = pytree.tree_map_only(torch.Tensor, lambda t: self._value(t, storages), node.meta.get("val"))
                env[node] = new
        return list(fx.node.map_arg(part.graph.output_node().args[0], env.__getitem__))

    def _value(self, t: torch.Tensor, storages: dict[int, torch.Tensor]) -> torch.Tensor:
        like = storages.get(storage_of(t))
        if like is None:
            storages[storage_of(t)] = new = fake_on(self.mode, t)
            return new
        if (t.shape, t.stride(), t.storage_offset()) == (like.shape, like.stride(), like.storage_offset()):
            return like
        return fake_on(self.mode, t, like.untyped_storage())


def append_update(gm: fx.GraphModule, step: StepUpdate, args: Sequence[torch.Tensor], params: int,
                  mode: FakeTensorMode) -> fx.GraphModule | None:
    """`gm`, a step `(*params, *buffers, inputs, labels) -> (loss, *grads)` traced in `mode`, followed by `step`'s
    update: the step of `args` (the fake values of its inputs; after the batch the update's state: the moments, the
    learning rate, the step count) -> (loss, grad_norm). None where a part's trace holds other than calls (logged):
    then the caller traces the whole step."""
    graph = gm.graph
    loss, *grads = graph.output_node().args[0]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    state = []
    with graph.inserting_before(placeholders[-1].next):
        for k, value in enumerate(args[len(placeholders):], start=len(placeholders)):
            state.append(graph.placeholder(f"arg{k}_1"))
            state[-1].meta["val"] = value
    weights = placeholders[:params]
    exp_avgs, exp_avg_sqs, (lr, count) = state[:params], state[params : 2 * params], state[2 * params :]
    vals = [w.meta["val"] for w in weights]
    dtypes: list[torch.dtype] = []

    def head(*a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cast, grad_norm, coef, s = step.head(a[:params], a[params : 2 * params], a[-2], a[-1])
        dtypes.extend(s.step_size)
        return (*cast, grad_norm, coef, s.decay, s.bias_correction2_sqrt, *s.step_size.values())

    def update_one(*a: torch.Tensor) -> tuple[()]:
        step.update_one(0, *a)
        return ()

    appender = _Appender(graph, mode)
    parts: dict[tuple, fx.GraphModule] = {}
    try:
        inputs = [*weights, *grads, lr, count]
        done = appender.append(_trace(head, [n.meta["val"] for n in inputs], mode), inputs)
        cast, (grad_norm, coef, decay, root), step_size = done[:params], done[params : params + 4], dict(zip(dtypes, done[params + 4 :]))
        for i in step.order(vals):
            inputs = [weights[i], cast[i], exp_avgs[i], exp_avg_sqs[i], coef, decay, root, step_size[vals[i].dtype]]
            values = [n.meta["val"] for n in inputs]
            kind = tuple((tuple(t.shape), t.stride(), t.dtype) for t in values)
            if kind not in parts:
                parts[kind] = _trace(update_one, values, mode)
            appender.append(parts[kind], inputs, mark=i)
    except _Refused:
        logger.info("block template: tracing every layer (a part of the in-graph update reads module attributes)")
        return None
    graph.output_node().args = ((loss, grad_norm),)
    gm.recompile()
    return gm
