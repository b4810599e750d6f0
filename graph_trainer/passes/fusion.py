"""Which values of a train-step graph Inductor computes inside the kernels that read them, never
writing them to memory: what the memory simulation (`liveness`) leaves out under a whole-graph compile.

Inductor fuses an op it generates code for (pointwise, a cast, a softmax and its backward) into each
reader it also generates code for (pointwise ops and reductions, the NLL's gather and scatter); a
value is written out when an extern kernel reads it (a matmul, attention, a collective), when it
leaves the piece of the graph compiled together (`block_compile`: a block's forward, its backward,
the loss between), or when it is an output. Where this counts and the unfused count did not, on 4
H200s (llama3 8B dp_shard 4, 8192 tokens, memory budget 45 GiB, bench/results/2026-11-28-pointwise-
recompute): the cross-entropy's fp32 [tokens, vocab] log-softmax and its gradient, two of the four
such tensors the unfused graph holds at the loss (the scatter of the NLL's gradient is written).
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterable

import torch
from torch import fx

from .liveness import alias_of

aten = torch.ops.aten

FUSING_BACKENDS = ("full", "autoparallel_backend")
"""`--compile.inductor_compilation` backends that compile the whole step with Inductor."""

FUSED_COMPOSITES = {aten._log_softmax.default, aten._softmax.default, aten._log_softmax_backward_data.default,
                    aten._softmax_backward_data.default}
"""Ops Inductor decomposes into pointwise ops and reductions over the last dimension."""
GENERATED_READERS = FUSED_COMPOSITES | {aten.sum.dim_IntList, aten.amax.default, aten.mean.dim, aten.gather.default,
                                        aten.nll_loss_forward.default, aten.nll_loss_backward.default}
"""Ops besides the pointwise ones whose kernels Inductor generates, so they read a fused value's inputs."""


def cheap(node: fx.Node) -> bool:
    """An op Inductor fuses into whatever reads its value: pointwise, a cast on the same device, a view."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target is aten._to_copy.default:
        kwargs, source = node.kwargs, node.args[0].meta.get("val")
        same_device = "device" not in kwargs or isinstance(source, torch.Tensor) and kwargs["device"] == source.device
        return set(kwargs) <= {"dtype", "layout", "device"} and kwargs.get("layout", torch.strided) == torch.strided and same_device
    return torch.Tag.pointwise in target.tags or target.is_view or target is aten._unsafe_view.default


def _generated(node: fx.Node) -> bool:
    return node.op == "call_function" and (cheap(node) or node.target in GENERATED_READERS)


def _readers(node: fx.Node) -> list[fx.Node]:
    """The ops that read `node`'s value, looking through views of it (a view is indexing, not a kernel)."""
    found = []
    for user in node.users:
        if isinstance(user.target, torch._ops.OpOverload) and user.target.is_view:
            found.extend(_readers(user))
        else:
            found.append(user)
    return found


def unmaterialized(nodes: Iterable[fx.Node], piece: Callable[[fx.Node], Hashable]) -> set[fx.Node]:
    """The values made by fusable ops whose every reader (through views) is a generated op of the same
    `piece`: Inductor inlines them into their readers' kernels."""
    fused = set()
    for node in nodes:
        if node.op != "call_function" or alias_of(node) is not None or not (cheap(node) or node.target in FUSED_COMPOSITES):
            continue
        readers = _readers(node)
        if readers and all(_generated(r) and piece(r) == piece(node) for r in readers):
            fused.add(node)
    return fused
