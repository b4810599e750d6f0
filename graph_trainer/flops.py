"""FLOPs of one aten node, from torch's flop formulas: one count for the solver, the scheduling
passes and the prediction file."""

from __future__ import annotations

import torch
from torch import fx
from torch._higher_order_ops.flex_attention import flex_attention, flex_attention_backward
from torch.utils.flop_counter import flop_registry


_SDPA_KERNELS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
FLEX_ATTENTION_OPS = {flex_attention: False, flex_attention_backward: True}
"""FlexAttention's higher-order ops (no aten overloads: one Triton kernel a call), whether backward."""


def _attention_flops(node: fx.Node) -> int | None:
    """The SDPA kernels and FlexAttention, counted here rather than by the flop registry: it does not list
    the CPU flash kernel, torch 2.11's formulas reject grouped-query attention's k and v with fewer heads
    than q (as the CUDA kernels take them), which counted 0, and not every torch lists FlexAttention's
    ops. Two matmuls per query head forward (q k^T over the query's head dim, the scores times v over
    v's; GQA shares k/v, a block mask is not subtracted, as causal SDPA's is not), 2.5x that backward
    (as the registry counts them)."""
    target = node.target
    if target in FLEX_ATTENTION_OPS:
        backward, qkv = FLEX_ATTENTION_OPS[target], node.args[:3]
    else:
        name = target._opname if isinstance(target, torch._ops.OpOverload) else ""
        backward = name.endswith("_backward")
        if name.removesuffix("_backward") not in _SDPA_KERNELS:
            return None
        qkv = node.args[1:4] if backward else node.args[:3]
    q, k, v = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in qkv)
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return None
    b, h, sq, d = q.shape
    forward = 2 * b * h * sq * k.shape[-2] * (d + v.shape[-1])
    return forward * 5 // 2 if backward else forward


def node_flops(node: fx.Node) -> int:
    """FLOPs of one call node on its `meta["val"]` shapes (0 for ops without a formula)."""
    if node.op != "call_function":
        return 0
    attention = _attention_flops(node)
    if attention is not None:
        return attention
    target = node.target
    formula = flop_registry.get(getattr(target, "overloadpacket", None)) or flop_registry.get(target)
    if formula is None:
        return 0
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    try:
        return int(formula(*args, out_val=node.meta.get("val"), **kwargs))
    except Exception:  # noqa: BLE001  (a formula that cannot read these shapes counts as no FLOPs)
        return 0
