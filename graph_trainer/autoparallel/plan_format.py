"""Serialisation of a solved plan: the data plan.json holds (units, parameters, mesh) and the op
names that match a plan to a graph traced elsewhere (apply.py reads both)."""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Any

from torch import fx

from .strategies import Strategy, tensor_args
from .trace import ModelTrace, UnitGraph

_ATTENTION = {
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
}
FOLLOW = {"t", "transpose", "view", "_unsafe_view", "alias", "detach", "permute", "expand", "unsqueeze", "squeeze"}
"""Ops that move no data: a parameter seen through them is still that parameter."""


def canonical_op(node: fx.Node) -> str | None:
    """The op's name for matching a plan to a graph traced elsewhere (other device or torch), or
    None for nodes that only alias an output or change the dtype (they follow their input)."""
    if node.op != "call_function" or node.target is operator.getitem:
        return None
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    if name in ("_to_copy", "convert_element_type") and set(node.kwargs) <= {"dtype", "layout", "device"}:
        return None
    if name in _ATTENTION:
        return "attention"
    return name


@dataclass
class Plan:
    data: dict[str, Any]


def unit_pattern(unit: UnitGraph) -> str:
    """`layers.*` for a unit repeated over the blocks of a list, its own FQN otherwise."""
    return re.sub(r"\.\d+$", ".*", unit.modules[0]) if len(unit.modules) > 1 else unit.modules[0]


def _compute_spec(ph: fx.Node, chosen: list[Strategy], ids: dict[str, int]) -> list[str]:
    """The layout a parameter is used in by its first real op, seen through transposes/views/casts."""
    node, swapped = ph, False
    while len(node.users) == 1:
        user = next(iter(node.users))
        op = canonical_op(user)
        if op is not None and op not in FOLLOW:
            spec = chosen[ids[user.name]].ins[tensor_args(user).index(node)]
            if swapped:
                spec = tuple({"S0": "S1", "S1": "S0"}.get(p, p) for p in spec)
            return list(spec)
        if op in ("t", "transpose"):
            swapped = not swapped
        node = user
    return list(chosen[ids[ph.name]].outs[0])


def units_and_params(trace: ModelTrace, chosen: list[Strategy], unit_nodes: dict[int, dict[str, int]]) -> tuple[list, dict]:
    """Per unit kind its modules, input and parameter layouts and every op's chosen layouts; per
    parameter pattern (`layers.*.attention.wq.weight`) its shape, count, storage and compute layouts."""
    units = []
    params: dict[str, dict[str, Any]] = {}
    for unit in trace.units:
        ids = unit_nodes[unit.kind]
        n_p, n_b = len(unit.param_names), len(unit.buffer_names)
        phs = [n for n in unit.gm.graph.nodes if n.op == "placeholder"]
        storage = {name: list(chosen[ids[n.name]].outs[0]) for name, n in zip(unit.param_names, phs[:n_p])}
        inputs = [list(chosen[ids[n.name]].outs[0]) for n in phs[n_p + n_b :]]
        nodes = []
        for node in unit.gm.graph.nodes:
            op = canonical_op(node)
            if op is None:
                continue
            s = chosen[ids[node.name]]
            nodes.append({"op": op, "name": node.name, "ins": [list(x) for x in s.ins], "outs": [list(x) for x in s.outs]})
        units.append({"modules": unit.modules, "inputs": inputs, "params": storage, "nodes": nodes})
        for name, ph in zip(unit.param_names, phs[:n_p]):
            params[f"{unit_pattern(unit)}.{name}"] = {"shape": list(ph.meta["val"].shape), "count": len(unit.modules),
                                                      "storage": storage[name], "compute": _compute_spec(ph, chosen, ids)}
    return units, params
