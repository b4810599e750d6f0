"""The private torch pieces the collective scheduling passes use, imported in this one place.

From `torch._inductor.fx_passes.bucketing` we take only the FSDP predicates, called with the node
alone: their signatures changed between releases (one version requires a precomputed ancestor map,
2.13 makes it optional). We do not call its merge helpers or `overlap_scheduling`:
- `merge_all_gather` copies the bucket into a slice of an `empty` buffer in place and splits the
  result; the traced train step runs with autograd enabled on parameter shards that require grad,
  where that in-place write into a split view raises ("Output 0 of Split is a view and is being
  modified inplace"), and its argument order changed between 2.11 and 2.13;
- `schedule_overlap_bucketing` estimates compute with Triton's GPU roofline (on CPU it fails with
  "0 active drivers") and aligns benchmarked estimates across ranks.
So the merge and the schedule are ours (bucketing.py), driven by cost_model.py.

Meta's optional `autoparallel` package is imported here too (`--compile.autoparallel_impl meta`).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

try:
    from torch._inductor.fx_passes.bucketing import is_fsdp_all_gather as _is_fsdp_all_gather
    from torch._inductor.fx_passes.bucketing import is_fsdp_reduce_scatter as _is_fsdp_reduce_scatter
except ImportError as e:  # pragma: no cover  (present in 2.11 through 2.13; the message names the fix)
    raise ImportError(
        f"graph_trainer's bucketing passes need torch._inductor.fx_passes.bucketing (torch >= 2.11): {e}"
    ) from e
from torch.utils.flop_counter import flop_registry

_c10d = torch.ops._c10d_functional
ALL_GATHER = _c10d.all_gather_into_tensor.default
REDUCE_SCATTER = _c10d.reduce_scatter_tensor.default
ALL_REDUCE = _c10d.all_reduce.default
WAIT = _c10d.wait_tensor.default


def is_fsdp_all_gather(node: fx.Node) -> bool:
    """An all-gather of one parameter: its input derives from exactly one graph input."""
    return node.target is ALL_GATHER and bool(_is_fsdp_all_gather(node))


def is_fsdp_reduce_scatter(node: fx.Node) -> bool:
    """A gradient reduce-scatter: its result reaches the graph outputs through one-input ops only."""
    return node.target is REDUCE_SCATTER and bool(_is_fsdp_reduce_scatter(node))


def _attention_flops(node: fx.Node) -> int | None:
    """FLOPs of the CPU flash-attention kernels, which the flop registry does not list."""
    name = node.target._opname if isinstance(node.target, torch._ops.OpOverload) else ""
    if not name.startswith("_scaled_dot_product_flash_attention_for_cpu"):
        return None
    backward = name.endswith("_backward")
    q, k = (a.meta.get("val") for a in (node.args[1:3] if backward else node.args[:2]))
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return None
    b, h, sq, d = q.shape
    forward = 4 * b * h * sq * k.shape[-2] * d
    return forward * 5 // 2 if backward else forward


def node_flops(node: fx.Node) -> int:
    """FLOPs of one aten node from torch's flop formulas (0 for ops without one)."""
    attention = _attention_flops(node)
    if attention is not None:
        return attention
    target = node.target
    key = getattr(target, "overloadpacket", None)
    formula = flop_registry.get(key) or flop_registry.get(target)
    if formula is None:
        return 0
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    try:
        return int(formula(*args, out_val=node.meta.get("val"), **kwargs))
    except Exception:  # noqa: BLE001  (a formula that cannot read these shapes counts as no FLOPs)
        return 0


def fake_mode_of(values: list[Any]) -> FakeTensorMode:
    """The fake mode the graph was traced under (so new values share its shape environment)."""
    for v in values:
        if isinstance(v, FakeTensor):
            return v.fake_mode
    return FakeTensorMode(allow_non_fake_inputs=True)


META_AUTOPARALLEL_INSTALL = (
    "pip install git+https://github.com/meta-pytorch/autoparallel@da99589 "
    "(the newest commit that runs on torch 2.11)"
)


def meta_autobucketing() -> tuple[Callable[..., fx.GraphModule], type] | None:
    """Meta AutoParallel's aten-level bucketing/reordering pass and its config class, or None when
    the package is not installed (the module moved between its releases)."""
    for module in ("autoparallel.graph_passes.auto_bucketing", "autoparallel.auto_bucketing"):
        try:
            found = importlib.import_module(module)
        except ImportError:
            continue
        fn = getattr(found, "aten_autobucketing_reordering_pass", None)
        config = getattr(found, "aten_autobucketing_config", None)
        if fn is not None and config is not None:
            return fn, config
    return None
