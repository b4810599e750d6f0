"""Every private torch API the solver touches, in one place (checked on torch 2.11 and 2.13).

DTensor's sharding propagator keeps per-op strategy generators in dictionaries; their shape changed
between releases (2.13 moved pointwise ops to per-mesh-dim "single dim" rules), so only three
things are used: look an op up, call a full-mesh strategy function on an OpSchema of candidate
OpStrategies, and call a single-dim rule function with the args' tensor metadata.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, TupleStrategy

try:
    from torch.distributed.tensor._op_schema import OpSpec
except ImportError:  # older name of the same class
    from torch.distributed.tensor._op_schema import PlacementStrategy as OpSpec  # type: ignore[no-redef]

aten = torch.ops.aten

__all__ = ["DTensorSpec", "TensorMeta", "OpSchema", "OpStrategy", "OpSpec", "TupleStrategy"]


def _propagator() -> Any:
    return DTensor._op_dispatcher.sharding_propagator


def strategy_kind(op: Any) -> str | None:
    """'full' (a full-mesh OpStrategy generator), 'single' (per-mesh-dim rules), or None."""
    prop = _propagator()
    if op in getattr(prop, "op_single_dim_strategy_funcs", {}):
        return "single"
    if op in prop.op_strategy_funcs:
        return "full"
    return None


def schema_info(op: Any) -> Any:
    prop = _propagator()
    info = prop.op_to_schema_info.get(op)
    if info is None:
        info = getattr(prop, "op_to_schema_info_for_single_dim_strategy", {}).get(op)
    return info


def call_full_strategy(op: Any, args: tuple, kwargs: dict) -> Any:
    """The op's OpStrategy. Its redistribute costs (DTensor's own estimate, which the solver does not
    read) are left at zero: computing them was 80% of the strategy queries' time (8B on 8 x 8)."""
    from torch.distributed.tensor._ops import utils

    schema = OpSchema(op, args, kwargs, schema_info=schema_info(op))
    priced = utils.redistribute_cost
    utils.redistribute_cost = _unpriced
    try:
        return _propagator().op_strategy_funcs[op](schema)
    finally:
        utils.redistribute_cost = priced


def _unpriced(src: Any, dst: Any) -> float:
    return 0.0


def call_single_dim_rules(op: Any, args: tuple, kwargs: dict) -> list[list[Any]]:
    """Per-mesh-dim rules [outputs..., inputs...]; sharding placeholders are returned as ints."""
    info = _propagator().op_single_dim_strategy_funcs[op]
    func: Callable = getattr(info, "func", info)
    schema = OpSchema(op, args, kwargs, schema_info=schema_info(op))
    rules = func(op, schema.args_meta, schema.kwargs_meta)
    out = []
    for rule in rules:
        out.append([p.dim if type(p).__name__ == "_ShardingPlaceholder" else p for p in rule])
    return out


def current_trace_graph() -> torch.fx.Graph | None:
    """The graph make_fx is appending to right now (for attributing nodes to modules)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return None if mode is None else mode.tracer.graph


_CPU_FLASH = "_scaled_dot_product_flash_attention_for_cpu"


def register_cpu_attention_strategies() -> None:
    """DTensor has strategies for the CUDA SDPA kernels but not for the CPU flash kernel: give it the
    same batch- and head-parallel ones, so CPU runs (tests) can shard attention like the GPU."""
    from torch.distributed.tensor.experimental import register_sharding

    fwd = getattr(aten, _CPU_FLASH).default
    bwd = getattr(aten, _CPU_FLASH + "_backward").default
    if strategy_kind(fwd) is None:

        @register_sharding(fwd)
        def _fwd(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
            rules = [([Replicate(), Replicate()], [Replicate(), Replicate(), Replicate(), None, None])]
            for d in (0, 1):
                rules.append(([Shard(d), Shard(d)], [Shard(d), Shard(d), Shard(d), None, None]))
            return rules

    if strategy_kind(bwd) is None:

        @register_sharding(bwd)
        def _bwd(grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
            rules = [([Replicate()] * 3, [Replicate()] * 6 + [None, None])]
            for d in (0, 1):
                rules.append(([Shard(d)] * 3, [Shard(d)] * 6 + [None, None]))
            return rules
