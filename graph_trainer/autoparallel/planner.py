"""From a traced model to a solved plan: build the program (strategies, costs, memory), solve it,
and describe the result as data (`Plan`) that report.py prints/saves and apply.py executes."""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh

from ..config import ConfigError
from ..flops import node_flops
from ..hardware import OPTIMIZER_BYTES_PER_ELEMENT, Hardware
from ..parallel.mesh import DP_DIMS
from ..units import GiB
from . import flex, moe, program
from .costs import CommModel, backward_target, compute_time, grad_spec, mesh_links, state_bytes_per_element
from .memory import ActivationPolicy, gathered_params_bytes
from .plan_format import FOLLOW, Plan, canonical_op, unit_pattern, units_and_params
from .step_time import UnitTimes, overlapped_step
from .strategies import NodeStrategies, Spec, Strategy, StrategyEnumerator, candidate_specs, shard_factor, tensor_args, tensor_outputs
from .trace import BATCH_LAID, DIFFERENTIABLE, ModelTrace

aten = torch.ops.aten


@dataclass
class MeshInfo:
    names: tuple[str, ...]
    shape: tuple[int, ...]
    solver_dims: tuple[int, ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.shape[d] for d in self.solver_dims)

    @property
    def solver_names(self) -> tuple[str, ...]:
        return tuple(self.names[d] for d in self.solver_dims)

    def batch_spec(self) -> Spec:
        return tuple("S0" if n in DP_DIMS else "R" for n in self.solver_names)

    @property
    def dp_degree(self) -> int:
        return math.prod(s for n, s in zip(self.names, self.shape) if n in DP_DIMS)


@dataclass
class Settings:
    hw: Hardware
    memory_budget: float
    reduce_dtype: torch.dtype
    param_itemsize: int
    microbatches: int = 1
    moe_capacity_factor: float = 0.0
    expert_parallel_dim: str | None = None
    """A mesh dim the routed experts must be split over (`--parallelism.ep` pins it); None: the solver chooses."""
    activations: ActivationPolicy | None = None
    """The run's activation checkpointing, to count saved activations and gathered parameters in the
    memory row (memory.py); None counts parameters, gradients and optimizer state only."""
    pinned_storage: dict[str, Spec] = field(default_factory=dict)
    """Parameter pattern (as plan.json's `params` keys) -> the storage layout it must have: prices a
    placement chosen elsewhere under this model (`price_placement`)."""


@dataclass
class _Value:
    node: int
    out: int
    nbytes: float
    grad_nbytes: float | None
    shape: tuple[int, ...]
    latency_share: float = 1.0
    contiguous: bool = True
    """False for a parameter's strided view (a weight's transpose): its shard is copied contiguous before it is sent. A weight
    stored Shard(1) and read transposed gathers its transpose's Shard(0) that way: 31.8 ms of `cat_clone_permute`
    copies in an auto-placed 8B step on 4 H200s (bench/results/2026-11-28-auto-placed-4gpu), which the solver did not
    price and so chose over Shard(0), whose weight is gathered before the transpose."""


@dataclass
class _Builder:
    mesh: MeshInfo
    settings: Settings
    comm: CommModel
    enum: StrategyEnumerator | None
    nodes: list[program.ProgramNode] = field(default_factory=list)
    strategies: list[list[Strategy]] = field(default_factory=list)
    edges: list[program.ProgramEdge] = field(default_factory=list)
    edge_info: list[tuple[list, list, dict]] = field(default_factory=list)
    labels: list[tuple[int, str]] = field(default_factory=list)
    fallbacks: list[tuple[str, str]] = field(default_factory=list)
    inner_comm: dict[int, list[tuple]] = field(default_factory=dict)
    """Node -> per strategy, the collectives its op runs itself (the MoE all-to-alls), as edge_info's entries."""
    memory_kind: dict[int, str] = field(default_factory=dict)
    """Node -> what its memory is: `states` (parameter, gradient, Adam), `activations`, `moe_dispatch`."""
    param_like: set[int] = field(default_factory=set)
    """Parameters and their one-input derivatives (transposes, views, casts): their collectives over the
    data-parallel dims are the FSDP-like ones a schedule overlaps with compute (step_time.py)."""

    def add_node(self, strategies: list[Strategy], costs: list[float], label: tuple[int, str], memory: list[float] | None = None,
                 memory_kind: str = "states", computes: bool = True) -> int:
        """`computes`: its costs are its unit's compute, behind which the unit's parameter collectives run (not a
        parameter's optimizer step, which comes after every reduction)."""
        self.nodes.append(program.ProgramNode(costs, memory, label[0] if computes and label[0] >= 0 else None))
        self.strategies.append(strategies)
        self.labels.append(label)
        if memory is not None:
            self.memory_kind[len(self.nodes) - 1] = memory_kind
        return len(self.nodes) - 1

    def edge(self, src: int, src_keys: list, dst: int, dst_keys: list, price: Callable[[Any, Any], tuple[float, list]]) -> None:
        """A program edge; `price(src_key, dst_key)` -> (seconds, [(direction, collective, count, bytes, seconds with
        its share of the copies around it, seconds of the collective alone where it runs over a data-parallel dim)])."""
        si = {k: i for i, k in enumerate(dict.fromkeys(src_keys))}
        di = {k: i for i, k in enumerate(dict.fromkeys(dst_keys))}
        table = {(a, c): price(a, c) for a in si for c in di}
        cost = [[table[(a, c)][0] for c in di] for a in si]
        # a parameter's collectives over the data-parallel dims run beside its unit's compute (prefetched gathers,
        # deferred reductions); the copies around them do not, nor its collectives over tp: with the weights gathered over
        # the tp ranks of 8B-16L tp 2 (the sequence split, attention's heads moved by all-to-all) 54 ms of the step's
        # all-gathers stayed exposed on 2 H200s, and it ran at 0.83x Megatron's (bench/results/2026-11-30-session24)
        hidden = self.labels[src][0] if src in self.param_like and self.labels[src][0] >= 0 else None
        comm = [[sum(c[5] for c in table[(a, k)][1]) for k in di] for a in si] if hidden is not None else None
        self.edges.append(program.ProgramEdge(src, dst, [si[k] for k in src_keys], [di[k] for k in dst_keys], cost, hidden,
                                              comm))
        self.edge_info.append((src_keys, dst_keys, table))

    def _price(self, value: _Value, nbytes: float, src: Spec, dst: Spec, mult: float, direction: str) -> tuple[float, list]:
        """(seconds, [(direction, collective, count, bytes, seconds with its share of the copies, seconds of the collective
        alone where it runs over a data-parallel dim, else 0)])."""
        t, colls = self.comm.redistribute(nbytes, src, dst, value.latency_share, value.shape)
        if math.isinf(t):
            return t, []
        if colls and direction == "forward" and not value.contiguous:
            t += self.comm.reorder_copy(nbytes / shard_factor(src, self.mesh.sizes))
        timed = self.comm.collective_times(nbytes, src, dst, value.latency_share, value.shape)
        dims = self.mesh.solver_names
        return mult * t, [(direction, kind, mult, mult * b, mult * t / len(colls), mult * s if dims[m] in DP_DIMS else 0.0)
                          for (kind, b), (m, s) in zip(colls, timed)]

    def connect(self, value: _Value, uses: list[tuple[int, int, float]]) -> None:
        """Edges from a value to the ops reading it. With several readers the value is redistributed
        once into a shared layout (a copy node) that the readers take from, and their gradients are
        summed in an accumulator layout (another node) before going back to the producer once."""
        outs = [_out_key(s, value.out) for s in self.strategies[value.node]]
        if len(uses) == 1:
            dst, arg, mult = uses[0]
            strats = self.strategies[dst]
            if value.grad_nbytes is None:
                keys = [(s.ins[arg], None) for s in strats]
            else:
                keys = [(s.ins[arg], grad_spec(s, arg)) for s in strats]

            def both(o: tuple, k: tuple) -> tuple[float, list]:
                t1, c1 = self._price(value, value.nbytes, o[0], k[0], mult, "forward")
                if math.isinf(t1) or k[1] is None:
                    return t1, c1
                t2, c2 = self._price_grad(value, k[1], o, k[0], mult)
                return t1 + t2, c1 + c2

            self.edge(value.node, outs, dst, keys, both)
            return
        mult = uses[0][2]
        copies = list(dict.fromkeys([o[0] for o in outs] + candidate_specs(value.shape, self.mesh.sizes)))
        copy = self.add_node([Strategy((c,), (c,)) for c in copies], [0.0] * len(copies), (-1, "copy"))
        self.edge(value.node, outs, copy, copies, lambda o, c: self._price(value, value.nbytes, o[0], c, mult, "forward"))
        for dst, arg, m in uses:
            keys = [s.ins[arg] for s in self.strategies[dst]]
            self.edge(copy, copies, dst, keys, lambda c, r, m=m: self._price(value, value.nbytes, c, r, m, "forward"))
        if value.grad_nbytes is None:
            return
        grads = {grad_spec(s, arg): None for dst, arg, _ in uses for s in self.strategies[dst]}
        layouts = list(dict.fromkeys(list(grads) + [o[0] for o in outs]))
        acc = self.add_node([Strategy((a,), ()) for a in layouts], [0.0] * len(layouts), (-1, "grad-accumulator"))
        for dst, arg, m in uses:
            gkeys = [grad_spec(s, arg) for s in self.strategies[dst]]
            self.edge(dst, gkeys, acc, layouts, lambda g, a, m=m: self._price(value, value.grad_nbytes, g, _into(g, a), m, "backward"))
        self.edge(value.node, outs, acc, layouts, lambda o, a: self._price_grad(value, a, o, o[0], mult))

    def _price_grad(self, value: _Value, grad: Spec, out_key: tuple, forward_dst: Spec, mult: float) -> tuple[float, list]:
        """The gradient's way back into its producer. By default DTensor's backward of the forward
        redistribution sends it to the producer's layout (backward_target). A producer that takes a
        Partial gradient (`Strategy.grad_outs`) gets it only when nothing was redistributed in forward."""
        out, accepted = out_key
        if accepted is None:
            target = backward_target(out, grad)
        elif forward_dst != out:
            return math.inf, []
        else:
            target = accepted
        return self._price(value, value.grad_nbytes, grad, target, mult, "backward")


def _out_key(s: Strategy, out: int) -> tuple[Spec, Spec | None]:
    """A producer's side of an edge: its output layout and the gradient layout it takes (None: its default)."""
    return s.outs[out], s.grad_outs[out] if s.grad_outs is not None else None


def _into(g: Spec, acc: Spec) -> Spec:
    """Adding a gradient into a Partial accumulator needs it Replicate there, never reduced."""
    return tuple("R" if a.startswith("P") and not p.startswith("P") else a for p, a in zip(g, acc))


def _nbytes(t: torch.Tensor) -> float:
    return float(t.numel() * t.element_size())


def _is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def build_and_solve(trace: ModelTrace, mesh: MeshInfo, solver_mesh: DeviceMesh | None, settings: Settings) -> "Plan":
    t0 = time.perf_counter()
    sizes = mesh.sizes
    hw = settings.hw
    comm = CommModel(sizes, mesh_links(mesh.shape, mesh.solver_dims, hw), hw.mem_bw, hw.launch_s)
    enum = StrategyEnumerator(solver_mesh, sizes) if solver_mesh is not None else None
    b = _Builder(mesh, settings, comm, enum)
    one: Spec = tuple("R" for _ in sizes)
    reduce_itemsize = torch.empty((), dtype=settings.reduce_dtype).element_size()
    calls_of: dict[int, int] = defaultdict(int)
    for c in trace.calls:
        calls_of[c.kind] += 1
    unit_requires_grad: dict[tuple[int, int], bool] = defaultdict(bool)
    for c in trace.calls:
        for j, src in enumerate(c.sources):
            unit_requires_grad[(c.kind, j)] |= src.kind in DIFFERENTIABLE

    placeholders: dict[tuple[int, int], int] = {}
    placeholder_bytes: dict[tuple[int, int], float] = {}
    outputs: dict[int, _Value] = {}
    unit_nodes: dict[int, dict[str, int]] = {}
    policy = settings.activations
    unit_param_bytes: list[float] = []
    for unit in trace.units:
        mult = calls_of[unit.kind]
        saved, kept_inputs = policy.saved_copies(unit.modules) if policy else (0, 0)
        recomputed = policy.recomputed(unit.modules) if policy else 0
        unit_param_bytes.append(0.0)
        ids: dict[str, int] = {}
        values: dict[tuple[str, int], _Value] = {}
        uses: dict[tuple[int, int], list[tuple[int, int, float]]] = defaultdict(list)
        by_key: dict[tuple[int, int], _Value] = {}
        n_p, n_b = len(unit.param_names), len(unit.buffer_names)
        inputs = [n.name for n in unit.gm.graph.nodes if n.op == "placeholder"][n_p + n_b:]
        kept = policy.keeps(unit.gm, unit.kept, {n for j, n in enumerate(inputs) if unit_requires_grad[(unit.kind, j)]},
                            unit.modules) if policy else {}
        ph = 0
        for node in unit.gm.graph.nodes:
            if node.op == "placeholder":
                val = node.meta["val"]
                if ph < n_p:
                    cands = candidate_specs(val.shape, sizes) if sizes else [()]
                    pinned = settings.pinned_storage.get(f"{unit_pattern(unit)}.{unit.param_names[ph]}")
                    if pinned is not None:
                        cands = [tuple(pinned)]
                    state = state_bytes_per_element(settings.param_itemsize)
                    mem = [mult * val.numel() * state / shard_factor(c, sizes) for c in cands]
                    opt = [mult * val.numel() * OPTIMIZER_BYTES_PER_ELEMENT / shard_factor(c, sizes) / hw.mem_bw for c in cands]
                    unit_param_bytes[-1] += _nbytes(val)
                    ids[node.name] = b.add_node([Strategy((c,), ()) for c in cands], opt, (unit.kind, node.name), mem,
                                                computes=False)
                    b.param_like.add(ids[node.name])
                    grad = val.numel() * reduce_itemsize
                elif ph < n_p + n_b:
                    ids[node.name] = b.add_node([Strategy((one,), ())], [0.0], (unit.kind, node.name))
                    grad = None
                else:
                    j = ph - n_p - n_b
                    cands = candidate_specs(val.shape, sizes) if sizes else [()]
                    # a recomputed block keeps its input for the recomputation, the one it recomputes included
                    copies = kept_inputs + (saved - (1 if kept_inputs else 0)) * kept.get(node.name, {}).get(0, 0.0)
                    held = [copies * _nbytes(val) / shard_factor(c, sizes) for c in cands] if copies and _is_float(val) else None
                    ids[node.name] = b.add_node([Strategy((c,), (c,)) for c in cands], [0.0] * len(cands), (unit.kind, node.name),
                                                held, "activations")
                    placeholders[(unit.kind, j)] = ids[node.name]
                    placeholder_bytes[(unit.kind, j)] = _nbytes(val)
                    grad = _nbytes(val) if unit_requires_grad[(unit.kind, j)] and _is_float(val) else None
                share = 1.0 / n_p if ph < n_p else 1.0
                values[(node.name, 0)] = _Value(ids[node.name], 0, _nbytes(val), grad, tuple(val.shape), share)
                ph += 1
            elif node.op == "call_function" and node.target is operator.getitem:
                if (node.args[0].name, node.args[1]) in values:  # else a non-tensor output (cuDNN attention's None)
                    values[(node.name, 0)] = values[(node.args[0].name, node.args[1])]
            elif node.op == "call_function":
                args = tensor_args(node)
                arg_values = [values[(a.name, 0)] for a in args]
                cands = [sorted({s.outs[v.out] for s in b.strategies[v.node]}) for v in arg_values]
                val = node.meta["val"]
                out_vals = [val] if isinstance(val, torch.Tensor) else [val[i] for i in tensor_outputs(node)]
                needs_grad = any(v.grad_nbytes is not None for v in arg_values)
                inner = None
                memory, memory_kind = None, "activations"
                if node.target is moe.ROUTED_EXPERTS:
                    strategies, costs, inner, moe_saved = _routed_experts(node, unit.modules[0], mult, b, settings)
                    if policy is not None:
                        memory, memory_kind = [saved * m for m in moe_saved], "moe_dispatch"
                else:
                    if enum is not None and node.target is flex.FLEX_ATTENTION:
                        ns = NodeStrategies(flex.declared_strategies(node, sizes))
                    elif enum is not None:
                        ns = enum.enumerate(node, cands)
                    else:
                        ns = NodeStrategies([Strategy(tuple(() for _ in tensor_outputs(node)), tuple(() for _ in args))])
                    strategies = [s for s in ns.strategies if _reachable(s, cands)] or ns.strategies
                    if needs_grad and _passes_partial_grads(node):
                        strategies = _with_partial_grads(strategies)
                    if ns.fallback:
                        b.fallbacks.append((str(node.target), unit.node_module.get(node.name, unit.modules[0])))
                    flops = node_flops(node)
                    dtype = next((v.dtype for v in out_vals if v.is_floating_point()), torch.float32)
                    in_b = [v.nbytes for v in arg_values]
                    out_b = [_nbytes(v) for v in out_vals]
                    if getattr(node.target, "is_view", False) or canonical_op(node) in FOLLOW:
                        costs = [0.0] * len(strategies)  # a view moves no data
                    else:
                        # a recomputed block or op runs its forward (a third of forward + backward with
                        # FLOPs, else a half) once more
                        op_recomputed = policy is not None and needs_grad and policy.recomputes_op(unit.modules, bool(flops))
                        runs = mult + (recomputed / 3 if needs_grad else 0) + (mult / 2 if op_recomputed else 0)
                        costs = [runs * compute_time(flops, in_b, out_b, s, sizes, dtype, hw, needs_grad) for s in strategies]
                    if saved and node.name in kept:
                        outs = kept[node.name]
                        memory = [saved * sum(ob * outs[pos] / shard_factor(o, sizes)
                                              for ob, o, pos in zip(out_b, s.outs, tensor_outputs(node)) if pos in outs)
                                  for s in strategies]
                ids[node.name] = b.add_node(strategies, costs, (unit.kind, node.name), memory, memory_kind)
                if inner is not None:
                    b.inner_comm[ids[node.name]] = inner
                for i, v in enumerate(arg_values):
                    uses[(v.node, v.out)].append((ids[node.name], i, mult))
                    by_key[(v.node, v.out)] = v
                # a parameter's transpose/view/cast is still that parameter: its collectives bucket alike
                share = arg_values[0].latency_share if len(arg_values) == 1 else 1.0
                of_param = len(arg_values) == 1 and arg_values[0].node in b.param_like
                if of_param:
                    b.param_like.add(ids[node.name])
                for k, pos in enumerate(tensor_outputs(node)):
                    ov = out_vals[k]
                    # a parameter's gradient is reduced in the reduce dtype, through its views and casts too
                    grad = (ov.numel() * reduce_itemsize if of_param else _nbytes(ov)) if needs_grad and _is_float(ov) else None
                    values[(node.name, pos)] = _Value(ids[node.name], k, _nbytes(ov), grad, tuple(ov.shape), share,
                                                      not of_param or ov.is_contiguous())
            elif node.op == "output":
                (ret,) = [a for a in torch.utils._pytree.tree_leaves(node.args[0])]
                outputs[unit.kind] = values[(ret.name, 0)]
        for key, readers in uses.items():
            b.connect(by_key[key], readers)
        unit_nodes[unit.kind] = ids

    batch = mesh.batch_spec()
    sources: dict[tuple[str, str], int] = {}
    cross: dict[tuple[int, int, int], float] = defaultdict(float)
    cross_value: dict[tuple[int, int, int], _Value] = {}
    for c in trace.calls:
        for j, src in enumerate(c.sources):
            dst = placeholders[(c.kind, j)]
            if src.kind == "unit":
                v = outputs[trace.calls[src.call].kind]
            else:
                key = (src.kind, src.name)
                if key not in sources:
                    spec = batch if src.kind in BATCH_LAID else one
                    sources[key] = b.add_node([Strategy((spec,), ())], [0.0], (-1, f"{src.kind}:{src.name}"))
                v = _Value(sources[key], 0, placeholder_bytes[(c.kind, j)], None, ())
            cross[(v.node, v.out, dst)] += 1
            cross_value[(v.node, v.out, dst)] = v
    for key, count in cross.items():
        b.connect(cross_value[key], [(key[2], 0, count)])

    final = outputs[trace.calls[trace.output.call].kind]
    sink = b.add_node([Strategy((), (batch,))], [0.0], (-1, "output"))
    b.connect(final, [(sink, 0, 1)])

    gathered = gathered_params_bytes(unit_param_bytes, mesh.names, mesh.shape) if policy else 0.0
    least = defaultdict(float, {"gathered_params": gathered})
    for i, kind in b.memory_kind.items():
        least[kind] += min(b.nodes[i].memory)
    _check_fits(least, settings)
    t_build = time.perf_counter() - t0
    try:
        sol = program.solve(b.nodes, b.edges, settings.memory_budget - gathered)
    except program.Infeasible:
        raise ConfigError(f"autoparallel: no plan fits the memory budget of {settings.memory_budget / GiB:.2f} GiB per rank "
                          f"(the layouts that need the least memory of each tensor do not combine); raise "
                          f"--compile.autoparallel_memory_budget or use more ranks") from None
    return _make_plan(trace, b, sol, unit_nodes, t_build, settings, gathered)


_MEMORY_WORDS = {"states": "parameters + gradients + optimizer state", "activations": "activations saved for backward",
                 "moe_dispatch": "MoE dispatch buffers", "gathered_params": "gathered parameters"}


def _check_fits(least: dict[str, float], settings: Settings) -> None:
    """Refuse, in one line with what it needs, a job whose smallest possible memory exceeds the budget."""
    total = sum(least.values())
    if total <= settings.memory_budget:
        return
    need = math.ceil(total / GiB * 100) / 100
    parts = " + ".join(f"{_MEMORY_WORDS[k]} {v / GiB:.2f}" for k, v in least.items() if v)
    policy = settings.activations
    hint = ", or --activation_checkpoint.mode full" if policy is not None and policy.mode != "full" and least["activations"] else ""
    ac = f" with activation checkpointing '{policy.mode}'" if policy is not None else ""
    raise ConfigError(
        f"autoparallel: the memory budget {settings.memory_budget / GiB:.2f} GiB per rank is infeasible; {parts} GiB per rank on "
        f"this mesh{ac} need at least {need:.2f} GiB: set --compile.autoparallel_memory_budget {need:.2f}GiB or more, "
        f"use more ranks{hint}"
    )


def _routed_experts(node: fx.Node, where: str, mult: float, b: _Builder, settings: Settings
                    ) -> tuple[list[Strategy], list[float], list[list], list[float]]:
    """The MoE op's declared strategies (moe.py), their costs, the all-to-alls each one runs, and
    the bytes each keeps for backward per call."""
    sizes = b.mesh.sizes
    strategies = moe.declared_strategies(node, sizes, b.mesh.solver_names, settings.expert_parallel_dim)
    if not strategies:
        raise ConfigError(
            f"autoparallel: no declared strategy of the routed experts in {where} fits this mesh; expert parallelism over "
            f"{settings.expert_parallel_dim} needs the local tokens and the experts to divide by its size"
        )
    priced = [moe.strategy_cost(node, s, sizes, b.comm, settings.hw, settings.moe_capacity_factor) for s in strategies]
    costs = [mult * (c.compute_s + sum(t for *_, t in c.collectives)) for c in priced]
    inner = [[(d, kind, mult, mult * nbytes, mult * t, 0.0) for d, kind, nbytes, t in c.collectives] for c in priced]
    return strategies, costs, inner, [c.saved_bytes for c in priced]


_PARTIAL_GRAD_THROUGH = {"t", "transpose", "view", "_unsafe_view", "alias", "permute", "unsqueeze", "squeeze",
                         "view_as_complex", "view_as_real"}


def _passes_partial_grads(node: fx.Node) -> bool:
    """Views and dtype casts: their backward is a view or cast of the gradient, which DTensor runs on a
    Partial gradient as is (checked: the result stays Partial; `clone` or pointwise math would reduce)."""
    op = canonical_op(node)
    return op is None or op in _PARTIAL_GRAD_THROUGH


def _with_partial_grads(strategies: list[Strategy]) -> list[Strategy]:
    """Add, for each mesh dim on which a view/cast is replicated, the variant that takes its output's
    gradient as a partial sum and hands the same to its input: the reduction then happens once where
    the value was redistributed (Megatron: x gathered once for q, k and v, and their three partial
    input gradients reduce-scattered once), not after each reader."""
    out = list(strategies)
    for s in strategies:
        if len(s.ins) != 1 or len(s.outs) != 1:
            continue
        dims = [m for m, (i, o) in enumerate(zip(s.ins[0], s.outs[0])) if i == "R" and o == "R"]
        for k in range(1, len(dims) + 1):
            for subset in itertools.combinations(dims, k):
                partial = lambda spec: tuple("P" if m in subset else p for m, p in enumerate(spec))  # noqa: E731
                out.append(Strategy(s.outs, s.ins, grad_outs=(partial(s.outs[0]),), grad_ins=(partial(s.ins[0]),)))
    return out


def _reachable(s: Strategy, cands: list[list[Spec]]) -> bool:
    """A strategy asking an input to be Partial where no producer layout is that Partial can never be fed."""
    for spec, cs in zip(s.ins, cands):
        for m, p in enumerate(spec):
            if p.startswith("P") and not any(c[m] == p for c in cs):
                return False
    return True


def _make_plan(trace: ModelTrace, b: _Builder, sol: program.Solution, unit_nodes: dict[int, dict[str, int]], t_build: float,
               settings: Settings, gathered: float) -> Plan:
    chosen = [b.strategies[i][c] for i, c in enumerate(sol.choice)]
    micro = settings.microbatches
    units, params = units_and_params(trace, chosen, unit_nodes)
    calls_of: dict[int, int] = defaultdict(int)
    for c in trace.calls:
        calls_of[c.kind] += 1
    per_kind = {k: UnitTimes() for k in calls_of}
    param_nodes = {i for i, kind in b.memory_kind.items() if kind == "states"}
    optimizer = sum(b.nodes[i].costs[sol.choice[i]] for i in param_nodes)
    for i, c in enumerate(sol.choice):
        kind = b.labels[i][0]
        if kind >= 0 and i not in param_nodes:
            per_kind[kind].compute += b.nodes[i].costs[c] / calls_of[kind]

    comm: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0.0, "bytes": 0.0, "time_s": 0.0})

    def add(colls: list, src: int, dst: int) -> None:
        for direction, kind, count, nbytes, t, overlappable in colls:
            entry = comm[f"{kind} ({direction})"]
            entry["count"] += micro * count
            entry["bytes"] += micro * nbytes
            entry["time_s"] += micro * t
            owner = b.labels[src][0] if src in b.param_like or b.labels[dst][0] < 0 else b.labels[dst][0]
            if owner < 0:
                continue
            u = per_kind[owner]
            # a parameter's collectives over the data-parallel dims overlap compute; the copies around them do not
            hidden = overlappable / calls_of[owner] if src in b.param_like else 0.0
            serial = t / calls_of[owner] - hidden
            if direction == "forward":
                u.param_forward += hidden
                u.serial_forward += serial
            else:
                u.param_backward += hidden
                u.serial_backward += serial

    for edge, (src_keys, dst_keys, table) in zip(b.edges, b.edge_info):
        add(table[(src_keys[sol.choice[edge.src]], dst_keys[sol.choice[edge.dst]])][1], edge.src, edge.dst)
    for i, per_strategy in b.inner_comm.items():
        add(per_strategy[sol.choice[i]], i, i)
    timeline = overlapped_step([c.kind for c in trace.calls], per_kind, optimizer, settings.hw.launch_s)
    memory = defaultdict(float, {"gathered_params": gathered})
    for i, kind in b.memory_kind.items():
        memory[kind] += b.nodes[i].memory[sol.choice[i]]
    compute = sum(b.nodes[i].costs[c] for i, c in enumerate(sol.choice)) * micro
    data = {
        "version": 1,
        "mesh": {"names": list(b.mesh.names), "shape": list(b.mesh.shape), "solver_dims": list(b.mesh.solver_names)},
        "batch_spec": list(b.mesh.batch_spec()),
        "units": units,
        "params": params,
        "fallbacks": sorted({f"{op} in {mod}" for op, mod in b.fallbacks}),
        "moe": moe.plan_summary(trace, b.strategies, sol.choice, unit_nodes, b.mesh, settings.moe_capacity_factor),
        "predicted": {
            "hardware": settings.hw.describe(),
            "compute_and_optimizer_s": compute, "communication_s": sum(v["time_s"] for v in comm.values()),
            "step_s": timeline.step_s * micro, "exposed_communication_s": timeline.step_s * micro - compute,
            "communication": {k: dict(v) for k, v in sorted(comm.items())},
            "memory_per_rank_bytes": sum(memory.values()), "memory_bytes": dict(memory),
            "memory_budget_bytes": settings.memory_budget,
            "activation_checkpoint": settings.activations.mode if settings.activations else None,
            "objective_s": sol.objective * micro,
        },
        "program": {"variables": sol.variables, "constraints": sol.constraints, "method": sol.method, "status": sol.status,
                    "lp_integral": sol.lp_integral, "build_s": t_build + sol.build_s, "solve_s": sol.solve_s,
                    "strategy_queries": b.enum.calls if b.enum else 0, "strategy_cache_hits": b.enum.hits if b.enum else 0},
    }
    return Plan(data)


def plan_model(model: torch.nn.Module, batch_shape: tuple[int, int], param_dtype: torch.dtype, device: torch.device,
               mesh: MeshInfo, solver_mesh: DeviceMesh | None, settings: Settings, activations: int = 0) -> Plan:
    """Trace a meta-device model (a pipeline stage taking `activations`-wide input: trace.trace_model) and
    solve its placement on `mesh`."""
    from .trace import trace_model

    t0 = time.perf_counter()
    trace = trace_model(model, batch_shape, param_dtype, device, activations)
    t1 = time.perf_counter()
    plan = build_and_solve(trace, mesh, solver_mesh, settings)
    plan.data["program"]["trace_s"] = t1 - t0
    plan.data["program"]["total_s"] = time.perf_counter() - t0
    return plan


def price_placement(model: torch.nn.Module, batch_shape: tuple[int, int], param_dtype: torch.dtype, device: torch.device,
                    mesh: MeshInfo, solver_mesh: DeviceMesh | None, settings: Settings, storage: dict[str, Spec]) -> Plan:
    """A placement chosen elsewhere (e.g. by Meta's AutoParallel), priced under this model: each
    parameter pattern's storage layout is pinned to `storage` and the rest (compute layouts, op
    strategies) is what this model would run it with. The plan's `predicted` is the price."""
    pinned = dataclasses.replace(settings, pinned_storage={**settings.pinned_storage, **storage})
    return plan_model(model, batch_shape, param_dtype, device, mesh, solver_mesh, pinned)
