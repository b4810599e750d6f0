"""Apply a plan: parameters become DTensors stored in the chosen layouts, and each unit's forward
becomes an interpreter of its traced aten graph over DTensors that redistributes every argument to
the layout the plan chose for that op before running it.

Because the ops run as DTensor ops, autograd derives the backward (the reverse redistributions, the
gradient reductions of parameters used Replicate on batch-sharded data) exactly as the cost model
priced it, and `make_fx` (aot_fx_trace) turns the whole thing into one local graph with collectives.
A value read by several ops is redistributed once per target layout. Ops DTensor has no strategy
for run on the local (replicated) tensors: the declared fallback.

Plans are matched to the graph traced here by canonical op names (planner.canonical_op), so a plan
made on a CPU (plan command) applies to the graph traced on a GPU, where SDPA is another kernel and
dtype casts may differ.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import operator
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
from torch.nn import functional as F
from torch.nn.attention import sdpa_kernel

from ..config import ConfigError
from ..models import sdpa_wrappers
from . import compat, flex, moe
from .planner import DP_DIMS, canonical_op
from .strategies import Strategy, placement_of
from .trace import BATCH_LAID, ModelTrace, UnitGraph, tensor_at


def _placements(spec: list[str], mesh_names: list[str], solver_dims: list[str]) -> tuple:
    by_name = dict(zip(solver_dims, spec))
    return tuple(placement_of(by_name[n]) if n in by_name else Replicate() for n in mesh_names)


class _GradScale(torch.autograd.Function):
    """Identity forward; scales the gradient (each data-parallel rank's loss is a mean over its own
    share of the batch, so the summed parameter gradients must be divided by the dp degree)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None


class _AvgAsSum(torch.autograd.Function):
    """A Partial("avg") DTensor as the Partial sum of its shards divided by their count, on the mesh
    dims given; identity on the value. Redistributing it away from Partial("avg") directly would make
    DTensor send the gradient back to Partial("avg"), which it cannot do from a Partial sum: the
    gradient a broadcast operand of a sharded op receives (the RMS of a norm whose hidden dimension is
    sharded, read by `x * rsqrt(mean(x^2))`). The solver prices that gradient reduced to the value's
    producer layout (costs.backward_target), so backward reduces it to Replicate here."""

    @staticmethod
    def forward(ctx, t: DTensor, dims: tuple[int, ...]) -> DTensor:  # type: ignore[override]
        ctx.dims = dims
        mesh = t.device_mesh
        placements = tuple(Partial() if i in dims else p for i, p in enumerate(t.placements))
        local = t.to_local() / math.prod(mesh.size(i) for i in dims)
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=t.shape, stride=t.stride())

    @staticmethod
    def backward(ctx, grad: DTensor) -> tuple[DTensor, None]:  # type: ignore[override]
        reduced = tuple(Replicate() if i in ctx.dims and p.is_partial() else p for i, p in enumerate(grad.placements))
        return (grad if reduced == tuple(grad.placements) else grad.redistribute(grad.device_mesh, reduced)), None


class _GradInParamLayout(torch.autograd.Function):
    """Identity forward on a parameter; backward gives its gradient's local shard the memory order of the
    parameter's. The reduction to a parameter's layout returns the producer's order: a weight read
    transposed (`x @ w.t()`) and stored Shard(1) gets a column-major local gradient, while the DTensor
    around it claims row-major strides, so autograd accumulates it as it is. A fused optimizer then
    fails on GPU (the multi-tensor kernel needs param and grad strides equal) and on CPU silently
    applies the transposed update."""

    @staticmethod
    def forward(ctx, param: DTensor) -> DTensor:  # type: ignore[override]
        ctx.local = param.to_local()
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad: DTensor) -> DTensor:  # type: ignore[override]
        local = grad.to_local()
        ordered = _in_layout_of(local, ctx.local)
        if ordered is local:
            return grad
        return DTensor.from_local(ordered, grad.device_mesh, grad.placements, run_check=False, shape=grad.shape, stride=grad.stride())


class UnitRunner:
    """Runs one unit's traced forward graph over DTensors, following the plan's per-op layouts."""

    def __init__(self, unit: UnitGraph, plan_unit: dict, mesh: DeviceMesh, solver_dims: list[str],
                 batch_spec: list[str], input_kinds: list[str], final: bool, dp_degree: int, mp: Any):
        self.unit = unit
        self.mesh = mesh
        self.names = list(mesh.mesh_dim_names)
        self.solver_dims = solver_dims
        self.mp = mp
        self.final = final
        self.dp_degree = dp_degree
        self.batch = _placements(batch_spec, self.names, solver_dims)
        self.replicate = tuple(Replicate() for _ in self.names)
        self.input_kinds = input_kinds
        self.input_specs = [self._p(s) for s in plan_unit["inputs"]]
        nodes = [n for n in unit.gm.graph.nodes if canonical_op(n) is not None]
        planned = plan_unit["nodes"]
        ours = [canonical_op(n) for n in nodes]
        theirs = [n["op"] for n in planned]
        if ours != theirs:
            where = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            raise ConfigError(
                f"autoparallel: the plan does not match the traced graph of {unit.modules[0]!r} (op {where}: "
                f"{ours[where] if where < len(ours) else 'end'} here vs {theirs[where] if where < len(theirs) else 'end'} "
                "in the plan); re-run `graph-trainer plan` for this model and torch version"
            )
        self.node_plan = {n.name: (tuple(self._p(s) for s in p["ins"]), tuple(self._p(s) for s in p["outs"]))
                          for n, p in zip(nodes, planned)}
        self.moe_ops = {
            n.name: (moe.module_path(n, unit), Strategy((tuple(p["outs"][0]),), tuple(tuple(x) for x in p["ins"])))
            for n, p in zip(nodes, planned) if n.target is moe.ROUTED_EXPERTS
        }
        """Routed-experts node -> (its MoE module's path in the unit, the plan's strategy in solver specs)."""

    def _p(self, spec: list[str]) -> tuple:
        return _placements(spec, self.names, self.solver_dims)

    def _wrap(self, t: torch.Tensor, placements: tuple) -> DTensor:
        return DTensor.from_local(t, self.mesh, placements, run_check=False)

    def run(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        unit = self.unit
        env: dict[str, Any] = {}
        is_param: set[str] = set()
        # values computed from one parameter alone (transposes, views, casts): their gradients are the
        # parameter's, so they reduce in the reduce dtype wherever the plan redistributes them
        derived: set[str] = set()
        phs = [n for n in unit.gm.graph.nodes if n.op == "placeholder"]
        n_p, n_b = len(unit.param_names), len(unit.buffer_names)
        for name, ph in zip(unit.param_names, phs[:n_p]):
            owner_name, _, short = name.rpartition(".")
            env[ph.name] = _GradInParamLayout.apply((module.get_submodule(owner_name) if owner_name else module)._parameters[short])
            is_param.add(ph.name)
        for name, ph in zip(unit.buffer_names, phs[n_p : n_p + n_b]):
            b = module.get_buffer(name)
            env[ph.name] = b if isinstance(b, DTensor) else self._wrap(b, self.replicate)
        for j, (pos, ph) in enumerate(zip(unit.input_positions, phs[n_p + n_b :])):
            t = tensor_at(args, kwargs, pos)
            if not isinstance(t, DTensor):
                t = self._wrap(t, self.batch if self.input_kinds[j] in BATCH_LAID else self.replicate)
            traced = ph.meta["val"].shape
            if t.shape != traced:
                # The traced ops carry the traced shapes (views, masks): another shape would run them on wrong data.
                raise ConfigError(
                    f"autoparallel: {unit.modules[0]!r} was traced and planned for inputs of global shape {tuple(traced)}, "
                    f"got {tuple(t.shape)}; auto placement runs one batch shape: keep training.batch_size, "
                    "gradient_accumulation_steps and seq_len as planned, or drop --compile.autoparallel"
                )
            env[ph.name] = self._to(t, self.input_specs[j])
        cache: dict[tuple[str, tuple], Any] = {}

        def fetch(node: fx.Node, target: tuple | None) -> Any:
            value = env[node.name]
            if not isinstance(value, DTensor):
                return value
            if node.name in is_param:
                key = (node.name, target)
                if key not in cache:
                    cache[key] = value.redistribute(self.mesh, target or value.placements, forward_dtype=self.mp.param_dtype,
                                                    backward_dtype=self.mp.reduce_dtype)
                return cache[key]
            if target is None or tuple(value.placements) == target:
                return value
            key = (node.name, target)
            if key not in cache:
                cache[key] = (value.redistribute(self.mesh, target, backward_dtype=self.mp.reduce_dtype) if node.name in derived
                              else self._to(value, target))
            return cache[key]

        for node in unit.gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "get_attr":
                attr = getattr(unit.gm, node.target)
                # FlexAttention's score and mask functions are subgraphs, given to its op as they are
                env[node.name] = self._wrap(attr, self.replicate) if isinstance(attr, torch.Tensor) else attr
                continue
            if node.op == "output":
                out = env[node.args[0][0].name] if isinstance(node.args[0], (list, tuple)) else env[node.args[0].name]
                return self._finish(out)
            if node.target is operator.getitem:
                env[node.name] = env[node.args[0].name][node.args[1]]
                continue
            ins, outs = self.node_plan.get(node.name, (None, None))
            counter = itertools.count()

            def load(a: Any) -> Any:
                if not isinstance(a, fx.Node):
                    return a
                val = a.meta.get("val")
                if not isinstance(val, torch.Tensor):
                    return env[a.name]
                i = next(counter)
                return fetch(a, ins[i] if ins is not None else None)

            call_args = torch.utils._pytree.tree_map(load, node.args, is_leaf=lambda x: isinstance(x, fx.Node))
            call_kwargs = torch.utils._pytree.tree_map(load, dict(node.kwargs), is_leaf=lambda x: isinstance(x, fx.Node))
            if node.name in self.moe_ops:
                path, strategy = self.moe_ops[node.name]
                result = moe.run_routed_experts(module.get_submodule(path), self.mesh, strategy, call_args, self._p)
            elif node.target is flex.FLEX_ATTENTION:
                result = flex.run_local(node, call_args, self.mesh)
            elif (attention := self._local_attention(module, node, call_args)) is not None:
                result = attention
            elif not _has_dtensor(call_args, call_kwargs):
                # an op without tensor inputs makes a constant (a mask, a scalar): the same on every rank
                result = self._replicated(node.target(*call_args, **call_kwargs))
            elif compat.strategy_kind(node.target) is None:
                result = self._run_local(node, call_args, call_kwargs)
            else:
                result = node.target(*call_args, **call_kwargs)
            if outs is not None and isinstance(result, DTensor) and tuple(result.placements) != outs[0]:
                if not any(p.is_partial() for p in outs[0]):
                    result = self._to(result, outs[0])
            tensor_inputs = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
            if len(tensor_inputs) == 1 and (tensor_inputs[0].name in is_param or tensor_inputs[0].name in derived):
                derived.add(node.name)
            env[node.name] = result
        raise AssertionError("graph without output")

    def _to(self, t: DTensor, placements: tuple) -> DTensor:
        if tuple(t.placements) == tuple(placements):
            return t
        averaged = tuple(i for i, (p, q) in enumerate(zip(t.placements, placements))
                         if p.is_partial() and getattr(p, "reduce_op", None) == "avg" and not q.is_partial())
        if averaged:
            t = _AvgAsSum.apply(t, averaged)
        return t.redistribute(self.mesh, placements)

    # Dynamo (jit) breaks its graph at the kernel switch and cannot rebuild the local views of the
    # rotary embedding's complex tensors in the frame it resumes: it runs this as it is.
    @torch._dynamo.disable
    def _local_attention(self, module: nn.Module, node: fx.Node, args: Any) -> tuple | None:
        """Attention whose q, k and v share a layout split only over batch or heads is computed per rank
        on the local shards, through the model's SDPA module so that it picks the kernel the manual
        plan runs (cuDNN on Hopper) rather than the one recorded when tracing (DTensor's strategy for
        cuDNN attention's backward is broken on torch 2.11). None: not such an op, run it as traced."""
        # only the output may be read: the logsumexp and RNG state belong to the recorded kernel
        if canonical_op(node) != "attention" or any(u.target is not operator.getitem or (u.args[1] != 0 and u.users)
                                                    for u in node.users):
            return None
        q, k, v = args[:3]
        if not all(isinstance(t, DTensor) and t.placements == q.placements for t in (k, v)):
            return None
        if not all(p.is_replicate() or (p.is_shard() and p.dim in (0, 1)) for p in q.placements):
            return None
        named = node.normalized_arguments(self.unit.gm, normalize_to_only_use_kwargs=True).kwargs
        if named.get("attn_mask") is not None or named.get("attn_bias") is not None:
            return None
        wrappers = sdpa_wrappers(module)
        with sdpa_kernel(wrappers[0].sdpa_backends, set_priority=True) if wrappers else contextlib.nullcontext():
            # CUDA kernels take grouped-query k and v with fewer heads as they are; the CPU one got them repeated
            out = F.scaled_dot_product_attention(q.to_local(), k.to_local(), v.to_local(), dropout_p=named.get("dropout_p", 0.0),
                                                 is_causal=named.get("is_causal", False), scale=named.get("scale"),
                                                 enable_gqa=q.shape[1] != k.shape[1])
        traced = node.meta["val"][0]
        # Global shape and strides given, not derived from the shard: a rank's batch of one may carry any
        # stride on that size-one dimension (q's, 256 on CPU with bf16), from which DTensor would infer a
        # global layout with the batch inside the sequence and refuse the traced `view` after it.
        return (DTensor.from_local(_in_layout_of(out, traced), self.mesh, q.placements, run_check=False,
                                   shape=traced.shape, stride=traced.stride()),) + (None,) * (len(node.meta["val"]) - 1)

    def _run_local(self, node: fx.Node, args: Any, kwargs: Any) -> Any:
        """The fallback: every input replicated, the op runs on whole local tensors."""
        to_local = lambda a: self._to(a, self.replicate).to_local() if isinstance(a, DTensor) else a  # noqa: E731
        out = node.target(*torch.utils._pytree.tree_map(to_local, args), **torch.utils._pytree.tree_map(to_local, kwargs))
        return self._replicated(out)

    def _replicated(self, out: Any) -> Any:
        wrap = lambda t: self._wrap(t, self.replicate) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return torch.utils._pytree.tree_map(wrap, out)

    def _finish(self, out: DTensor) -> Any:
        if not self.final:
            return out
        local = self._to(out, self.batch).to_local(grad_placements=self.batch)
        return _GradScale.apply(local, 1.0 / self.dp_degree) if self.dp_degree > 1 else local


def _in_layout_of(t: torch.Tensor, traced: torch.Tensor) -> torch.Tensor:
    """`t` with the dimension order in memory of the value traced in its place. The graph after it was
    recorded for that layout: the kernel picked here (cuDNN returns batch, heads, sequence, head-dim
    contiguous) can differ from the traced one (flash returns heads inside sequence), and a later `view`
    of the recorded graph is only valid for the recorded order."""
    order = sorted(range(traced.dim()), key=lambda d: traced.stride(d), reverse=True)
    if t.permute(order).is_contiguous():
        return t
    return t.permute(order).contiguous().permute([order.index(d) for d in range(t.dim())])


def _has_dtensor(args: Any, kwargs: Any) -> bool:
    return any(isinstance(a, DTensor) for a in torch.utils._pytree.tree_leaves((args, kwargs)))


_RUNNING_CLASSES: dict[type, type] = {}


def _running_class(cls: type) -> type:
    if cls not in _RUNNING_CLASSES:
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return self._ap_runner.run(self, args, kwargs)

        _RUNNING_CLASSES[cls] = type(f"AutoParallel{cls.__name__}", (cls,), {"forward": forward})
    return _RUNNING_CLASSES[cls]


def apply_plan(model: nn.Module, plan: dict, trace: ModelTrace, mesh: DeviceMesh, mp: Any, moe_capacity_factor: float = 0.0,
               loss_follows: bool = True) -> nn.Module:
    """Place a meta-device `model` (traced into `trace` on this device) as `plan` says; its MoE
    modules (moe.prepare_model) get the dispatch of their routed experts' strategy. `loss_follows`: the
    model's output goes into the loss, whose per-rank mean makes the output's gradient dp times too large;
    False for a pipeline stage that hands its output to the next one (that gradient arrives already scaled)."""
    names = list(mesh.mesh_dim_names)
    solver_dims = plan["mesh"]["solver_dims"]
    dp_degree = math.prod(mesh.size(i) for i, n in enumerate(names) if n in DP_DIMS) if loss_follows else 1
    by_first = {u["modules"][0]: u for u in plan["units"]}
    final_module = trace.calls[trace.output.call].module
    input_kinds: dict[int, list[str]] = {}
    for c in trace.calls:
        input_kinds.setdefault(c.kind, [s.kind for s in c.sources])
    for unit in trace.units:
        plan_unit = by_first.get(unit.modules[0])
        if plan_unit is None or plan_unit["modules"] != unit.modules:
            raise ConfigError(f"autoparallel: the plan has no unit for modules {unit.modules[0]}..; it was made for another model")
        for fqn in unit.modules:
            module = model.get_submodule(fqn)
            for rel in unit.param_names:
                owner_name, _, short = rel.rpartition(".")
                owner = module.get_submodule(owner_name) if owner_name else module
                param = owner._parameters[short]
                placements = _placements(plan_unit["params"][rel], names, solver_dims)
                storage = distribute_tensor(torch.empty(param.shape, dtype=param.dtype, device="meta"), mesh, placements, src_data_rank=None)
                owner._parameters[short] = nn.Parameter(storage, requires_grad=param.requires_grad)
            module._ap_runner = UnitRunner(unit, plan_unit, mesh, solver_dims, plan["batch_spec"], input_kinds[unit.kind],
                                           fqn == final_module, dp_degree, mp)
            for path, strategy in module._ap_runner.moe_ops.values():
                moe.install(module.get_submodule(path), mesh, solver_dims, strategy, moe_capacity_factor)
            module.__class__ = _running_class(type(module))
    return model

