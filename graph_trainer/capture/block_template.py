"""Trace a few transformer blocks and repeat their ops for the others: the step of an L-layer model without
running all L layers' Python through make_fx.

Tracing is a third of a cold start (llama3 8B, one H200: 8.2 s of 23.8 s to the first step, bytecode cached),
and it grows with the layers (about 0.35 s per 8B layer on the CI machine) although identical blocks trace
identical ops. So the step is traced with the model's first m layers only, and each other layer's ops are copies
of a traced layer's with its own parameters. The graph is the one a trace of all L layers gives: the same ops in
the same order with the same names, arguments and values (`tests/test_block_template.py` compares the two by
`compile_cache.graph_fingerprint` on every model family and parallelism it supports).

Which traced layer a layer repeats: layers whose module trees match (`layer_key`: module classes, parameter and
buffer shapes and placements, plain flags such as `moe_enabled`; activation checkpointing shows as its wrapper)
trace the same ops, and a layer's ops read only its neighbours' (the residual stream in forward, its gradient in
backward) besides its own parameters and what all layers share. So layer p (not the first or last) repeats a
traced interior layer q whose neighbours match p's (`key[q-1:q+2] == key[p-1:p+2]`); the first is traced as
itself; the last repeats traced layer m-1, whose previous layer matches the model's second last. m is the least
that covers every layer; a model where that is all its layers (or nearly) is traced whole.

The first layer's ops can differ from those of a later layer of the same key: under auto placement the embedding's
output reaches it in another layout (llama3 with every second block checkpointed: layer 2 repeats traced layer 2,
layer 3 traced layer 1, whose neighbour, traced layer 0, holds ops layer 2 does not). The template is then traced
again with the first layer's key its own (`plan_templates`' second plan), so that no interior layer repeats one whose neighbour is
the first: two more layers traced (6 of 16) instead of every one.

Every op of the template gets an owner: its block's mark (blocks.py), else the one layer its inputs come from (a
parameter's cast in the prologue; the residual gradient's sum in backward reads two neighbours and belongs to the
block whose backward it sits in), else none (shared: the embedding, the loss). Consecutive ops of one owner make a
run, and consecutive runs of consecutive traced layers a group: in layer order (the forward, the prologue's
parameter casts) or in reverse (the backward). Each model layer gets a copy of its traced layer's run in each group,
in the group's order; shared runs are copied once. A copy reads its neighbour's ops by position, so where a
neighbour repeats another traced layer than the template's neighbour the two runs must hold the same ops. Anything
else (an op reading layers that are not neighbours, runs that do not line up) means the model does not fit: `expand`
returns None and the step is traced whole.

Copies get fresh fake values of the template's shapes, strides and dtypes, aliasing what the template's values
alias (a view of a parameter shard, a saved activation), so that passes which reason about storage (liveness,
memory) see the layers apart as in a full trace. `seq_nr` stays the template's (marks were copied to the
backward before the expansion; no pass reads it after).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from typing import Any, Iterator, Sequence

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch._prims_common import compute_required_storage_length
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ..blocks import BLOCK_KEY, node_block
from ..passes.compat import LazyGraphModule
from ..regions import ancestors

logger = logging.getLogger("graph_trainer")

_PLAIN = (bool, int, str, type(None))
_IDENTITY = {"layer_id"}
"""Plain attributes that name a block rather than configure it (torchtitan's DeepSeek V3 block keeps its index)."""


def layer_key(block: nn.Module) -> str:
    """What decides the ops a block traces: its modules' classes and plain flags, its parameters' and buffers'
    shapes, strides, dtypes and placements. (Floats are left out: the blocks of torchtitan's models keep their
    init scale, which depends on the layer's depth, as one.)"""
    parts = []
    for name, module in block.named_modules():
        flags = sorted((k, v) for k, v in vars(module).items()
                       if not k.startswith("_") and k not in _IDENTITY and isinstance(v, _PLAIN))
        parts.append((name, type(module).__qualname__, flags))
    for name, t in [*block.named_parameters(), *block.named_buffers()]:
        placement = (tuple(t.placements), tuple(t.device_mesh.mesh_dim_names or ())) if hasattr(t, "placements") else None
        parts.append((name, tuple(t.shape), t.stride(), t.dtype, t.requires_grad, repr(placement)))
    return repr(parts)


@dataclasses.dataclass(frozen=True)
class TemplatePlan:
    names: tuple[str, ...]
    """The model's layers (keys of `model.layers`, in order)."""
    traced: int
    """m: its first m layers are traced."""
    source: tuple[int, ...]
    """Per layer, the position of the traced layer whose ops it repeats."""

    def fqn_prefix(self, position: int) -> str:
        return f"layers.{self.names[position]}."


def plan_templates(model: nn.Module) -> list[TemplatePlan]:
    """The templates to try, in order: which layers to trace and which each other layer repeats; then, where it
    differs, the same with the first layer matching no other. Empty where tracing them all is about as quick."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict) or len(layers) < 5:
        return []
    names = tuple(layers.keys())
    key = [layer_key(b) for b in layers.values()]
    plans: list[TemplatePlan] = []
    for keys in (key, [f"first {key[0]}", *key[1:]]):
        plan = _plan(names, keys)
        if plan is not None and plan not in plans:
            plans.append(plan)
    return plans


def _plan(names: tuple[str, ...], key: list[str]) -> TemplatePlan | None:
    """The least m that covers every layer of these keys (None where it would be all of them, or nearly)."""
    n = len(key)
    for m in range(3, n - 1):
        source = [0] * n
        for p in range(1, n - 1):
            q = next((q for q in range(1, m - 1) if key[q - 1 : q + 2] == key[p - 1 : p + 2]), None)
            if q is None:
                break
            source[p] = q
        else:
            if key[m - 2 : m] == key[n - 2 :]:
                source[n - 1] = m - 1
                return TemplatePlan(names, m, tuple(source))
    return None


@contextlib.contextmanager
def traced_layers(model: nn.Module, plan: TemplatePlan) -> Iterator[None]:
    """The model with only its first `plan.traced` layers, for the template's trace."""
    full = model.layers
    model.layers = nn.ModuleDict({name: full[name] for name in plan.names[: plan.traced]})
    try:
        yield
    finally:
        model.layers = full


def _layer_of(fqn: str | None, plan: TemplatePlan) -> tuple[int, str] | None:
    """(position, name within the block) of a parameter or buffer FQN that belongs to a layer."""
    if fqn is None or not fqn.startswith("layers."):
        return None
    name, _, rest = fqn[len("layers."):].partition(".")
    return plan.names.index(name), rest


class _Refused(Exception):
    """The template does not have the shape `expand` relies on."""


def storage_of(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def tensors_of(val: Any) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(val) if isinstance(v, torch.Tensor)]


class _Expansion:
    """The template's inputs, ops and output, each with its owner: a traced layer's position, or None (shared)."""

    def __init__(self, gm: fx.GraphModule, plan: TemplatePlan, template_inputs: Sequence[str | None]):
        self.gm, self.plan, self.names = gm, plan, list(template_inputs)
        self.positions = {name: p for p, name in enumerate(plan.names[: plan.traced])}
        nodes = list(gm.graph.nodes)
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.output = nodes[-1]
        self.ops = [n for n in nodes if n.op not in ("placeholder", "output")]
        self.forward = ancestors(self.output.args[0][0])
        self.owner: dict[fx.Node, int | None] = {}
        self.suffix: dict[fx.Node, str] = {}
        for node, fqn in zip(self.placeholders, template_inputs, strict=True):
            layer = _layer_of(fqn, plan)
            self.owner[node] = None if layer is None else layer[0]
            if layer is not None:
                self.suffix[node] = layer[1]
        previous = None
        for node in self.ops:
            self.owner[node] = previous = self._own(node, previous)
        # an op that reads nothing belongs to the one layer whose ops read it (the buffer a transposed gradient is
        # laid out in, one per layer; a FlexAttention call's score and mask functions), or where nothing reads it (a
        # checkpointed block's unused buffer, on CUDA) to the layer of the op before it
        previous = None
        for node in self.ops:
            users = {self.owner[u] for u in node.users if u.op != "output"}
            if node.op in ("call_function", "get_attr") and not node.all_input_nodes:
                if len(users) == 1 and None not in users:
                    self.owner[node] = users.pop()
                elif not node.users:
                    self.owner[node] = previous
            previous = self.owner[node]
        # the first node whose value holds each storage: a copy of a later view aliases that node's copy
        self.storage_owner: dict[int, tuple[fx.Node, int]] = {}
        for node in nodes:
            for i, t in enumerate(tensors_of(node.meta.get("val"))):
                self.storage_owner.setdefault(storage_of(t), (node, i))

    def _own(self, node: fx.Node, previous: int | None) -> int | None:
        inputs = {self.owner[a] for a in node.all_input_nodes} - {None}
        block = node_block(node)
        if block is not None:
            owner = self.positions.get(str(block))
            if owner is None or any(abs(i - owner) > 1 for i in inputs):
                raise _Refused(f"{node.name} (block {block}) reads a layer other than its neighbours")
            return owner
        if len(inputs) > 1:
            # the sum of a residual's gradients in backward: the block whose backward it is in owns it
            if max(inputs) - min(inputs) > 1 or len(inputs) > 2 or previous not in inputs:
                raise _Refused(f"{node.name} reads layers {sorted(inputs)}")
            return previous
        return next(iter(inputs), None)

    def groups(self) -> list[tuple[int, dict[int | None, list[fx.Node]]]]:
        """The ops in runs of one owner, grouped as [(0, {None: a shared run}) | (+1 or -1, {traced layer: its run})]:
        a group's runs are of consecutive traced layers, in layer order (+1: the forward, the parameters' casts) or
        in reverse (-1: the backward); each model layer that repeats one of them gets a copy of its run there."""
        runs: list[tuple[int | None, list[fx.Node]]] = []
        for node in self.ops:
            if runs and runs[-1][0] == self.owner[node]:
                runs[-1][1].append(node)
            else:
                runs.append((self.owner[node], [node]))
        edges = {0, self.plan.traced - 1}
        out: list[tuple[int, dict[int | None, list[fx.Node]]]] = []
        i = 0
        while i < len(runs):
            owner, run = runs[i]
            if owner is None:
                out.append((0, {None: run}))
                i += 1
                continue
            j = i + 1
            if j < len(runs) and runs[j][0] is not None and abs(runs[j][0] - owner) == 1:
                step = runs[j][0] - owner
                while j < len(runs) and runs[j][0] is not None and runs[j][0] - runs[j - 1][0] == step:
                    j += 1
            else:
                # one traced layer's run alone: its direction from its phase
                step = 1 if run[0] in self.forward else -1
            group = [list(r) for _, r in runs[i:j]]
            first, final = runs[i][0], runs[j - 1][0]
            if j - i > 1 and first in edges:
                # unmarked ops before the group's first block (the loss's backward before the last layer's) are that
                # layer's alone, not part of the run a repeated layer copies; so are those after its last block's
                lead, group[0], _ = _marked_core(group[0], trail=False)
                if lead:
                    out.append((step, {first: lead}))
            trail: list[fx.Node] = []
            if j - i > 1 and final in edges:
                _, group[-1], trail = _marked_core(group[-1], lead=False)
            out.append((step, {runs[k][0]: r for k, r in zip(range(i, j), group)}))
            if trail:
                out.append((step, {final: trail}))
            i = j
        return out


def _marked_core(run: list[fx.Node], lead: bool = True, trail: bool = True) -> tuple[list[fx.Node], list[fx.Node], list[fx.Node]]:
    """A run as (unmarked ops before its first block-marked op, the rest, unmarked ops after its last), splitting
    off only the ends asked for; a run of no marked op (the parameters' casts) is all core."""
    marked = [i for i, node in enumerate(run) if node_block(node) is not None]
    if not marked:
        return [], run, []
    start = marked[0] if lead else 0
    end = marked[-1] + 1 if trail else len(run)
    return run[:start], run[start:end], run[end:]


def expand(gm: fx.GraphModule, plan: TemplatePlan, template_inputs: Sequence[str | None],
           inputs: Sequence[tuple[str | None, torch.Tensor]], params: int, mode: FakeTensorMode) -> fx.GraphModule | None:
    """The step of the whole model from `gm`, the trace of its first `plan.traced` layers. `template_inputs`
    names the template's inputs (parameter and buffer FQNs, None for the batch and the rest), `inputs` the whole
    step's with their fake values (made in `mode`, the template's fake mode), of which the first `params` are the
    parameters whose gradients the step returns after its loss. None where the template does not fit (logged):
    then the caller traces the whole model."""
    try:
        return _expand(_Expansion(gm, plan, template_inputs), inputs, params, mode)
    except _Refused as e:
        logger.info(f"block template: tracing every layer ({e})")
        return None


def fake_on(mode: FakeTensorMode, like: torch.Tensor, storage: torch.UntypedStorage | None = None) -> FakeTensor:
    """A fake tensor of `like`'s dtype, shape and stride on `storage` at `like`'s offset (on storage of its own
    if None), made on the meta device and wrapped: dispatching the factory through the fake mode took 9 of the
    11 s of llama3 8B's expansion (CPU, profiled)."""
    if storage is None:
        meta = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device="meta")
    else:
        meta = torch.empty(0, dtype=like.dtype, device="meta").set_(storage, like.storage_offset(), like.shape, like.stride())
    return FakeTensor(mode, meta, like.device)


def _attr_prefix(target: str) -> str:
    """The name make_fx numbers an attribute of the traced module after (`sdpa_score` for `sdpa_score12`: each
    FlexAttention call registers its score and mask functions under the next free number, `get_fresh_qualname`)."""
    return target.rstrip("0123456789")


def _op(node: fx.Node) -> tuple[str, Any]:
    """What a node runs, the same for a traced layer's op and its copies (whose attributes are numbered anew)."""
    return (node.op, _attr_prefix(node.target) if node.op == "get_attr" else node.target)


class _Attributes:
    """The expanded step's module attributes (subgraphs, constants), numbered per prefix in graph order as make_fx
    numbers them while it traces every layer: a copy of a layer's FlexAttention call gets its own `sdpa_score<k>`,
    holding the traced call's module."""

    def __init__(self, source: fx.GraphModule):
        self.source, self.root, self.count = source, nn.Module(), {}

    def take(self, target: str) -> str:
        value = functools.reduce(getattr, target.split("."), self.source)
        prefix = _attr_prefix(target)
        k = self.count.get(prefix, 0)
        self.count[prefix] = k + 1
        name = f"{prefix}{k}"
        if isinstance(value, nn.Module):
            self.root.add_module(name, value)
        else:
            setattr(self.root, name, value)
        return name


def make_fx_name(graph: fx.Graph, target: Any) -> str | None:
    """The name make_fx gives a node of `target` (after an op's packet: `view`, not `view_default`; None: fx's own),
    so that a graph built from copies, names included, is the one a trace gives, and so are the compile cache's
    keys."""
    return graph._target_to_str(target.overloadpacket.__name__) if isinstance(target, torch._ops.OpOverload) else None


def _check_aligned(plan: TemplatePlan, runs: dict[int | None, list[fx.Node]], step: int) -> None:
    """A copy reads the neighbour made before it (the previous layer's in forward, the next one's in backward) by
    its ops' positions in the traced neighbour's run: where the neighbour repeats another traced layer than the
    copy's traced neighbour, the two runs must hold the same ops."""
    ops = {owner: [_op(node) for node in run] for owner, run in runs.items()}
    n = len(plan.names)
    for layer in range(n):
        if 0 <= layer + step < n and plan.source[layer] in runs:
            here, there = plan.source[layer] + step, plan.source[layer + step]
            if here != there and here in runs and ops[here] != ops.get(there, []):
                raise _Refused(f"traced layers {here} and {there} differ where layer {plan.names[layer + step]} repeats {there}")


def _expand(x: _Expansion, inputs: Sequence[tuple[str | None, torch.Tensor]], params: int,
            mode: FakeTensorMode) -> fx.GraphModule:
    plan, n = x.plan, len(x.plan.names)
    graph = fx.Graph()
    graph._codegen = x.gm.graph._codegen
    shared: dict[fx.Node, fx.Node] = {}
    attributes = _Attributes(x.gm)
    # per model layer: its copies, by the traced node's place (group, position in its run) or input name
    layer_env: list[dict[Any, fx.Node]] = [{} for _ in range(n)]
    place: dict[fx.Node, tuple[int, int]] = {}

    def lookup(a: fx.Node, layer: int, owner: int) -> fx.Node:
        """Layer `layer`'s counterpart of traced node `a`, read by a copy of a node of traced layer `owner`."""
        if x.owner[a] is None:
            return shared[a]
        q = layer + x.owner[a] - owner
        key = ("input", x.suffix[a]) if a.op == "placeholder" else place.get(a)
        found = layer_env[q].get(key) if 0 <= q < n else None
        if found is None or found.op != a.op or a.op != "placeholder" and _op(found) != _op(a):
            raise _Refused(f"layer {plan.names[layer]}'s copy of {a.name} has no counterpart in layer {q}")
        return found

    def value(node: fx.Node, layer: int, owner: int) -> Any:
        def fresh(t: torch.Tensor) -> torch.Tensor:
            source, index = x.storage_owner[storage_of(t)]
            if source is node:
                extent = compute_required_storage_length(t.shape, t.stride(), 0) * t.element_size()
                if t.storage_offset() == 0 and t.untyped_storage().nbytes() == extent:
                    return fake_on(mode, t)
                raw = torch.empty(t.untyped_storage().nbytes(), dtype=torch.uint8, device="meta")
                return fake_on(mode, t, raw.untyped_storage())
            counterpart = shared[source] if x.owner[source] is None else lookup(source, layer, owner)
            return fake_on(mode, t, tensors_of(counterpart.meta["val"])[index].untyped_storage())

        val = node.meta.get("val")
        # most values are one tensor: tree_map_only builds a wrapper per call (9 us a call on the CI machine, 0.1 us so)
        return fresh(val) if isinstance(val, torch.Tensor) else pytree.tree_map_only(torch.Tensor, fresh, val)

    def copy(node: fx.Node, layer: int | None, owner: int | None) -> fx.Node:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs),
                                       lambda a: shared[a] if layer is None else lookup(a, layer, owner))
        name = make_fx_name(graph, node.target)
        target = attributes.take(node.target) if node.op == "get_attr" else node.target
        new = graph.create_node(node.op, target, args, kwargs, name)
        new.meta = dict(node.meta)
        if layer is not None:
            new.meta["val"] = value(node, layer, owner)
            custom = node.meta.get("custom")
            if custom and BLOCK_KEY in custom:
                new.meta["custom"] = {**custom, BLOCK_KEY: int(plan.names[layer])}
        return new

    by_name = {}
    shared_inputs = []
    for node in x.placeholders:
        if x.owner[node] is None:
            shared_inputs.append(node)
        else:
            by_name[(x.owner[node], x.suffix[node])] = node
    if len(shared_inputs) != sum(_layer_of(fqn, plan) is None for fqn, _ in inputs):
        raise _Refused("the template's inputs outside the layers are not the model's")
    shared_iter = iter(shared_inputs)
    for k, (fqn, val) in enumerate(inputs):
        new = graph.placeholder(f"arg{k}_1")
        layer = _layer_of(fqn, plan)
        if layer is None:
            source = next(shared_iter)
            shared[source] = new
        else:
            position, suffix = layer
            source = by_name.get((plan.source[position], suffix))
            if source is None:
                raise _Refused(f"{fqn} has no traced counterpart")
            layer_env[position][("input", suffix)] = new
        new.meta = {**source.meta, "val": val}

    for g, (direction, runs) in enumerate(x.groups()):
        if direction == 0:
            for node in runs[None]:
                shared[node] = copy(node, None, None)
            continue
        for run in runs.values():
            for i, node in enumerate(run):
                place[node] = (g, i)
        _check_aligned(plan, runs, -direction)
        for layer in range(n) if direction > 0 else range(n - 1, -1, -1):
            owner = plan.source[layer]
            for i, node in enumerate(runs.get(owner, ())):
                layer_env[layer][(g, i)] = copy(node, layer, owner)

    def outside(a: fx.Node) -> fx.Node:
        """The counterpart of an output computed outside the layers: from the first or last layer's ops, if any."""
        owner = x.owner[a]
        if owner is None:
            return shared[a]
        if owner not in (0, plan.traced - 1):
            raise _Refused(f"output {a.name} comes from a traced interior layer")
        return lookup(a, 0 if owner == 0 else n - 1, owner)

    traced = list(x.output.args[0])
    position_of = {fqn: i for i, fqn in enumerate(x.names[: len(traced) - 1])}
    outputs = [outside(traced[0])]
    for fqn, _ in inputs[:params]:
        layer = _layer_of(fqn, plan)
        if layer is None:
            outputs.append(outside(traced[1 + position_of[fqn]]))
            continue
        position, suffix = layer
        owner = plan.source[position]
        a = traced[1 + position_of[plan.fqn_prefix(owner) + suffix]]
        outputs.append(shared[a] if x.owner[a] is None else lookup(a, position, owner))
    out = graph.output(type(x.output.args[0])(outputs))
    out.meta = dict(x.output.meta)
    # lazy as make_fx's module: its code is written when first called or printed, not at every pass's recompile
    return LazyGraphModule(attributes.root, graph)
