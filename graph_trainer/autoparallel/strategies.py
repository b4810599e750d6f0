"""Sharding strategies of each traced node, from DTensor's own op strategies.

A spec is one placement string per solver mesh dimension: "R" (replicate), "S<d>" (shard tensor dim
d), "P" (partial sum), "P<op>" for other reductions (e.g. "Pavg", "Pmask" for the masked partial of a
vocab-sharded embedding). A strategy lists the spec of each tensor output and the spec each tensor
argument must arrive in. Strategies are asked from DTensor with every candidate layout of every
input, so ops that follow their input (pointwise, views) enumerate one strategy per input layout.
Identical questions (same op, shapes, scalars and candidate sets) are answered once: in a
transformer block many nodes share them, and the blocks themselves are traced once (trace.py).
Ops DTensor has no strategy for get the declared fallback: everything replicated, listed in the report.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.utils._pytree import tree_flatten, tree_map

from . import compat

Spec = tuple[str, ...]
_MAX_SEPARATE_QUESTIONS = 64


def placement_str(p: Any) -> str | None:
    if isinstance(p, Replicate):
        return "R"
    if type(p) is Shard:
        return f"S{p.dim}"
    if isinstance(p, Partial):
        if "Mask" in type(p).__name__:
            return "Pmask"
        op = getattr(p, "reduce_op", "sum")
        return "P" if op == "sum" else f"P{op}"
    return None


def placement_of(s: str) -> Any:
    if s == "R":
        return Replicate()
    if s.startswith("S"):
        return Shard(int(s[1:]))
    if s == "Pmask":
        raise ValueError("a masked partial is produced by an op, never requested")
    return Partial() if s == "P" else Partial(s[1:])


def shard_factor(spec: Spec, sizes: Sequence[int]) -> int:
    return math.prod(n for p, n in zip(spec, sizes) if p.startswith("S"))


def evenly_sharded(spec: Spec, shape: Sequence[int], sizes: Sequence[int]) -> bool:
    per_dim: dict[int, int] = {}
    for p, n in zip(spec, sizes):
        if p.startswith("S"):
            d = int(p[1:])
            if d >= len(shape):
                return False
            per_dim[d] = per_dim.get(d, 1) * n
    return all(shape[d] % k == 0 for d, k in per_dim.items())


def candidate_specs(shape: Sequence[int], sizes: Sequence[int]) -> list[Spec]:
    """Every layout a fresh tensor (a parameter, a unit input) may take: R or S(d) per mesh dim."""
    options = ["R"] + [f"S{d}" for d in range(len(shape))]
    return [s for s in itertools.product(options, repeat=len(sizes)) if evenly_sharded(s, shape, sizes)]


@dataclass(frozen=True)
class Strategy:
    outs: tuple[Spec, ...]
    ins: tuple[Spec, ...]
    grad_outs: tuple[Spec, ...] | None = None
    """The gradient layout the op takes for each output, where it differs from the default rule
    (costs.backward_target): a Partial gradient passed through a view or cast."""
    grad_ins: tuple[Spec, ...] | None = None
    """The gradient layout the op gives each input, where it differs from costs.grad_spec."""


@dataclass
class NodeStrategies:
    strategies: list[Strategy]
    fallback: bool = False


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The node's tensor-valued arguments in the order DTensor flattens them."""
    flat, _ = tree_flatten((node.args, node.kwargs))
    return [a for a in flat if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def tensor_outputs(node: fx.Node) -> list[int]:
    """Positions (in the op's returns) that hold tensors."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [0]
    if isinstance(val, (tuple, list)):
        return [i for i, v in enumerate(val) if isinstance(v, torch.Tensor)]
    return []


def _meta(t: torch.Tensor) -> compat.TensorMeta:
    return compat.TensorMeta(t.shape, t.stride(), t.dtype)


@dataclass
class StrategyEnumerator:
    mesh: DeviceMesh
    sizes: tuple[int, ...]
    cache: dict[Any, NodeStrategies] = field(default_factory=dict)
    calls: int = 0
    hits: int = 0

    def _dspec(self, spec: Spec, t: torch.Tensor) -> compat.DTensorSpec:
        return compat.DTensorSpec(self.mesh, tuple(placement_of(p) for p in spec), tensor_meta=_meta(t))

    def _spec(self, dspec: Any) -> Spec | None:
        strs = tuple(placement_str(p) for p in dspec.placements)
        return None if any(s is None for s in strs) else strs  # type: ignore[return-value]

    def enumerate(self, node: fx.Node, arg_candidates: list[list[Spec]]) -> NodeStrategies:
        args = tensor_args(node)
        outs = tensor_outputs(node)
        key = (node.target,
               tuple((tuple(a.meta["val"].shape), a.meta["val"].dtype, tuple(a.meta["val"].stride())) for a in args),
               _scalars(node), tuple(tuple(c) for c in arg_candidates))
        if key in self.cache:
            self.hits += 1
            return self.cache[key]
        self.calls += 1
        kind = compat.strategy_kind(node.target) if self.sizes else None
        strategies: list[Strategy] = []
        if kind is not None:
            try:
                strategies = self._ask(node, kind, args, outs, arg_candidates)
            except Exception:  # noqa: BLE001  (a strategy function that rejects these args: see below)
                strategies = self._ask_each(node, kind, args, outs, arg_candidates)
        result = NodeStrategies(strategies)
        if not strategies:
            rep = ("R",) * len(self.sizes)
            # an op without tensor inputs makes a constant (a mask, a scalar): replicated is exact, not a fallback
            result = NodeStrategies([Strategy(tuple(rep for _ in outs), tuple(rep for _ in args))], fallback=bool(self.sizes) and bool(args))
        self.cache[key] = result
        return result

    def _ask_each(self, node: fx.Node, kind: str, args: list[fx.Node], outs: list[int], arg_candidates: list[list[Spec]]) -> list[Strategy]:
        """Ask once per combination of single input layouts, keeping the answers that come. Some
        strategy functions reject the whole question when one candidate cannot be served (torch
        2.11's view: "cannot be performed without redistribution"; 2.13 leaves that candidate out)."""
        combos = list(itertools.product(*arg_candidates))
        if len(combos) > _MAX_SEPARATE_QUESTIONS:
            return []
        found: dict[Strategy, None] = {}
        for combo in combos:
            try:
                found.update(dict.fromkeys(self._ask(node, kind, args, outs, [[c] for c in combo])))
            except Exception:  # noqa: BLE001  (this layout has no strategy: skip it)
                continue
        return list(found)

    def _schema_args(self, node: fx.Node, arg_candidates: list[list[Spec]], single: bool) -> tuple[tuple, dict]:
        it = iter(arg_candidates)

        def convert(a: Any) -> Any:
            if isinstance(a, fx.Node):
                val = a.meta.get("val")
                if not isinstance(val, torch.Tensor):
                    return val
                cands = next(it)
                if single:
                    # single-dim rules only read metadata and the kinds of placement present
                    cands = [next((c for c in cands if any(p.startswith("S") for p in c)), cands[0])]
                return compat.OpStrategy([compat.OpSpec(self._dspec(c, val)) for c in cands])
            return a

        args = tree_map(convert, node.args)
        kwargs = tree_map(convert, dict(node.kwargs))
        args = tuple(compat.TupleStrategy(tuple(a)) if isinstance(a, list) and a and isinstance(a[0], compat.OpStrategy) else a for a in args)
        return args, kwargs

    def _ask(self, node: fx.Node, kind: str, args: list[fx.Node], outs: list[int], arg_candidates: list[list[Spec]]) -> list[Strategy]:
        vals_in = [a.meta["val"] for a in args]
        val = node.meta["val"]
        vals_out = [val] if isinstance(val, torch.Tensor) else [val[i] for i in outs]
        found: list[Strategy] = []
        if kind == "full":
            sargs, skw = self._schema_args(node, arg_candidates, single=False)
            result = compat.call_full_strategy(node.target, sargs, skw)
            if not isinstance(result, compat.OpStrategy):
                return []
            for op_spec in result.strategies:
                out_specs = op_spec.output_specs
                out_list = list(out_specs) if isinstance(out_specs, (tuple, list)) else [out_specs]
                if len(out_list) == 1 and len(outs) > 1:
                    out_list = out_list * len(outs)
                if isinstance(val, (tuple, list)) and len(out_list) == len(val):
                    # DTensor gives no spec for an output it does not track: CUDA flash attention's 0-dim RNG
                    # offset on torch 2.11 (its seed is replicated); without one, every strategy was skipped and
                    # the op replicated over data parallelism (attention for the whole global batch per rank)
                    rep = ("R",) * len(self.sizes)
                    out_list = [self._dspec(rep, val[i]) if out_list[i] is None and val[i].dim() == 0 else out_list[i] for i in outs]
                in_list = op_spec.input_specs if op_spec.input_specs is not None else [out_list[0]] * len(args)
                if len(out_list) != len(outs) or len(in_list) != len(args) or any(s is None for s in out_list):
                    continue
                o = tuple(self._spec(s) for s in out_list)
                i = tuple(self._spec(s) for s in in_list)
                if any(s is None for s in o + i):
                    continue
                found.append(Strategy(o, i))  # type: ignore[arg-type]
        else:
            sargs, skw = self._schema_args(node, arg_candidates, single=True)
            rules = compat.call_single_dim_rules(node.target, sargs, skw)
            n_out = len(rules[0]) - len(args) if rules else len(outs)
            per_dim: list[tuple[str, ...]] = [tuple(["R"] * (n_out + len(args)))]
            for rule in rules:
                strs = tuple("R" if p is None else (f"S{p}" if isinstance(p, int) else placement_str(p)) for p in rule)
                if None not in strs and strs not in per_dim:
                    per_dim.append(strs)  # type: ignore[arg-type]
            for combo in itertools.product(per_dim, repeat=len(self.sizes)):
                specs = [tuple(c[j] for c in combo) for j in range(n_out + len(args))]
                o, i = tuple(specs[:n_out]), tuple(specs[n_out:])
                if n_out != len(outs):
                    o = tuple(specs[j] for j in outs) if n_out > len(outs) else o
                found.append(Strategy(o, i))
        unique: dict[Strategy, None] = {}
        for s in found:
            if len(s.outs) != len(vals_out) or len(s.ins) != len(vals_in):
                continue
            if all(evenly_sharded(sp, v.shape, self.sizes) for sp, v in zip(s.outs + s.ins, vals_out + vals_in)):
                unique[s] = None
        return list(unique)


def _scalars(node: fx.Node) -> Any:
    def key(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return "T"
        if isinstance(a, (list, tuple)):
            return tuple(key(x) for x in a)
        if isinstance(a, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return a
        return repr(a)

    return (key(node.args), tuple((k, key(v)) for k, v in sorted(node.kwargs.items())))
